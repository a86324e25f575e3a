"""The weight prefetch hints of the quantized matmuls: what each kernel form asks for, and what
compiling for a target keeps of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import tvm
from goinfer.compiler.kernels import affine, int8int8
from goinfer.compiler.quant import int4
from goinfer.compiler.tvm import passes, targets
from tir_inspect import prefetch_localities


def _affine(layout: affine.Layout) -> SimpleNamespace:
    return SimpleNamespace(
        kernel=lambda n, k: affine.kernel(n, k, layout),
        kernel_variant=lambda n, k, form: affine.kernel_variant(n, k, layout, form),
    )


SCHEMES = pytest.mark.parametrize(
    "scheme",
    [_affine(int4.LAYOUT), _affine(affine.Layout(8, 32, "float16", False, 128)), int8int8],
    ids=["int4", "gguf-q8_0", "int8int8"],
)


@SCHEMES
@pytest.mark.parametrize("form", ["portable", "avx2", "vnni"])
def test_decode_prefetches_non_temporal_and_prefill_keeps_its_panels(scheme, form):
    """Decode reads each weight once: its prefetch must not push the rest out of the caches. A
    prefill panel reads its weights once per token tile, so they stay."""
    decode, prefill = prefetch_localities(scheme.kernel_variant(40, 576, form))
    assert decode == {0} and prefill == {3}


@SCHEMES
@pytest.mark.parametrize(
    ("mcpu", "decode_hint"), [("znver3", 0), ("znver4", 0), ("icelake-server", 3), ("haswell", 3)]
)
def test_target_keeps_non_temporal_prefetch_only_where_it_pays(scheme, mcpu, decode_hint):
    """AMD Zen keeps decode's non-temporal prefetch; on Intel it halved the GEMVs' read rate, so
    compiling for it turns them into ordinary ones. Prefill's stay ordinary everywhere."""
    target = targets.make_target({**targets.host_target(2), "mcpu": mcpu})
    func = passes.specialize(tvm.IRModule({"main": scheme.kernel(40, 576)}), target)["main"]
    assert prefetch_localities(func) == ({decode_hint}, {3})
