"""Compiling for a target keeps decode's non-temporal weight prefetch only where it pays."""

from __future__ import annotations

import pytest
import tvm
from goinfer.compiler.lower import tvm_api
from goinfer.compiler.quant import int4, int8int8
from tir_inspect import prefetch_localities


@pytest.mark.parametrize("scheme", [int4, int8int8], ids=lambda s: s.NAME)
@pytest.mark.parametrize(
    ("mcpu", "decode_hint"), [("znver3", 0), ("znver4", 0), ("icelake-server", 3), ("haswell", 3)]
)
def test_target_keeps_non_temporal_prefetch_only_where_it_pays(scheme, mcpu, decode_hint):
    """AMD Zen keeps decode's non-temporal prefetch; on Intel it halved the GEMVs' read rate, so
    compiling for it turns them into ordinary ones. Prefill's stay ordinary everywhere."""
    target = tvm_api.make_target({**tvm_api.host_target(2), "mcpu": mcpu})
    func = tvm_api.specialize(tvm.IRModule({"main": scheme.kernel(40, 576)}), target)["main"]
    assert prefetch_localities(func) == ({decode_hint}, {3})
