"""The row-block scaffolding int4's and int8int8's matmul kernels share.

Both keep W as (ceil(out/16), words, 16) 32-bit words: word [b, j, r] is row 16b + r at the j-th
step along k, so one 64-byte vector is a word of 16 rows, an accumulator's 16 lanes are 16 outputs
(no horizontal sums) and a block is read along k in storage order. Both quantize x to int8 per call
in a prologue (`scale_of`, `to_int8`), then run register tiles of tokens x row blocks with software
prefetch along each block (`RowBlocks`): decode (m = 1) in a kernel's own tasks, prefill in
`panels`. Each kernel comes in FORMS, exported as the portable one carrying the others
(`with_forms`).

Everything here is Python the TVMScript parser calls, so it inlines: the generated TIR is what
each kernel spelled out for itself before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from ..tvm import passes, tvmscript

tvmscript.install()  # faster TVMScript parsing, the same kernels

ROW_BLOCK = 16  # output rows per weight vector (one int32 lane each)
FORMS = ("vnni", "avx2", "portable")
# The LLVM CPU feature each ISA-specific form needs, best first; "portable" runs anywhere.
FEATURES = {"vnni": "avx512vnni", "avx2": "avx2"}
Tile = tuple[int, int]  # (tokens, row blocks) of accumulators a task keeps in registers
Gemm = Callable[[int, int, str], tirx.PrimFunc]  # (out_features, in_features, form) -> kernel


def with_forms(gemm: Gemm, out_features: int, in_features: int) -> tirx.PrimFunc:
    """`gemm`'s portable form, carrying its VNNI and AVX2 forms for the tiers that have them
    (tvm/passes.py swaps one in when compiling for such a target)."""
    portable = gemm(out_features, in_features, "portable")
    forms = [(FEATURES[f], gemm(out_features, in_features, f)) for f in FORMS if f in FEATURES]
    return passes.with_isa_variants(portable, forms)


def vec(start, n: int = ROW_BLOCK):
    return T.ramp(start, 1, n)


def tok(t0, t, m):
    """Token t0 + t, clamped: a tile hanging over the last token reads it and stores nothing."""
    return T.min(t0 + t, m - 1)


@dataclass(frozen=True)
class RowBlocks:
    """A (blocks, words, ROW_BLOCK) weight of n_rows rows, read along its words."""

    n_rows: int
    words: int
    prefetch_bytes: int  # software prefetch distance along a row block: the hardware prefetcher lags

    @property
    def blocks(self) -> int:
        return -(-self.n_rows // ROW_BLOCK)

    def blk(self, b0, r):
        """Row block b0 + r, clamped: a tile hanging over the last block reads it, stores nothing."""
        return T.min(b0 + r, self.blocks - 1)

    def prefetch(self, w, block, word, task_blocks: int, once: bool) -> tirx.PrimExpr:
        """Prefetch `block`'s weights prefetch_bytes past `word` (see `prefetch_ahead`)."""
        ahead = self.prefetch_bytes // (ROW_BLOCK * 4)  # in words: a block's step along k is one line
        return prefetch_ahead(w, block, word, ahead, self.words, task_blocks, once)


def prefetch_ahead(
    w, block, word, ahead: int, words: int, task_blocks: int, once: bool = False
) -> tirx.PrimExpr:
    """Prefetch w[block, word + ahead, 0], w being a kernel's (blocks, words, 16) row-block weights
    read along `words`; `once` (decode, where a call reads each weight once) makes it
    non-temporal on the CPUs where that pays (`passes.specialize`: AMD Zen, not Intel).

    Non-temporal, decode's weight stream (the whole model, every token) stops pushing out of the
    caches what a decode step keeps using: the code, the VM's and Python's objects, activations
    and the KV cache. Decode on Zen 3, ms a token (two bundles interleaved in one process, median
    of 16-40; logits identical): SmolLM2 int4 3.42 -> 3.26, int8int8 5.25 -> 4.94, Qwen-0.5B int4
    11.17 -> 10.86. On a Xeon it was the other way: with it, SmolLM2 int4 took 5.88 ms a token
    against 2.16, Qwen-0.5B 20.1 against 9.7. A GEMM panel reads its weights again for each
    token tile, so prefill keeps the ordinary prefetch.

    Near a block's end, the line ahead falls in the next block. A task reads `task_blocks`
    consecutive blocks side by side and a thread's next task the `task_blocks` after them, so
    skip to the same block of that next task; otherwise the first lines of each task but one go
    unprefetched. With 4.6-5 KB blocks (K = 576, 640) that was a fifth of the weights: int4 decode
    GEMVs at two blocks a task 3-10% faster on every model's shapes (SmolLM2, Gemma-3, Qwen-0.5B;
    A/B in one process).
    """
    skip = tirx.if_then_else(word + ahead >= words, task_blocks - 1, 0) if task_blocks > 1 else 0
    return passes.prefetch_read(tirx.address_of(w[block + skip, word + ahead, 0]), once)


# -- the prologue: x to int8 at run time ---------------------------------------------------------


def scale_of(amax):
    """The activation scale of a token or group whose largest |x| is amax (1 when all are 0)."""
    return T.Select(amax > T.float32(0), amax / T.float32(127), T.float32(1))


def to_int8(x, scale, lanes: int):
    """x (float32 lanes) / scale, rounded and clamped to [-127, 127], as int32 lanes. x times
    1/scale, not x / scale: a divide per vector was most of a prologue."""
    return T.Cast(
        f"int32x{lanes}",
        T.max(
            T.min(
                T.nearbyint(x * T.Broadcast(T.float32(1) / scale, lanes)),
                T.Broadcast(T.float32(127), lanes),
            ),
            T.Broadcast(T.float32(-127), lanes),
        ),
    )


# -- AVX2 without VNNI: 256-bit halves of a block, 8 rows x 4 k bytes ----------------------------


def maddubs(u8, s8):
    """vpmaddubsw: int16x16, the unsigned bytes of `u8` times the signed bytes of `s8` (int8x32
    each), neighbouring products added (saturating)."""
    return T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", u8, s8)


def widen_pairs(pairs):
    """vpmaddwd by ones: int16x16 -> int32x8, neighbouring lanes added."""
    half = ROW_BLOCK // 2
    return T.call_llvm_pure_intrin(
        f"int32x{half}", "llvm.x86.avx2.pmadd.wd", pairs, T.Broadcast(T.int16(1), ROW_BLOCK)
    )


# -- prefill -------------------------------------------------------------------------------------


@T.macro
def panels(tile, args, m, blocks, tm, rb):
    """m >= 2: a task per rb row blocks in parallel, each over the tokens in tiles of tm, so one
    weight load (and unpack) feeds tm tokens and a task's blocks stay in L1/L2 across its token
    tiles. `tile(*args, m, b0, t0, tm, rb, once)` is the kernel's register tile."""
    for task in T.parallel((blocks + rb - 1) // rb):
        for tb in T.serial((m + tm - 1) // tm):
            tile(*args, m, task * rb, tb * tm, tm, rb, False)
