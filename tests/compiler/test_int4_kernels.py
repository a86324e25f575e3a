"""int4 (W4A8) kernels against numpy: each form (VNNI, AVX2, portable) on each tier that can run it.

The reference is exact up to float rounding: `quantize_activations` (the numpy twin of the kernels'
prologue), integer sums per group of 32, and the two scales applied per group.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from goinfer.compiler import kernels
from goinfer.compiler.kernels.rowblock import prefetch_ahead
from goinfer.compiler.quant import int4
from goinfer.compiler.tvm import passes, targets
from tvm.sym.analyzer import Analyzer

TOLERANCE = 1e-5  # max |got - want| / max |want|, as the startup self-test holds them to

HOST_TIER = targets.host_tier_name()
HAS_VNNI = HOST_TIER == "avx512-vnni"
HASWELL = {**targets.host_target(2), "mcpu": "haswell"}

# (out, in): K of the real models (576, 640, 896, 1536, 2048, 4864), rows that are and are not a
# multiple of the 16-row block or of a 2-block task; tiny K the test models use.
SHAPES = [(40, 576), (37, 640), (48, 896), (23, 1536), (33, 2048), (50, 4864), (16, 64), (5, 32)]
TOKENS = (1, 2, 5, 7, 32, 45)  # decode, short inputs, prefill tiles with and without a tail


def _compile(func: tvm.tirx.PrimFunc, target: dict):
    mod = passes.specialize(
        tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), targets.make_target(target)
    )
    return tvm.compile(mod, targets.make_target(target))


def _check(lib, n: int, k: int, ms: tuple[int, ...], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    packed = int4.pack(rng.standard_normal((n, k)).astype(np.float32))
    params = [packed["weight"], packed["scale"]]
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :3] *= 40  # one outlier channel: only its own group's scale follows it
        y = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32))
        lib["main"](tvm.runtime.tensor(x), *map(tvm.runtime.tensor, params), y)
        want = int4.reference(x, *params, n)
        err = np.abs(y.numpy() - want).max() / np.abs(want).max()
        assert err <= TOLERANCE, (n, k, m, err)


def test_pack_round_trips():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((37, 64)).astype(np.float32)
    p = int4.pack(w)
    assert {k: (v.shape, str(v.dtype)) for k, v in p.items()} == int4.param_specs(37, 64)
    q, scale = int4.quantize(w)
    np.testing.assert_array_equal(int4.unpack_q(p["weight"], 37), q)
    np.testing.assert_array_equal(int4.unpack_scale(p["scale"], 37), scale.astype(np.float32))
    assert q.min() >= -8 and q.max() <= 7
    # word [b, j, r] is row 16b + r at k = 8j .. 8j+7: byte i holds k = 8j+i low, 8j+4+i high
    word = int(p["weight"][1, 3, 2])
    row = q[18, 24:32].astype(np.int32) + 8
    assert [(word >> (8 * i)) & 0xF for i in range(4)] == list(row[:4])
    assert [(word >> (8 * i + 4)) & 0xF for i in range(4)] == list(row[4:])
    # rows past `out` are padding: q = 0 (nibble 8) and scale 0
    assert (int4.unpack_q(p["weight"], 48)[37:] == 0).all() and not p["scale"][2, :, 5:].any()
    # the dequantized weights are close to the source (4 bits: ~8% rms of a Gaussian)
    err = np.sqrt(((int4.unpack(p["weight"], p["scale"], 37) - w) ** 2).mean() / (w**2).mean())
    assert err < 0.12


def test_activation_twin_and_reference_track_the_float_product():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    x[3] = 0
    q, s = int4.quantize_activations(x)
    assert (s[3] == 1).all() and not q[3].any()  # an all-zero group keeps scale 1
    assert (np.abs(q[:3]).reshape(3, 3, 32).max(axis=2) == 127).all()  # each group's peak on the edge
    w = rng.standard_normal((20, 96)).astype(np.float32)
    p = int4.pack(w)
    exact = x @ int4.unpack(p["weight"], p["scale"], 20).T
    got = int4.reference(x, p["weight"], p["scale"], 20)
    assert np.abs(got - exact).max() <= 0.01 * np.abs(exact).max()  # int8 activations cost ~0.3%


@pytest.mark.skipif(not HAS_VNNI, reason=f"host tier {HOST_TIER} has no AVX-512 VNNI")
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_vnni_kernel_matches_numpy(n, k):
    _check(
        _compile(kernels.affine.kernel_variant(n, k, int4.LAYOUT, "vnni"), targets.host_target(2)),
        n,
        k,
        TOKENS,
    )


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_avx2_kernel_matches_numpy(n, k):
    _check(_compile(kernels.affine.kernel_variant(n, k, int4.LAYOUT, "avx2"), HASWELL), n, k, TOKENS)


def test_avx2_int16_pair_sums_do_not_overflow():
    """The worst case for AVX2's int16 group sums: every nibble 15 (q = 7) against +-127."""
    n, k = 16, 64
    packed = int4.pack(np.ones((n, k), np.float32))
    packed["weight"][:] = 0xFFFFFFFF  # every nibble 15
    packed["scale"][:] = 1
    assert (int4.unpack_q(packed["weight"], n) == 7).all()
    lib = _compile(kernels.affine.kernel_variant(n, k, int4.LAYOUT, "avx2"), HASWELL)
    for sign in (1.0, -1.0):
        x = np.full((2, k), sign, np.float32)
        y = tvm.runtime.tensor(np.zeros((2, n), np.float32))
        lib["main"](tvm.runtime.tensor(x), *map(tvm.runtime.tensor, packed.values()), y)
        want = int4.reference(x, packed["weight"], packed["scale"], n)
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-6)


