"""The int4 (W4A8) matmul, and its embedding rows: the TIR that reads quant/int4.py's packing.

The kernels are W4A8, as llama.cpp's Q4 x Q8 dot products: activations are quantized at run time
to int8 per group of 32 (scale = max|x| / 127 over the group), and each group's integer dot product
is rescaled by (weight scale x activation scale) into a float32 sum.

Layout, chosen for AVX-512 VNNI (vpdpbusd: 16 int32 lanes, each += 4 u8 x s8 products):
  weight (ceil(out/16), in/8, 16) uint32: word [b, j, r] holds row 16b + r at k = 8j .. 8j+7; byte
         i has k = 8j+i in its low nibble and k = 8j+4+i in its high one, each stored as q + 8 with
         q in [-8, 7]. One 64-byte vector is 16 rows x 8 k; masking it with 0x0F0F0F0F (or shifting
         by 4 first) gives 16 rows x 4 k as the u8 operand of one vpdpbusd, with no byte shuffles.
  scale  (ceil(out/16), in/32, 16) float16: [b, g, r] is row 16b + r's scale for group g.
Rows past `out` are padding (q = 0, scale 0).
"""

from __future__ import annotations

import functools
import operator

from tvm import te, tirx
from tvm.script import tirx as T

from ..lower import tvm_api
from . import rowblock
from .rowblock import FORMS, ROW_BLOCK, RowBlocks, Tile, maddubs, tok, vec, widen_pairs

GROUP = 32
PER_WORD = 8
WORDS_PER_GROUP = GROUP // PER_WORD
ZERO = 8  # the stored offset: nibble = q + 8

__all__ = ["FORMS", "GROUP", "PER_WORD", "ROW_BLOCK", "ZERO", "kernel", "kernel_variant", "take"]


