"""The int8int8 (W8A8) matmul, and its embedding rows: the TIR that reads quant/int8int8.py's
packing. int8 weights per row, int8 activations per token, int32 accumulation.

Activations are quantized at run time: scale_x[t] = max|x[t, :]| / 127. The product of the two
scales turns the int32 dot product back into float32.

Layout, chosen for AVX-512 VNNI (vpdpbusd: 16 int32 lanes, each += 4 u8 x s8 products):
  weight (ceil(out/16), in/4, 16) int32: word [b, j, r] holds the int8 weights of row 16b + r at
         k = 4j .. 4j+3 (byte i at bits 8i), so one 64-byte vector is 16 rows x 4 k, the rows of a
         block are contiguous along k, and the rows past `out` are zero padding.
  wsum   (out,) int32: sum over k of row n's int8 weights (undoes the kernel's +128 offset).
  scale  (out,) float32: row n's weight scale.
"""

from __future__ import annotations

import functools

from tvm import te, tirx
from tvm.script import tirx as T

from ..tvm import passes
from . import rowblock
from .rowblock import FORMS, ROW_BLOCK, RowBlocks, Tile, maddubs, tok, vec, widen_pairs

PER_WORD = 4  # k values per int32 word
OFFSET = 128  # activations go in as x + 128 (vpdpbusd's unsigned operand)

__all__ = ["FORMS", "OFFSET", "PER_WORD", "ROW_BLOCK", "kernel", "kernel_variant", "take"]


def _byte(word, i: int):
    """Sign-extended byte i of int32 word(s)."""
    return T.shift_right(T.shift_left(word, 24 - 8 * i), 24)


