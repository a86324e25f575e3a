"""The grouped affine kernels in every layout the gguf transcode uses (int4's own layout has its
tests in test_int4_kernels.py): each form on each tier that can run it against the numpy twin, and
the embedding rows against the value-exact dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from goinfer.compiler.kernels import affine
from goinfer.compiler.kernels.affine import Layout
from goinfer.compiler.quant import affine as packing
from goinfer.compiler.tvm import passes, targets

TOLERANCE = 1e-5  # max |got - want| / max |want|, as the startup self-test holds them to
HAS_VNNI = targets.host_tier_name() == "avx512-vnni"
HASWELL = {**targets.host_target(2), "mcpu": "haswell"}
TOKENS = (1, 5, 9)  # decode, a prefill tile with a tail

LAYOUTS = {
    "q4_1": Layout(4, 32, "float16", True, 0),
    "q4_k": Layout(4, 32, "int8", True, 0),
    "q5_0": Layout(5, 32, "float16", False, 16),
    "q5_k": Layout(5, 32, "int8", True, 0),
    "q5_0+q8_0": Layout(8, 32, "float16", False, 128),
    "q5_1": Layout(5, 32, "float16", True, 0),
    "q6_k": Layout(6, 16, "int8", False, 32),
    "q4_k+q6_k": Layout(6, 16, "int8", True, 32),
    "q6_k+q8_0": Layout(8, 16, "float32", False, 128),
    "mixed-float32": Layout(8, 32, "float32", True, 128),
    "q8_0-minus-128": Layout(8, 32, "float16", False, 128, full_range=True),
}


def _check(lib, layout: Layout, n: int, k: int) -> None:
    p = packing.example(layout, n, k)
    rng = np.random.default_rng(1)
    for m in TOKENS:
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :3] *= -40  # one outlier channel: only its own group's scale follows it
        y = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32))
        lib["main"](tvm.runtime.tensor(x), *map(tvm.runtime.tensor, p.values()), y)
        want = packing.reference(layout, x, p, n)
        err = np.abs(y.numpy() - want).max() / np.abs(want).max()
        assert err <= TOLERANCE, (layout.tag, n, k, m, err)
        # and the twin is the float product with the dequantized weights, up to int8 activations
        exact = x.astype(np.float64) @ packing.dequantize(layout, p, n).T.astype(np.float64)
        assert np.abs(want - exact).max() <= 0.02 * np.abs(exact).max()


def _compile(func: tvm.tirx.PrimFunc, target: dict):
    tgt = targets.make_target(target)
    return tvm.compile(
        passes.specialize(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), tgt), tgt
    )


FORMS = [
    pytest.param("vnni", marks=pytest.mark.skipif(not HAS_VNNI, reason="host has no AVX-512 VNNI")),
    "avx2",
    "portable",
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_form_matches_numpy(name: str, form: str) -> None:
    layout = LAYOUTS[name]
    n, k = 37, 512  # a padded last row block; two K-quant super-blocks
    target = targets.host_target(2) if form == "vnni" else HASWELL
    _check(_compile(affine.kernel_variant(n, k, layout, form), target), layout, n, k)


def test_signature_has_only_the_layouts_parameters() -> None:
    """x, weight, scale[, min][, super_scale][, super_min], y: what param_specs lists, in order."""
    for layout in LAYOUTS.values():
        func = affine.kernel_variant(16, 256, layout, "portable")
        assert len(func.params) == 2 + len(packing.param_specs(layout, 16, 256))


@pytest.mark.parametrize("name", ["q4_k", "q4_k+q6_k", "q5_1", "q5_0", "q5_k"])
def test_take_gives_the_exact_rows(name: str) -> None:
    from tvm import te

    layout, n, k = LAYOUTS[name], 37, 256
    p = packing.example(layout, n, k)
    ids = te.placeholder((3,), "int32", name="ids")
    params = [te.placeholder(s, d, name=nm) for nm, (s, d) in packing.param_specs(layout, n, k).items()]
    func = te.create_prim_func([ids, *params, affine.take(layout)(ids, *params)])
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    rows = np.array([0, 17, 36], np.int32)
    got = tvm.runtime.tensor(np.zeros((3, k), np.float32))
    lib["main"](tvm.runtime.tensor(rows), *map(tvm.runtime.tensor, p.values()), got)
    np.testing.assert_array_equal(got.numpy(), packing.dequantize(layout, p, n)[rows])