def take(ids: te.Tensor, weight: te.Tensor, scale: te.Tensor) -> te.Tensor:
    """Embedding rows (a tied LM head's view), dequantized."""

    def row(t, k):
        n = ids[t]
        word = weight[n // ROW_BLOCK, k // PER_WORD, n % ROW_BLOCK]
        within = k % PER_WORD
        shift = (8 * (within % 4) + 4 * (within // 4)).astype("uint32")
        nib = (word >> shift) & tirx.const(0xF, "uint32")
        s = scale[n // ROW_BLOCK, k // GROUP, n % ROW_BLOCK].astype("float32")
        return (nib.astype("float32") - float(ZERO)) * s

    return te.compute((ids.shape[0], weight.shape[1] * PER_WORD), row, name="qtake")


# Software prefetch distance along a row block: the hardware prefetcher lags. 1 KB against 2 KB:
# decode GEMVs 0-7% faster on the three models' shapes (512 B: 1-6% slower), EPYC Zen 3.
PREFETCH_BYTES = 1024
# Register tiles: tokens x row blocks of (int32x16 group sum, float32x16 total) pairs.
# m = 1: VNNI's one vpdpbusd chain per block is latency-bound, so two blocks a task; AVX2 has two
# chains (256-bit halves) in one block, and one block a task streams each thread's weights in one
# line: LM heads 3-12% faster than with two (SmolLM2, Gemma-3, Qwen-0.5B), layers 0-1.5%.
DECODE_TILE: dict[str, Tile] = {"vnni": (1, 2), "avx2": (1, 1), "portable": (1, 2)}
PANEL_TILE: dict[str, Tile] = {"vnni": (4, 2), "avx2": (2, 2), "portable": (2, 1)}  # AVX2 has 16 ymm
_LO = 0x0F0F0F0F


# Every layer asks for the same few shapes, and parsing the TVMScript is most of an export
# (Qwen-0.5B: 260 s for 96 linears x 3 forms): build each shape once. PrimFuncs are immutable.
@functools.cache
def kernel(out_features: int, in_features: int) -> tirx.PrimFunc:
    """y = x @ W^T for int4 weights: the portable kernel, carrying its VNNI and AVX2 forms for the
    tiers that have them (tvm_api swaps one in when compiling for such a target). The ideas:

    1. Rows interleaved in blocks of 16 (see the module doc): the lanes are 16 outputs, so no
       horizontal sums; a nibble half of a weight vector is one AND (and a shift), and goes into
       vpdpbusd as its unsigned operand against 4 broadcast int8 activations.
    2. The stored +8 folds into each group's integer sum: it starts at -8 * sum(xq over the group)
       (computed once per token in the prologue) instead of zero.
    3. One float FMA per group per accumulator applies weight scale x activation scale (a vector of
       16 float16 scales, one vcvtph2ps, shared by every token of the tile).
    4. Accumulators are small buffers inside the parallel task, kept in registers; software
       prefetch PREFETCH_BYTES ahead along each row block, into the thread's next task near a
       block's end, non-temporal in decode on AMD (`rowblock.prefetch_ahead`).
    5. m >= 2: PANEL_TILE tokens x row blocks per register tile over tasks of a few blocks, so one
       weight load and unpack feeds every token of the tile.
    6. AVX2 without VNNI (Zen 3, Haswell): vpmaddubsw multiplies the u8 nibbles by the s8
       activations and adds neighbouring pairs into int16; a group's 8 such steps add up in int16
       (at most 16 products of 15 x 127 = 30480 per lane: no overflow) and widen to int32 once per
       group (vpmaddwd by ones). Against the generic form (shift, mask, multiply, add per byte)
       on a 2-core Zen 3 (EPYC, 24 GB/s read): decode 7-8 -> 24-32 GB/s on Qwen-0.5B's shapes
       (L3-warm; 15-20 cold), prefill m = 512 21-28 -> 180-265 GOP/s.
    The previous kernel (f32 activations: mask, convert and FMA per nibble; an f32 panel GEMM for
    prefill) read 6-14 GB/s in decode and reached 53-72 GFLOP/s in prefill on a 2-core Xeon.
    """
    return rowblock.with_forms(_gemm, out_features, in_features)


def kernel_variant(out_features: int, in_features: int, form: str) -> tirx.PrimFunc:
    """One form of `kernel` on its own (tests compile each against numpy)."""
    return _gemm(out_features, in_features, form)


def _gemm(n_rows: int, in_features: int, form: str) -> tirx.PrimFunc:
    words, groups, lanes = in_features // PER_WORD, in_features // GROUP, ROW_BLOCK
    rows = RowBlocks(n_rows, words, PREFETCH_BYTES)
    blocks, blk = rows.blocks, rows.blk
    half = GROUP // 2  # the prologue's vector: two per group

    def dot(acc, wv, xq, t, k0):
        """acc + the 4-k dot products of x[t, k0:k0+4] (s8) with the 16 rows' u8 bytes in wv."""
        if form == "vnni":
            b = T.Broadcast(T.reinterpret("int32", xq[t, vec(k0, 4)]), lanes)
            return tvm_api.vpdpbusd_512(acc, wv, b)
        total = acc
        for i in range(4):
            byte = T.shift_right(wv, T.Broadcast(T.int32(8 * i), lanes)) & T.Broadcast(T.int32(0xFF), lanes)
            total = total + byte * T.Broadcast(T.Cast("int32", xq[t, k0 + i]), lanes)
        return total

    def nibbles(w, b, j, high: bool):
        v = T.reinterpret(f"int32x{lanes}", w[b, j, vec(0)])
        if high:
            v = T.shift_right(v, T.Broadcast(T.int32(4), lanes))
        return v & T.Broadcast(T.int32(_LO), lanes)

    def word_dot(acc, w, xq, b, t, g, u):
        """acc + row block b's word g*4+u (8 k, as its low then high nibbles) times token t's x."""
        j = g * WORDS_PER_GROUP + u
        low = dot(acc, nibbles(w, b, j, False), xq, t, j * PER_WORD)
        return dot(low, nibbles(w, b, j, True), xq, t, j * PER_WORD + 4)

    # AVX2 (idea 6) works on 256-bit halves: 8 rows x 4 k bytes, as int8x32.
    ymm = lanes // 2

    def madd(u8, s8):
        """int16x16: u8 bytes of `u8` times s8 bytes of `s8` (both int32x8), neighbours added."""
        return maddubs(T.reinterpret("int8x32", u8), T.reinterpret("int8x32", s8))

    def pair_sums(w, xq, b, t, j, h):
        """Rows 8h .. 8h+7 of block b, word j (8 k), times token t's x: int16x16 pair sums."""
        v = T.reinterpret(f"int32x{ymm}", w[b, j, vec(h * ymm, ymm)])
        lo = v & T.Broadcast(T.int32(_LO), ymm)
        hi = T.shift_right(v, T.Broadcast(T.int32(4), ymm)) & T.Broadcast(T.int32(_LO), ymm)
        x_lo = T.Broadcast(T.reinterpret("int32", xq[t, vec(j * PER_WORD, 4)]), ymm)
        x_hi = T.Broadcast(T.reinterpret("int32", xq[t, vec(j * PER_WORD + 4, 4)]), ymm)
        return madd(lo, x_lo) + madd(hi, x_hi)

    @T.macro
    def fold(v, op):
        """v[0] = op over v's 16 lanes, as a tree of halves: 4 steps of one vector op and a shuffle
        each, where a lane-by-lane chain was 15 dependent scalar ops. The prologue is serial, the
        other core waiting: a 16-row decode call, mostly prologue, went 0.65 -> 0.55 us at
        K = 576, 1.21 -> 0.97 at 1536, 3.15 -> 2.38 at 4864 (Xeon)."""
        v[vec(0, 8)] = op(v[vec(0, 8)], v[vec(8, 8)])
        v[vec(0, 4)] = op(v[vec(0, 4)], v[vec(4, 4)])
        v[vec(0, 2)] = op(v[vec(0, 2)], v[vec(2, 2)])
        v[0] = op(v[0], v[1])

    @T.macro
    def quantize(x, xq, xs, xc, t):
        """Token t of x into int8 groups xq, their scales xs and offsets xc = -8 * sum(xq)."""
        for g in T.serial(groups):
            peak = T.alloc_buffer((half,), "float32")
            peak[vec(0, half)] = T.max(
                T.abs(x[t, vec(g * GROUP, half)]), T.abs(x[t, vec(g * GROUP + half, half)])
            )
            fold(peak, T.max)
            amax = T.Bind(peak[0])
            xs[t, g] = rowblock.scale_of(amax)
            qs = T.alloc_buffer((half,), "int32")
            qs[vec(0, half)] = T.Broadcast(T.int32(0), half)
            for h in T.unroll(2):
                qv = T.alloc_buffer((half,), "int32")
                qv[vec(0, half)] = rowblock.to_int8(x[t, vec(g * GROUP + h * half, half)], xs[t, g], half)
                xq[t, vec(g * GROUP + h * half, half)] = T.Cast(f"int8x{half}", qv[vec(0, half)])
                qs[vec(0, half)] = qs[vec(0, half)] + qv[vec(0, half)]
            fold(qs, operator.add)
            xc[t, g] = T.int32(-ZERO) * qs[0]

    @T.macro
    def tile(w, s, y, xq, xs, xc, m, b0, t0, tm, rb, once):
        """Tokens t0 .. t0+tm-1 x row blocks b0 .. b0+rb-1 (`once`: each weight read once)."""
        total = T.alloc_buffer((tm, rb, lanes), "float32")
        acc = T.alloc_buffer((tm, rb, lanes), "int32")
        for t in T.unroll(tm):
            for r in T.unroll(rb):
                total[t, r, vec(0)] = T.Broadcast(T.float32(0), lanes)
        pairs = T.alloc_buffer((tm, rb, 2 * lanes), "int16")  # AVX2's int16 group sums
        for g in T.serial(groups):
            if form == "avx2":
                for t in T.unroll(tm):
                    for r in T.unroll(rb):
                        pairs[t, r, vec(0, 2 * lanes)] = T.Broadcast(T.int16(0), 2 * lanes)
            else:
                for t in T.unroll(tm):
                    for r in T.unroll(rb):
                        acc[t, r, vec(0)] = T.Broadcast(xc[tok(t0, t, m), g], lanes)
            for u in T.unroll(WORDS_PER_GROUP):
                for r in T.unroll(rb):
                    T.evaluate(rows.prefetch(w, blk(b0, r), g * WORDS_PER_GROUP + u, rb, once))
                    for t in T.unroll(tm):
                        if form == "avx2":
                            for h in T.unroll(2):
                                pairs[t, r, vec(h * lanes)] = pairs[t, r, vec(h * lanes)] + pair_sums(
                                    w, xq, blk(b0, r), tok(t0, t, m), g * WORDS_PER_GROUP + u, h
                                )
                        else:
                            acc[t, r, vec(0)] = word_dot(
                                acc[t, r, vec(0)], w, xq, blk(b0, r), tok(t0, t, m), g, u
                            )
            if form == "avx2":
                for t in T.unroll(tm):
                    for r in T.unroll(rb):
                        for h in T.unroll(2):
                            acc[t, r, vec(h * ymm, ymm)] = widen_pairs(
                                pairs[t, r, vec(h * lanes)]
                            ) + T.Broadcast(xc[tok(t0, t, m), g], ymm)
            for t in T.unroll(tm):
                for r in T.unroll(rb):
                    total[t, r, vec(0)] = total[t, r, vec(0)] + T.Cast(
                        f"float32x{lanes}", acc[t, r, vec(0)]
                    ) * (
                        T.Cast(f"float32x{lanes}", s[blk(b0, r), g, vec(0)])
                        * T.Broadcast(xs[tok(t0, t, m), g], lanes)
                    )
        for t in T.unroll(tm):
            for r in T.unroll(rb):
                if t0 + t < m and b0 + r < blocks:
                    if (b0 + r + 1) * lanes <= n_rows:
                        y[t0 + t, vec((b0 + r) * lanes)] = total[t, r, vec(0)]
                    else:  # the last block, with rows past `out`: lane by lane
                        for i in T.serial(n_rows - (b0 + r) * lanes):
                            y[t0 + t, (b0 + r) * lanes + i] = total[t, r, i]

    dec_tm, dec_rb = DECODE_TILE[form]
    tm, rb = PANEL_TILE[form]

    @T.prim_func(private=True)  # private: relax names each instance
    def int4_gemm(
        x_h: T.handle,
        w: T.Buffer((blocks, words, lanes), "uint32"),
        s: T.Buffer((blocks, groups, lanes), "float16"),
        y_h: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, in_features), "float32")
        y = T.match_buffer(y_h, (m, n_rows), "float32")
        if m == 1:
            # static scratch: on the stack where small, not a workspace alloc per call
            xq1 = T.alloc_buffer((1, in_features), "int8")
            xs1 = T.alloc_buffer((1, groups), "float32")
            xc1 = T.alloc_buffer((1, groups), "int32")
            quantize(x, xq1, xs1, xc1, 0)  # serial: one token is not worth a parallel launch
            for task in T.parallel((blocks + dec_rb - 1) // dec_rb):
                tile(w, s, y, xq1, xs1, xc1, m, task * dec_rb, T.int64(0), dec_tm, dec_rb, True)
        else:
            xq = T.alloc_buffer((m, in_features), "int8")
            xs = T.alloc_buffer((m, groups), "float32")
            xc = T.alloc_buffer((m, groups), "int32")
            for t in T.parallel(m):
                quantize(x, xq, xs, xc, t)
            rowblock.panels(tile, (w, s, y, xq, xs, xc), m, blocks, tm, rb)

    return int4_gemm
