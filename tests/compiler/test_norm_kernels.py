"""The RMSNorm kernels (alone, and with the residual add before it) against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from goinfer.compiler.kernels import norm
from goinfer.compiler.tvm import targets

# float32 sums in another order than numpy's float64: a few ulps
TOLERANCE = 1e-6


def _run(hidden: int, m: int, residual: bool, eps: float = 1e-5, seed: int = 0):
    target = targets.make_target(targets.host_target(2))
    func = norm.kernel(hidden, eps, residual).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target)
    rng = np.random.default_rng(seed)
    x, r = (rng.standard_normal((m, hidden)).astype(np.float32) * 3 for _ in range(2))
    w = rng.standard_normal(hidden).astype(np.float32)
    outs = [tvm.runtime.tensor(np.full((m, hidden), np.nan, np.float32)) for _ in range(1 + residual)]
    lib["main"](*map(tvm.runtime.tensor, [x, r, w] if residual else [x, w]), *outs)
    return x, r, w, [o.numpy() for o in outs]


def _want(s: np.ndarray, w: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    s64 = s.astype(np.float64)
    return s64 / np.sqrt((s64**2).mean(axis=-1, keepdims=True) + eps) * w


# hidden: the real models' (576, 640, 896), a multiple of 16 the tiny ones use (64), and sizes with
# a scalar tail (40, 7); m: decode (serial), short, and past SERIAL_MAX (a token a parallel task)
@pytest.mark.parametrize("hidden", [576, 640, 896, 64, 40, 7])
@pytest.mark.parametrize("m", [1, 3, 40])
def test_add_then_norm_matches_numpy(hidden, m):
    x, r, w, (s, y) = _run(hidden, m, residual=True)
    np.testing.assert_array_equal(s, x + r)  # the stream itself: exactly the float32 sum
    want = _want(x + r, w)
    assert np.abs(y - want).max() / np.abs(want).max() <= TOLERANCE


@pytest.mark.parametrize("hidden", [576, 40, 7])
@pytest.mark.parametrize("m", [1, 40])
def test_norm_alone_matches_numpy(hidden, m):
    x, _, w, (y,) = _run(hidden, m, residual=False)
    want = _want(x, w)
    assert np.abs(y - want).max() / np.abs(want).max() <= TOLERANCE


def test_eps_keeps_an_all_zero_token_finite():
    target = targets.make_target(targets.host_target(1))
    lib = tvm.compile(
        tvm.IRModule({"main": norm.kernel(32, 1e-6, False).with_attr("global_symbol", "main")}), target
    )
    y = tvm.runtime.tensor(np.full((1, 32), np.nan, np.float32))
    lib["main"](
        tvm.runtime.tensor(np.zeros((1, 32), np.float32)), tvm.runtime.tensor(np.ones(32, np.float32)), y
    )
    assert (y.numpy() == 0).all()