def test_prefetch_runs_into_the_threads_next_task():
    """Near a row block's end the line ahead is the same block of the thread's next task, not the
    task's own next block (which is already being read)."""
    blocks, words, ahead = 8, 20, 4
    w = tvm.tirx.decl_buffer((blocks, words, 16), "uint32", name="w")

    def flat_word(block: int, word: int, task_blocks: int) -> int:
        load = prefetch_ahead(w, block, word, ahead, words, task_blocks).args[1].args[0]
        b, j, _ = (int(Analyzer().simplify(i)) for i in load.indices)
        return b * words + j

    assert flat_word(2, 3, 2) == 2 * words + 7  # mid-block: 4 words further along the same block
    assert flat_word(2, 18, 2) == 4 * words + 2  # task (2, 3): block 2 runs into block 4
    assert flat_word(3, 18, 2) == 5 * words + 2  # and block 3 into block 5
    assert flat_word(2, 18, 1) == 3 * words + 2  # one block a task: the next block is the next task


@pytest.mark.parametrize(("n", "k"), [(37, 640), (50, 4864), (16, 64), (5, 32)])
def test_portable_kernel_matches_numpy(n, k):
    _check(_compile(kernels.affine.kernel_variant(n, k, int4.LAYOUT, "portable"), HASWELL), n, k, TOKENS)


def test_dispatched_kernel_picks_each_tiers_form():
    """`kernel` is the portable form, carrying the VNNI and AVX2 ones; compiling swaps in the tier's."""
    func = int4.matmul(37, 256)

    def script_for(mcpu: str) -> str:
        target = targets.make_target({**targets.host_target(2), "mcpu": mcpu})
        return passes.pick_isa_variants(tvm.IRModule({"main": func}), target)["main"].script()

    assert "vpdpbusd" in script_for("icelake-server")
    assert "pmadd.ub.sw" in script_for("haswell") and "vpdpbusd" not in script_for("haswell")
    assert "pmadd" not in script_for("x86-64") and "vpdpbusd" not in script_for("x86-64")
    for _tier, target in targets.cpu_tiers(2):  # and each tier's form runs right here
        _check(_compile(func, target), 37, 256, (1, 6, 40))


def test_take_reads_the_interleaved_layout():
    from tvm import te

    rng = np.random.default_rng(2)
    n, k = 37, 64
    p = int4.pack(rng.standard_normal((n, k)).astype(np.float32))
    ids = te.placeholder((3,), "int32", name="ids")
    params = [te.placeholder(s, d, name=nm) for nm, (s, d) in int4.param_specs(n, k).items()]
    func = te.create_prim_func([ids, *params, int4.take(ids, *params)]).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), targets.make_target(targets.host_target(1)))
    rows = np.array([0, 17, 36], np.int32)
    got = tvm.runtime.tensor(np.zeros((3, k), np.float32))
    lib["main"](tvm.runtime.tensor(rows), *(tvm.runtime.tensor(p[nm]) for nm in ("weight", "scale")), got)
    want = int4.unpack(p["weight"], p["scale"], n)[rows]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
