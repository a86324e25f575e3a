"""int8int8 (W8A8) kernels against numpy: each form (VNNI, AVX2, portable) on each tier that can run it.

The reference is exact: `quantize_activations` (the numpy twin of the kernels' prologue) and an
integer matmul, so the only difference left is float32 rounding in the final rescale.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from goinfer.compiler import kernels
from goinfer.compiler.quant import int8int8
from goinfer.compiler.tvm import passes, targets

TOLERANCE = 1e-5  # max |got - want| / max |want|, as the startup self-test holds them to

HOST_TIER = targets.host_tier_name()
HAS_VNNI = HOST_TIER == "avx512-vnni"
HASWELL = {**targets.host_target(2), "mcpu": "haswell"}

# (out, in): K of the real models (576, 640, 896, 1536, 2048, 4864), rows that are and are not a
# multiple of the 16-row block or of the prefill task's 32 rows; tiny K the test models use.
SHAPES = [(40, 576), (37, 640), (48, 896), (23, 1536), (33, 2048), (50, 4864), (16, 64), (5, 128)]
ODD_K = (19, 100)  # 25 words: tails in the prologue's vectors and the decode k-unroll
TOKENS = (1, 2, 5, 7, 32, 45)  # decode, short inputs, prefill tiles with and without a tail


def _compile(func: tvm.tirx.PrimFunc, target: dict):
    mod = passes.specialize(
        tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), targets.make_target(target)
    )
    return tvm.compile(mod, targets.make_target(target))


def _check(lib, n: int, k: int, ms: tuple[int, ...], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    packed = int8int8.pack(rng.standard_normal((n, k)).astype(np.float32))
    params = [packed[name] for name in ("weight", "wsum", "scale")]
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :3] *= 40  # one outlier channel: the per-token scale must follow it
        y = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32))
        lib["main"](tvm.runtime.tensor(x), *map(tvm.runtime.tensor, params), y)
        want = int8int8.reference(x, *params)
        err = np.abs(y.numpy() - want).max() / np.abs(want).max()
        assert err <= TOLERANCE, (n, k, m, err)


def test_pack_round_trips_and_sums():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((37, 64)).astype(np.float32)
    p = int8int8.pack(w)
    specs = int8int8.param_specs(37, 64)
    assert {k: (v.shape, str(v.dtype)) for k, v in p.items()} == specs
    q = int8int8.unpack(p["weight"], 37)
    np.testing.assert_array_equal(q, np.clip(np.rint(w / p["scale"][:, None]), -127, 127))
    np.testing.assert_array_equal(p["wsum"], q.astype(np.int64).sum(axis=1))
    # rows past `out` are zero padding; word [b, j, r] is row 16b + r at k = 4j .. 4j+3
    assert not p["weight"][2, :, 5:].any()
    assert p["weight"][1, 3, 2] == np.frombuffer(q[18, 12:16].tobytes(), "<i4")[0]


def test_quantize_activations_twin():
    x = np.random.default_rng(3).standard_normal((4, 96)).astype(np.float32)
    x[3] = 0
    q, s = int8int8.quantize_activations(x)
    assert s[3] == 1 and not q[3].any()  # an all-zero token keeps scale 1
    assert (np.abs(q[:3]).max(axis=1) == 127).all()  # the peak lands on the edge
    assert (np.abs(q * s[:, None] - x) <= s[:, None] * (0.5 + 1e-5)).all()


@pytest.mark.skipif(not HAS_VNNI, reason=f"host tier {HOST_TIER} has no AVX-512 VNNI")
@pytest.mark.parametrize(("n", "k"), [*SHAPES, ODD_K])
def test_vnni_kernel_matches_numpy(n, k):
    _check(_compile(kernels.int8int8.kernel_variant(n, k, "vnni"), targets.host_target(2)), n, k, TOKENS)


@pytest.mark.parametrize(("n", "k"), [*SHAPES, ODD_K])
def test_avx2_kernel_matches_numpy(n, k):
    _check(_compile(kernels.int8int8.kernel_variant(n, k, "avx2"), HASWELL), n, k, TOKENS)


def test_avx2_sign_trick_holds_at_the_extremes():
    """|x| x sign-carried w in vpmaddubsw: pairs of 127 x 127 (and the weights' -127) must not
    saturate its int16 sums."""
    n, k = 16, 64
    rng = np.random.default_rng(5)
    packed = int8int8.pack(np.where(rng.random((n, k)) < 0.5, -1.0, 1.0).astype(np.float32))
    assert set(np.unique(int8int8.unpack(packed["weight"], n))) == {-127, 127}
    lib = _compile(kernels.int8int8.kernel_variant(n, k, "avx2"), HASWELL)
    x = np.where(rng.random((3, k)) < 0.5, -1.0, 1.0).astype(np.float32)
    y = tvm.runtime.tensor(np.zeros((3, n), np.float32))
    lib["main"](tvm.runtime.tensor(x), *map(tvm.runtime.tensor, packed.values()), y)
    want = x @ (int8int8.unpack(packed["weight"], n).astype(np.float32) * packed["scale"][:, None]).T
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("n", "k"), [(37, 640), (50, 4864), (16, 64), (5, 128), ODD_K])
def test_portable_kernel_matches_numpy(n, k):
    _check(_compile(kernels.int8int8.kernel_variant(n, k, "portable"), HASWELL), n, k, TOKENS)


def test_portable_kernel_matches_numpy_on_host():
    _check(
        _compile(kernels.int8int8.kernel_variant(48, 896, "portable"), targets.host_target(2)),
        48,
        896,
        (1, 40),
    )


def test_dispatched_kernel_picks_each_tiers_form():
    """`kernel` is the portable form, carrying the VNNI and AVX2 ones; compiling swaps in the tier's."""
    func = int8int8.matmul(37, 256)

    def script_for(mcpu: str) -> str:
        target = targets.make_target({**targets.host_target(2), "mcpu": mcpu})
        mod = passes.pick_isa_variants(tvm.IRModule({"main": func}), target)
        assert passes.ISA_VARIANTS not in mod["main"].attrs
        return mod["main"].script()

    assert "vpdpbusd" in script_for("icelake-server")
    assert "psign" in script_for("haswell") and "vpdpbusd" not in script_for("haswell")
    assert "psign" not in script_for("x86-64") and "vpdpbusd" not in script_for("x86-64")
    for _tier, target in targets.cpu_tiers(2):  # and each tier's form runs right here
        _check(_compile(func, target), 37, 256, (1, 6, 40))


def test_take_reads_the_interleaved_layout():
    from tvm import te

    rng = np.random.default_rng(2)
    n, k = 37, 64
    p = int8int8.pack(rng.standard_normal((n, k)).astype(np.float32))
    ids = te.placeholder((3,), "int32", name="ids")
    params = [te.placeholder(s, d, name=nm) for nm, (s, d) in int8int8.param_specs(n, k).items()]
    out = int8int8.take(ids, *params)
    func = te.create_prim_func([ids, *params, out]).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), targets.make_target(targets.host_target(1)))
    rows = np.array([0, 17, 36], np.int32)
    got = tvm.runtime.tensor(np.zeros((3, k), np.float32))
    lib["main"](
        tvm.runtime.tensor(rows), *(tvm.runtime.tensor(p[nm]) for nm in ("weight", "wsum", "scale")), got
    )
    want = int8int8.unpack(p["weight"], n)[rows] * p["scale"][rows, None]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