def take(ids: te.Tensor, weight: te.Tensor, wsum: te.Tensor, scale: te.Tensor) -> te.Tensor:
    """Embedding rows (a tied LM head's view), dequantized; wsum is the matmul's alone."""

    def row(t, k):
        n = ids[t]
        word = weight[n // ROW_BLOCK, k // PER_WORD, n % ROW_BLOCK]
        shift = (24 - 8 * (k % PER_WORD)).astype("int32")
        q = tirx.shift_right(tirx.shift_left(word, shift), tirx.const(24, "int32"))
        return q.astype("float32") * scale[n]

    return te.compute((ids.shape[0], weight.shape[1] * PER_WORD), row, name="qtake")


PREFETCH_BYTES = 2048  # software prefetch distance along a row block: the hardware prefetcher lags
DECODE_K_UNROLL = 4  # m = 1: independent accumulators along k (a vpdpbusd's latency is ~5 issues)
# Prefill register tile: PANEL_TOKENS tokens x PANEL_BLOCKS row blocks of int32x16 accumulators.
# VNNI: 6 x 2 = 12 accumulators + 2 weight vectors of 32 zmm. Portable: int32x16 is two ymm on
# AVX2 (16 ymm), so a smaller tile that does not spill.
PANEL_TILE: dict[str, Tile] = {"vnni": (6, 2), "avx2": (4, 1), "portable": (4, 1)}
AMAX_CHAINS = 4  # prologue: independent max chains


# Every layer asks for the same few shapes, and parsing the TVMScript is most of an export
# (Qwen-0.5B: 260 s for 96 linears x 3 forms): build each shape once. PrimFuncs are immutable.
@functools.cache
def kernel(out_features: int, in_features: int) -> tirx.PrimFunc:
    """y = x @ W^T for W8A8: the portable kernel, carrying its VNNI and AVX2 forms for the tiers
    that have them (tvm/passes.py swaps one in when compiling for such a target). The ideas, 1-6 measured
    on a 2-core Xeon (8-10 GB/s from `python -m bench.bandwidth` that day):

    1. Rows interleaved in blocks of 16 (see the module doc): one vpdpbusd is 16 rows x 4 k, its
       lanes are the 16 outputs, so no horizontal sums; the activation operand is one broadcast
       32-bit word (4 bytes of x) straight from L1.
    2. vpdpbusd multiplies u8 by s8, so x goes in as q + 128 and 128 * wsum is taken off after.
       Spelled out with the LLVM intrinsic: LLVM never forms vpdpbusd by itself.
    3. Accumulators are small buffers inside the parallel task, so LLVM keeps them in registers
       (under 1024 bytes: a larger one is a workspace allocation, stored to on every step: an 8x2
       tile ran at half the 6x2's speed). Decode (m = 1) splits k over DECODE_K_UNROLL of them to
       hide the vpdpbusd latency, and quantizes its one token serially (no parallel launch: a
       37x256 call went from 10 to 6 us).
    4. Software prefetch PREFETCH_BYTES ahead along each row block (one 64-byte line per step;
       `rowblock.prefetch_ahead`), non-temporal in decode on AMD. 1 KB measured the same as 2 KB here.
    5. m >= 2: a PANEL_TILE register tile, 6 tokens x 2 row blocks, over tasks of 32 rows kept in
       L1/L2 across the token tiles; one weight load feeds 6 vpdpbusd. From m = 4 on it beat 4-token
       tiles over single blocks (896x4864, m = 6: 642 -> 403 us), so there is no middle path.
    6. The prologue quantizes x per token in 16-lane vectors (4 independent amax chains; x times
       1/scale rather than a vdivps per vector): O(m*K), in parallel over tokens.
    Decode, m = 1, cold weights: 7.4 GB/s on Qwen-0.5B's gate_up (9728x896), 10.9 on its down
    (896x4864), 6-9 on the LM heads (49152x576, 151936x896); the 0.5-1 MB shapes 18-28 GB/s
    (partly the L3). The te + rfactor schedule this replaced: ~0.5 GB/s. Prefill, m = 512:
    216-326 GOP/s over the SmolLM2-135M and Qwen-0.5B shapes (int4's panel GEMM, same day:
    53-72 GFLOP/s). One core alone: ~0.9 vpdpbusd per cycle. The portable form on the AVX2 tier
    (LLVM makes its int32 multiplies pmaddwd): 6.6-7.6 GB/s decode, ~20 GOP/s prefill.
    7. AVX2 without VNNI (Zen 3, Haswell): vpmaddubsw wants one unsigned operand, and x + 128
       times an int8 weight overflows its int16 pair sums, so this form takes |x| as the unsigned
       operand and the weight with x's sign (vpsignb): pairs of at most 127 x 128 fit; vpmaddwd by
       ones widens them to int32. The products are then exact: no 128 * wsum to take off.
       On a 2-core Zen 3 (EPYC), Qwen-0.5B's gate_up and down against the generic form: decode
       14-29 -> 37-50 GB/s (L3-warm), prefill m = 512 39-57 -> 123-195 GOP/s.
    """
    return rowblock.with_forms(_gemm, out_features, in_features)


def kernel_variant(out_features: int, in_features: int, form: str) -> tirx.PrimFunc:
    """One form of `kernel` on its own (tests compile each against numpy)."""
    return _gemm(out_features, in_features, form)


def _vector_lanes(n: int) -> int:
    return next(v for v in (16, 8, 4) if n % v == 0)


def _gemm(n_rows: int, in_features: int, form: str) -> tirx.PrimFunc:
    words, lanes = in_features // PER_WORD, ROW_BLOCK
    rows = RowBlocks(n_rows, words, PREFETCH_BYTES)
    blocks, blk = rows.blocks, rows.blk
    vl = _vector_lanes(in_features)  # prologue vector width
    n_vec = in_features // vl
    panel_tokens, panel_blocks = PANEL_TILE[form]

    def dot(acc, xq, t, j, wv):
        """acc (int32x16) + the 4-k dot products of x[t, 4j:4j+4] with the 16 rows in wv."""
        if form == "vnni":
            a = T.Broadcast(T.reinterpret("int32", xq[t, vec(j * PER_WORD, PER_WORD)]), lanes)
            return passes.vpdpbusd_512(acc, a, wv)
        total = acc
        for i in range(PER_WORD):
            # a sign-extended byte times a widened u8: both fit in 16 bits, so LLVM makes the
            # int32 multiply a pmaddwd (an int32 activation, of unknown range, costs a pmulld)
            total = total + _byte(wv, i) * T.Broadcast(T.Cast("int32", xq[t, j * PER_WORD + i]), lanes)
        return total

    ymm = lanes // 2  # AVX2 (idea 7) works on 8 rows x 4 k at a time
    offset = 0 if form == "avx2" else OFFSET  # what the epilogue takes off, times wsum

    def dot_half(acc, xq, t, j, w, b, h):
        """acc (int32x8) + the 4-k dot products of x[t, 4j:4j+4] with rows 8h .. 8h+7 of block b."""
        # xor 0x80808080 turns each stored q + 128 back into q
        x = T.reinterpret("int32", xq[t, vec(j * PER_WORD, PER_WORD)]) ^ T.int32(-0x7F7F7F80)
        xs = T.reinterpret("int8x32", T.Broadcast(x, ymm))
        signed = T.call_llvm_pure_intrin(
            "int8x32", "llvm.x86.avx2.psign.b", T.reinterpret("int8x32", w[b, j, vec(h * ymm, ymm)]), xs
        )
        return acc + widen_pairs(maddubs(T.abs(xs), signed))

    def k_sum(acc, t, r, ku):
        total = acc[t, r, 0, vec(0)]
        for u in range(1, ku):
            total = total + acc[t, r, u, vec(0)]
        return total

    def hmax(v, n):
        top = v[0, 0]
        for c in range(AMAX_CHAINS):
            for i in range(n):
                if c or i:
                    top = T.max(top, v[c, i])
        return top

    @T.macro
    def quantize(x, xq, xs, t):
        """Token t of x into xq (as q + 128) and its scale into xs."""
        # max |x| over AMAX_CHAINS independent vectors (one vmaxps chain is latency-bound)
        peak = T.alloc_buffer((AMAX_CHAINS, vl), "float32")
        for c in T.unroll(AMAX_CHAINS):
            peak[c, vec(0, vl)] = T.Broadcast(T.float32(0), vl)
        for j in T.serial(n_vec // AMAX_CHAINS):
            for c in T.unroll(AMAX_CHAINS):
                peak[c, vec(0, vl)] = T.max(
                    peak[c, vec(0, vl)], T.abs(x[t, vec((j * AMAX_CHAINS + c) * vl, vl)])
                )
        for j in T.serial(n_vec % AMAX_CHAINS):
            peak[0, vec(0, vl)] = T.max(
                peak[0, vec(0, vl)], T.abs(x[t, vec((n_vec // AMAX_CHAINS * AMAX_CHAINS + j) * vl, vl)])
            )
        xs[t] = rowblock.scale_of(hmax(peak, vl))
        for j in T.serial(n_vec):
            xq[t, vec(j * vl, vl)] = T.Cast(
                f"uint8x{vl}",
                rowblock.to_int8(x[t, vec(j * vl, vl)], xs[t], vl) + T.Broadcast(T.int32(OFFSET), vl),
            )

    @T.macro
    def step(w, xq, acc, t, r, u, tg, b, j):
        """Accumulator (t, r, u) += token tg's x at word j times row block b's word j."""
        if form == "avx2":
            for h in T.unroll(2):
                acc[t, r, u, vec(h * ymm, ymm)] = dot_half(
                    acc[t, r, u, vec(h * ymm, ymm)], xq, tg, j, w, b, h
                )
        else:
            acc[t, r, u, vec(0)] = dot(acc[t, r, u, vec(0)], xq, tg, j, w[b, j, vec(0)])

    @T.macro
    def tile(w, wsum, scale, y, xq, xs, m, b0, t0, tm, rb, once, ku=1):
        """Tokens t0 .. t0+tm-1 x row blocks b0 .. b0+rb-1, k split over ku accumulators (`once`:
        each weight read once)."""
        acc = T.alloc_buffer((tm, rb, ku, lanes), "int32")
        for t in T.unroll(tm):
            for r in T.unroll(rb):
                for u in T.unroll(ku):
                    acc[t, r, u, vec(0)] = T.Broadcast(T.int32(0), lanes)
        for jo in T.serial(words // ku):
            for u in T.unroll(ku):
                for r in T.unroll(rb):
                    T.evaluate(rows.prefetch(w, blk(b0, r), jo * ku + u, rb, once))
                    for t in T.unroll(tm):
                        step(w, xq, acc, t, r, u, tok(t0, t, m), blk(b0, r), jo * ku + u)
        for jt in T.serial(words % ku):  # k left over when ku does not divide it
            for r in T.unroll(rb):
                for t in T.unroll(tm):
                    step(w, xq, acc, t, r, 0, tok(t0, t, m), blk(b0, r), words // ku * ku + jt)
        for t in T.unroll(tm):
            for r in T.unroll(rb):
                if t0 + t < m and b0 + r < blocks:
                    if (b0 + r + 1) * lanes <= n_rows:
                        y[t0 + t, vec((b0 + r) * lanes)] = T.Cast(
                            "float32x16", k_sum(acc, t, r, ku) - wsum[vec((b0 + r) * lanes)] * offset
                        ) * (T.Broadcast(xs[t0 + t], lanes) * scale[vec((b0 + r) * lanes)])
                    else:  # the last block, with rows past `out`: lane by lane
                        acc[t, r, 0, vec(0)] = k_sum(acc, t, r, ku)
                        for i in T.serial(n_rows - (b0 + r) * lanes):
                            y[t0 + t, (b0 + r) * lanes + i] = T.Cast(
                                "float32", acc[t, r, 0, i] - wsum[(b0 + r) * lanes + i] * offset
                            ) * (xs[t0 + t] * scale[(b0 + r) * lanes + i])

    @T.prim_func(private=True)  # private: relax names each instance
    def int8int8_gemm(
        x_h: T.handle,
        w: T.Buffer((blocks, words, lanes), "int32"),
        wsum: T.Buffer((n_rows,), "int32"),
        scale: T.Buffer((n_rows,), "float32"),
        y_h: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, in_features), "float32")
        y = T.match_buffer(y_h, (m, n_rows), "float32")
        if m == 1:
            # static scratch: on the stack where small, not a workspace alloc per call
            xq1 = T.alloc_buffer((1, in_features), "uint8")
            xs1 = T.alloc_buffer((1,), "float32")
            quantize(x, xq1, xs1, 0)  # serial: one token is not worth a parallel launch
            for b in T.parallel(blocks):
                tile(w, wsum, scale, y, xq1, xs1, m, b, T.int64(0), 1, 1, True, DECODE_K_UNROLL)
        else:
            xq = T.alloc_buffer((m, in_features), "uint8")  # x + 128
            xs = T.alloc_buffer((m,), "float32")
            for t in T.parallel(m):
                quantize(x, xq, xs, t)
            rowblock.panels(tile, (w, wsum, scale, y, xq, xs), m, blocks, panel_tokens, panel_blocks)

    return int8int8_gemm
