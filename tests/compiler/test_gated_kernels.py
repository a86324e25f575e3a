"""The gated MLP's activation kernel against float64 numpy, including the tails of its sigmoid.

Widths: the real models' (1536, 2048, 4864), small ones, and ones 16 does not divide (the 8/4/2/1
tail pieces); token counts on both sides of the serial/parallel switch and of a chunked row.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from goinfer.compiler.kernels import gated
from goinfer.compiler.tvm import targets

EXTREMES = [100, -100, 1e4, -1e4, 0, -0.0, 88, -88, 1e30, -1e30, 3e38, -3e38, 1e-30, 20, -20, 9]


def _reference(x: np.ndarray, inter: int, activation: str) -> np.ndarray:
    g, up = x[:, :inter].astype(np.float64), x[:, inter:].astype(np.float64)
    # gelu: 0.5 (1 + tanh u) = 1 / (1 + e^-2u), without tanh's cancellation for u << 0
    v = g if activation == "silu" else 2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)
    with np.errstate(over="ignore"):  # e^1e4 is inf, and g / inf the right 0
        return g / (1 + np.exp(-v)) * up


def _tolerance(x: np.ndarray, inter: int, activation: str) -> np.ndarray:
    """Relative error allowed per output: silu a few ulps; gelu_tanh's argument v = 2u is computed
    in float32, so e^-v carries its rounding, about 2 * 2^-24 * |v| (1e-5 at x = -9)."""
    if activation == "silu":
        return np.full((x.shape[0], inter), 3e-7)
    g = x[:, :inter].astype(np.float64)
    return 3e-7 + 2.5e-7 * np.abs(2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))


def _check(got: np.ndarray, x: np.ndarray, inter: int, activation: str) -> float:
    want = _reference(x, inter, activation)
    assert np.isfinite(got).all()
    live = np.abs(want) > 1e-30
    rel = np.abs(got - want)[live] / np.abs(want)[live]
    assert (rel <= _tolerance(x, inter, activation)[live]).all(), rel.max()
    assert (np.abs(got[~live]) <= 1e-30).all()  # a dead gate gives 0, not an artifact of a huge e^-v
    return rel.max()


HOST = targets.host_target(2)
HASWELL = {**HOST, "mcpu": "haswell"}  # the AVX2 tier a bundle also carries: 16 lanes as 2 x 8


def _compile(inter: int, activation: str, target: dict = HOST):
    func = gated.kernel(inter, activation).with_attr("global_symbol", "main")
    return tvm.compile(tvm.IRModule({"main": func}), targets.make_target(target))


def _run(lib, x: np.ndarray, inter: int) -> np.ndarray:
    y = tvm.runtime.tensor(np.full((x.shape[0], inter), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(x), y)
    return y.numpy()


@pytest.mark.parametrize("activation", gated.ACTIVATIONS)
@pytest.mark.parametrize(
    ("inter", "target"),
    [(64, HOST), (1536, HOST), (2048, HOST), (4864, HOST), (40, HOST), (45, HOST), (6, HOST), (1, HOST),
     (4864, HASWELL), (45, HASWELL)],
    ids=lambda v: {id(HOST): "host", id(HASWELL): "avx2"}.get(id(v)),
)  # fmt: skip
def test_kernel_matches_numpy(activation, inter, target):
    lib = _compile(inter, activation, target)
    rng = np.random.default_rng(inter)
    for m in (1, 2, 5, 37):
        x = (rng.standard_normal((m, 2 * inter)) * 3).astype(np.float32)
        ext = np.array(EXTREMES[:inter], np.float32)
        x[0, : ext.size] = ext  # the sigmoid's tails, overflow of x^3 and of e^-v
        x[-1, inter - ext.size : inter] = ext  # again at the row's end (the tail pieces)
        x[0, inter : inter + ext.size] = x[-1, 2 * inter - ext.size :] = 1  # act * up stays finite
        _check(_run(lib, x, inter), x, inter, activation)


@pytest.mark.parametrize("activation", gated.ACTIVATIONS)
def test_dense_range_and_limits(activation):
    """x over [-30, 30] densely (up = 1), and the limits exactly."""
    inter = 1 << 15
    g = np.concatenate([np.linspace(-30, 30, inter - 8), [1e4, -1e4, 1e30, -1e30, 100, -100, 0, -0.0]])
    x = np.concatenate([g, np.ones(inter)])[None].astype(np.float32)
    got = _run(_compile(inter, activation), x, inter)
    np.testing.assert_array_equal(got[0, -8:], np.float32([1e4, 0, 1e30, 0, 100, 0, 0, 0]))
    _check(got, x, inter, activation)


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="unknown activation"):
        gated.kernel(64, "relu")
