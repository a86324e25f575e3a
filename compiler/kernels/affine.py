"""Grouped affine integer weights (W4A8 and W8A8 per group): the TIR that reads quant/affine.py.

One kernel family covers every layout a weight is stored in here: our own int4, and each GGUF
block type kept value-exact (quant/gguf.py). Along a row, every `group` weights share a scale and
maybe a min, and each weight is an unsigned integer u of `bits` bits:

    w[n, k] = scale[n, g] * (u[n, k] - zero) - min[n, g]          g = k // group

The scale and min are float16 or float32 per group, or (GGUF's K-quants) int8 codes times a
float16 per super-block of 256 weights. Activations are quantized at run time to int8 per group
of the same size (scale = max|x| / 127 over the group), as llama.cpp quantizes them to Q8; each
group's integer dot product, exact in int32, is rescaled in float32:

    y += (sum_k u*xq - zero*sum_k xq) * scale * xs - min * xs * sum_k xq

Both sums over the activations come from the prologue, once per token and group.

Layout, chosen for AVX-512 VNNI (vpdpbusd: 16 int32 lanes, each += 4 u8 x s8 products):
  weight (ceil(out/16), in/8 or in/4, 16) uint32: word [b, j, r] holds row 16b + r.
         4 bits (and 5 and 6 bits' low nibbles): k = 8j .. 8j+7; byte i has k = 8j+i in its low
         nibble and 8j+4+i in its high one, so masking a 64-byte vector with 0x0F0F0F0F (or shifting by 4
         first) gives 16 rows x 4 k as the u8 operand of one vpdpbusd, with no byte shuffles.
         8 bits: k = 4j .. 4j+3, byte i at k = 4j+i: a vector is one vpdpbusd operand as it is.
  high   (ceil(out/16), in/32 * planes, 16) uint32, 5 and 6 bits: [b, g*planes + p, r] is row
         16b + r's bits 4 + p over the 32 k of group g, byte i's bit 2u holding the one at
         k = 32g + 8u + i and bit 2u + 1 the one at 32g + 8u + 4 + i: for nibble word u of the
         group, one shift puts each byte's bit over its nibble, and one mask keeps it. (Bit c
         at k = 32g + c, as GGUF stores them, took a multiply to spread: Qwen-0.5B's gate_up
         GEMVs read 24.6 GB/s so, against 27.4 now and 28.8 for int4.)
  scale, min (ceil(out/16), in/group, 16) of the code type: [b, g, r] is row 16b + r's group g.
  super_scale, super_min (ceil(out/16), in/256, 16) float16: int8 codes only.
Rows past `out` are padding (u = zero, codes 0).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

from tvm import te, tirx
from tvm.script import tirx as T

from ..tvm import passes
from . import rowblock
from .rowblock import FORMS, ROW_BLOCK, RowBlocks, Tile, maddubs, tok, vec, widen_pairs

SUPER = 256  # weights per K-quant super-block along k
WORDS_PER_GROUP_5 = 4  # 5 and 6 bits: nibble words per 32-bit word of a bit plane

__all__ = ["FORMS", "ROW_BLOCK", "SUPER", "Layout", "kernel", "kernel_variant", "take"]


@dataclass(frozen=True)
class Layout:
    """How one weight is stored: see the module doc."""

    bits: int  # 4, 5 or 6 (a nibble and 1 or 2 bit planes), or 8
    group: int  # weights per scale along k: 32, or 16 (GGUF's Q6_K)
    code: str  # the scale and min type: "float16", "float32", or "int8" (x a float16 per SUPER)
    has_min: bool
    zero: int  # u = q + zero: 8 for int4's signed nibbles, 0 for GGUF's 4-bit ones, 128 for 8 bits
    # Some q is -128 (8 bits): AVX2's sign trick (vpsignb) cannot negate it, so that tier takes the
    # portable arithmetic for this weight.
    full_range: bool = False

    def __post_init__(self) -> None:
        zeros = {4: (0, 8), 5: (0, 16), 6: (32,), 8: (128,)}
        ok = self.zero in zeros.get(self.bits, ())
        if not ok or self.group not in (16, 32) or self.code not in ("float16", "float32", "int8"):
            raise ValueError(f"unsupported layout {self}")

    @property
    def planes(self) -> int:
        """Bit planes above the nibble: 1 for 5 bits, 2 for 6."""
        return self.bits - 4 if self.bits in (5, 6) else 0

    @property
    def per_word(self) -> int:
        """k per 32-bit word of `weight` (5 bits: the low nibbles, as 4 bits)."""
        return 4 if self.bits == 8 else 8

    @property
    def tag(self) -> str:
        """A short name, e.g. u8-g16-int8-min: the compile cache and the manifest key on it."""
        parts = [f"u{self.bits}", f"g{self.group}", self.code, f"z{self.zero}"]
        return "-".join(parts + (["min"] if self.has_min else []) + (["full"] if self.full_range else []))

    def check(self, in_features: int) -> None:
        step = SUPER if self.code == "int8" else max(self.group, self.per_word)
        if in_features % step:
            raise ValueError(f"{self.tag} needs in_features divisible by {step}, got {in_features}")


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
_SIGN_BITS = -0x7F7F7F80  # 0x80808080 as int32: xor turns each stored q + 128 back into q


def plane_bit(c):
    """The bit of a group's plane word holding the plane's bit at k = 32g + c (the module doc:
    c = 8u + 4*half + i sits at 8i + 2u + half). Ints, numpy arrays or TIR expressions."""
    return 8 * (c % 4) + 2 * (c // 8) + c % 8 // 4


def _nth_bytes(word, i: int, lanes: int):
    """Unsigned byte i of each int32 lane."""
    return T.shift_right(word, T.Broadcast(T.int32(8 * i), lanes)) & T.Broadcast(T.int32(0xFF), lanes)


def take(layout: Layout):
    """te compute of embedding rows (a tied LM head's view), dequantized exactly as the module doc
    writes w: (ids, weight[, high], scale[, min][, super_scale][, super_min]) -> (tokens, in)
    float32."""

    def compute(ids: te.Tensor, weight: te.Tensor, *rest: te.Tensor) -> te.Tensor:
        high, scales = (rest[0], rest[1:]) if layout.planes else (None, rest)
        s, mn, ss, sm = _split_scales(layout, scales)
        per_word = layout.per_word

        def value(codes, sup, n, g):
            v = codes[n // ROW_BLOCK, g, n % ROW_BLOCK].astype("float32")
            if sup is None:
                return v
            return v * sup[n // ROW_BLOCK, g * layout.group // SUPER, n % ROW_BLOCK].astype("float32")

        def row(t, k):
            n = ids[t]
            word = weight[n // ROW_BLOCK, k // per_word, n % ROW_BLOCK]
            within = k % per_word
            if layout.bits != 8:
                shift = 8 * (within % 4) + 4 * (within // 4)
                u = (word >> shift.astype("uint32")) & tirx.const(0xF, "uint32")
                at = plane_bit(k % 32).astype("uint32")
                for p in range(layout.planes):
                    plane = high[n // ROW_BLOCK, k // 32 * layout.planes + p, n % ROW_BLOCK]
                    u = u | (((plane >> at) & tirx.const(1, "uint32")) << tirx.const(4 + p, "uint32"))
            else:
                u = (word >> (8 * within).astype("uint32")) & tirx.const(0xFF, "uint32")
            g = k // layout.group
            q = (u.astype("int32") - layout.zero).astype("float32")
            w = value(s, ss, n, g) * q
            return w - value(mn, sm, n, g) if mn is not None else w

        return te.compute((ids.shape[0], weight.shape[1] * per_word), row, name="qtake")

    return compute


def _split_scales(layout: Layout, scales):
    """(scale, min, super_scale, super_min) from the parameters after the weight; None if absent."""
    it = iter(scales)
    s = next(it)
    mn = next(it) if layout.has_min else None
    ss = next(it) if layout.code == "int8" else None
    sm = next(it) if layout.code == "int8" and layout.has_min else None
    return s, mn, ss, sm


# Every layer asks for the same few shapes, and parsing the TVMScript is most of an export
# (Qwen-0.5B: 260 s for 96 linears x 3 forms): build each shape once. PrimFuncs are immutable.
@functools.cache
def kernel(out_features: int, in_features: int, layout: Layout) -> tirx.PrimFunc:
    """y = x @ W^T for `layout`'s weights: the portable kernel, carrying its VNNI and AVX2 forms
    for the tiers that have them (tvm/passes.py swaps one in when compiling for such a target). Called
    as (x, weight, scale[, min][, super_scale][, super_min], y). The ideas:

    1. Rows interleaved in blocks of 16 (see the module doc): the lanes are 16 outputs, so no
       horizontal sums; a 4-bit half of a weight vector is one AND (and a shift), an 8-bit vector
       is used as it is, and goes into vpdpbusd as its unsigned operand against 4 broadcast int8
       activations.
    2. The stored zero folds into each group's integer sum: it starts at -zero * sum(xq over the
       group) (computed once per token in the prologue) instead of zero; the min term is one more
       FMA per group with xs * sum(xq), also from the prologue.
    3. One float FMA per group per accumulator applies weight scale x activation scale (a vector of
       16 scales, one conversion, shared by every token of the tile).
    4. Accumulators are small buffers inside the parallel task, kept in registers; software
       prefetch PREFETCH_BYTES ahead along each row block, into the thread's next task near a
       block's end, non-temporal in decode on AMD (`rowblock.prefetch_ahead`).
    5. m >= 2: PANEL_TILE tokens x row blocks per register tile over tasks of a few blocks, so one
       weight load and unpack feeds every token of the tile.
    6. AVX2 without VNNI (Zen 3, Haswell), 4 bits: vpmaddubsw multiplies the u8 nibbles by the s8
       activations and adds neighbouring pairs into int16; a group's 8 such steps add up in int16
       (at most 16 products of 15 x 127 = 30480 per lane: no overflow) and widen to int32 once per
       group (vpmaddwd by ones). Against the generic form (shift, mask, multiply, add per byte)
       on a 2-core Zen 3 (EPYC, 24 GB/s read): decode 7-8 -> 24-32 GB/s on Qwen-0.5B's shapes
       (L3-warm; 15-20 cold), prefill m = 512 21-28 -> 180-265 GOP/s.
    7. AVX2, 8 bits: u + 128 times x overflows vpmaddubsw's int16 pairs, so this form turns u back
       into q (xor 0x80), gives it x's sign (vpsignb) and multiplies by |x|: pairs of at most
       127 x 127 x 2 fit, and widen to int32 at once. The products are then q x x: no zero to
       take off.
    """
    layout.check(in_features)
    return rowblock.with_forms(functools.partial(_gemm, layout=layout), out_features, in_features)


def kernel_variant(out_features: int, in_features: int, layout: Layout, form: str) -> tirx.PrimFunc:
    """One form of `kernel` on its own (tests compile each against numpy)."""
    layout.check(in_features)
    return _gemm(out_features, in_features, form, layout=layout)


def _gemm(n_rows: int, in_features: int, form: str, *, layout: Layout) -> tirx.PrimFunc:
    L = layout
    per_word, lanes = L.per_word, ROW_BLOCK
    words, groups = in_features // per_word, in_features // L.group
    words_per_group = L.group // per_word
    per_32 = 32 // L.group if L.planes else 1  # groups per step of the group loop
    groups_per_super = SUPER // L.group
    supers = in_features // SUPER if L.code == "int8" else 1
    rows = RowBlocks(n_rows, words, PREFETCH_BYTES)
    blocks, blk = rows.blocks, rows.blk
    half = L.group // 2  # the prologue's vector: two per group
    # 8 bits on AVX2 (idea 7), unless some q is -128; a full-range weight takes portable steps
    signed = form == "avx2" and L.bits == 8 and not L.full_range
    pairs16 = form == "avx2" and L.bits == 4  # idea 6
    # 5 and 6 bits on AVX2: pairs of up to 63 x 127 x 2 would overflow int16 over a group (a word's
    # two, 32004, just fit): widen per word
    widen_each = form == "avx2" and L.bits in (5, 6)
    step_form = "portable" if form == "avx2" and not (signed or pairs16 or widen_each) else form

    def dot(acc, wv, xq, t, k0):
        """acc + the 4-k dot products of x[t, k0:k0+4] (s8) with the 16 rows' u8 bytes in wv."""
        if step_form == "vnni":
            b = T.Broadcast(T.reinterpret("int32", xq[t, vec(k0, 4)]), lanes)
            return passes.vpdpbusd_512(acc, wv, b)
        total = acc
        for i in range(4):
            total = total + _nth_bytes(wv, i, lanes) * T.Broadcast(T.Cast("int32", xq[t, k0 + i]), lanes)
        return total

    def nibbles(w, b, j, high: bool):
        v = T.reinterpret(f"int32x{lanes}", w[b, j, vec(0)])
        if high:
            v = T.shift_right(v, T.Broadcast(T.int32(4), lanes))
        return v & T.Broadcast(T.int32(_LO), lanes)

    def spread(v, hb, b, j, half: int, n: int = lanes, h: int = 0):
        """v (nibbles) with row block b's bits above them for word j's low (half 0) or high (half 1)
        nibbles, at bits 4 and 5 of each byte (lanes 8h .. 8h+n-1): one shift and one mask a
        plane (see the module doc)."""
        p = 2 * (j % WORDS_PER_GROUP_5) + half  # the bit of each byte that holds them
        for plane in range(L.planes):
            hv = T.reinterpret(f"int32x{n}", hb[b, j // WORDS_PER_GROUP_5 * L.planes + plane, vec(h * n, n)])
            to = 4 + plane
            moved = T.Select(
                p <= to,
                T.shift_left(hv, T.Broadcast(T.Cast("int32", to - p), n)),
                T.shift_right(hv, T.Broadcast(T.Cast("int32", p - to), n)),
            )
            v = v | (moved & T.Broadcast(T.int32(0x01010101 << to), n))
        return v

    def word_dot(acc, w, hb, xq, b, t, j):
        """acc + row block b's word j times token t's x."""
        if L.bits != 8:  # 8 k: the low nibbles, then the high ones
            lo, hi = spread(nibbles(w, b, j, False), hb, b, j, 0), spread(nibbles(w, b, j, True), hb, b, j, 1)
            return dot(dot(acc, lo, xq, t, j * per_word), hi, xq, t, j * per_word + 4)
        return dot(acc, T.reinterpret(f"int32x{lanes}", w[b, j, vec(0)]), xq, t, j * per_word)

    # AVX2 (ideas 6 and 7) works on 256-bit halves: 8 rows x 4 k bytes, as int8x32.
    ymm = lanes // 2

    def x_word(xq, t, k0):
        return T.reinterpret("int32", xq[t, vec(k0, 4)])

    def madd(u8, s8):
        """int16x16: u8 bytes of `u8` times s8 bytes of `s8` (both int32x8), neighbours added."""
        return maddubs(T.reinterpret("int8x32", u8), T.reinterpret("int8x32", s8))

    def pair_sums(w, hb, xq, b, t, j, h):
        """4 to 6 bits: rows 8h .. 8h+7 of block b, word j (8 k), times token t's x: int16x16 pair
        sums."""
        v = T.reinterpret(f"int32x{ymm}", w[b, j, vec(h * ymm, ymm)])
        lo = v & T.Broadcast(T.int32(_LO), ymm)
        hi = T.shift_right(v, T.Broadcast(T.int32(4), ymm)) & T.Broadcast(T.int32(_LO), ymm)
        lo, hi = spread(lo, hb, b, j, 0, ymm, h), spread(hi, hb, b, j, 1, ymm, h)
        x_lo = T.Broadcast(x_word(xq, t, j * per_word), ymm)
        x_hi = T.Broadcast(x_word(xq, t, j * per_word + 4), ymm)
        return madd(lo, x_lo) + madd(hi, x_hi)

    def signed_dot(w, xq, b, t, j, h):
        """8 bits: rows 8h .. 8h+7 of block b, word j (4 k), times token t's x: int32x8 sums."""
        q = T.reinterpret(f"int32x{ymm}", w[b, j, vec(h * ymm, ymm)]) ^ T.Broadcast(T.int32(_SIGN_BITS), ymm)
        x = T.reinterpret("int8x32", T.Broadcast(x_word(xq, t, j * per_word), ymm))
        q_signed = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", T.reinterpret("int8x32", q), x)
        return widen_pairs(maddubs(T.abs(x), q_signed))

    @T.macro
    def fold(v, op, n):
        """v[0] = op over v's n (16 or 8) lanes, as a tree of halves: log2(n) steps of one vector
        op and a shuffle each, where a lane-by-lane chain was n - 1 dependent scalar ops. The
        prologue is serial, the other core waiting: a 16-row decode call, mostly prologue, went
        0.65 -> 0.55 us at K = 576, 1.21 -> 0.97 at 1536, 3.15 -> 2.38 at 4864 (Xeon)."""
        if n == 16:
            v[vec(0, 8)] = op(v[vec(0, 8)], v[vec(8, 8)])
        v[vec(0, 4)] = op(v[vec(0, 4)], v[vec(4, 4)])
        v[vec(0, 2)] = op(v[vec(0, 2)], v[vec(2, 2)])
        v[0] = op(v[0], v[1])

    @T.macro
    def quantize(x, xq, xs, xc, xm, t):
        """Token t of x into int8 groups xq, their scales xs, offsets xc = -zero * sum(xq) and
        (with a min) xm = xs * sum(xq)."""
        for g in T.serial(groups):
            peak = T.alloc_buffer((half,), "float32")
            peak[vec(0, half)] = T.max(
                T.abs(x[t, vec(g * L.group, half)]), T.abs(x[t, vec(g * L.group + half, half)])
            )
            fold(peak, T.max, half)
            amax = T.Bind(peak[0])
            xs[t, g] = rowblock.scale_of(amax)
            qs = T.alloc_buffer((half,), "int32")
            qs[vec(0, half)] = T.Broadcast(T.int32(0), half)
            for h in T.unroll(2):
                qv = T.alloc_buffer((half,), "int32")
                qv[vec(0, half)] = rowblock.to_int8(x[t, vec(g * L.group + h * half, half)], xs[t, g], half)
                xq[t, vec(g * L.group + h * half, half)] = T.Cast(f"int8x{half}", qv[vec(0, half)])
                qs[vec(0, half)] = qs[vec(0, half)] + qv[vec(0, half)]
            fold(qs, operator.add, half)
            xc[t, g] = T.int32(-L.zero) * qs[0]
            if L.has_min:
                xm[t, g] = xs[t, g] * T.Cast("float32", qs[0])

    def group_value(codes, sup, b, g):
        """float32x16: the 16 rows' scale (or min) for group g."""
        v = codes[b, g, vec(0)]
        if L.code != "float32":
            v = T.Cast(f"float32x{lanes}", v)
        if L.code == "int8":
            v = v * T.Cast(f"float32x{lanes}", sup[b, g // groups_per_super, vec(0)])
        return v

    @T.macro
    def tile(w, hb, s, mn, ss, sm, y, xq, xs, xc, xm, m, b0, t0, tm, rb, once):
        """Tokens t0 .. t0+tm-1 x row blocks b0 .. b0+rb-1 (`once`: each weight read once)."""
        total = T.alloc_buffer((tm, rb, lanes), "float32")
        acc = T.alloc_buffer((tm, rb, lanes), "int32")
        for t in T.unroll(tm):
            for r in T.unroll(rb):
                total[t, r, vec(0)] = T.Broadcast(T.float32(0), lanes)
        pairs = T.alloc_buffer((tm, rb, 2 * lanes), "int16")  # AVX2's 4-bit int16 group sums
        # Groups run in steps of 32 k, so the bit-plane word and where a word's bits sit in it
        # are known when unrolled (with groups of 16 they were run-time shifts: Q6_K's GEMM at
        # half the speed of 8 bits).
        for g32 in T.serial(groups // per_32):
            for gi in T.unroll(per_32):
                g = T.meta_var(g32 * per_32 + gi)
                if pairs16:
                    for t in T.unroll(tm):
                        for r in T.unroll(rb):
                            pairs[t, r, vec(0, 2 * lanes)] = T.Broadcast(T.int16(0), 2 * lanes)
                elif signed:
                    for t in T.unroll(tm):
                        for r in T.unroll(rb):
                            acc[t, r, vec(0)] = T.Broadcast(T.int32(0), lanes)
                else:
                    for t in T.unroll(tm):
                        for r in T.unroll(rb):
                            acc[t, r, vec(0)] = T.Broadcast(xc[tok(t0, t, m), g], lanes)
                for u in T.unroll(words_per_group):
                    for r in T.unroll(rb):
                        T.evaluate(rows.prefetch(w, blk(b0, r), g * words_per_group + u, rb, once))
                        for t in T.unroll(tm):
                            if pairs16:
                                for h in T.unroll(2):
                                    pairs[t, r, vec(h * lanes)] = pairs[t, r, vec(h * lanes)] + pair_sums(
                                        w, hb, xq, blk(b0, r), tok(t0, t, m), g * words_per_group + u, h
                                    )
                            elif widen_each:
                                for h in T.unroll(2):
                                    acc[t, r, vec(h * ymm, ymm)] = acc[t, r, vec(h * ymm, ymm)] + widen_pairs(
                                        pair_sums(
                                            w, hb, xq, blk(b0, r), tok(t0, t, m), g * words_per_group + u, h
                                        )
                                    )
                            elif signed:
                                for h in T.unroll(2):
                                    acc[t, r, vec(h * ymm, ymm)] = acc[t, r, vec(h * ymm, ymm)] + signed_dot(
                                        w, xq, blk(b0, r), tok(t0, t, m), g * words_per_group + u, h
                                    )
                            else:
                                acc[t, r, vec(0)] = word_dot(
                                    acc[t, r, vec(0)],
                                    w,
                                    hb,
                                    xq,
                                    blk(b0, r),
                                    tok(t0, t, m),
                                    g * words_per_group + u,
                                )
                if pairs16:
                    for t in T.unroll(tm):
                        for r in T.unroll(rb):
                            for h in T.unroll(2):
                                acc[t, r, vec(h * ymm, ymm)] = widen_pairs(
                                    pairs[t, r, vec(h * lanes)]
                                ) + T.Broadcast(xc[tok(t0, t, m), g], ymm)
                for r in T.unroll(rb):
                    # the block's scales (and mins) once, for every token of the tile
                    sv = T.alloc_buffer((2, lanes), "float32")
                    sv[0, vec(0)] = group_value(s, ss, blk(b0, r), g)
                    if L.has_min:
                        sv[1, vec(0)] = group_value(mn, sm, blk(b0, r), g)
                    for t in T.unroll(tm):
                        total[t, r, vec(0)] = total[t, r, vec(0)] + T.Cast(
                            f"float32x{lanes}", acc[t, r, vec(0)]
                        ) * (sv[0, vec(0)] * T.Broadcast(xs[tok(t0, t, m), g], lanes))
                        if L.has_min:
                            total[t, r, vec(0)] = total[t, r, vec(0)] - sv[1, vec(0)] * (
                                T.Broadcast(xm[tok(t0, t, m), g], lanes)
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
    min_shape = (blocks, groups, lanes) if L.has_min else (1,)
    high_shape = (blocks, in_features // 32 * L.planes, lanes) if L.planes else (1,)
    super_shape = (blocks, supers, lanes)
    super_min_shape = super_shape if L.has_min else (1,)

    @T.prim_func(private=True)  # private: relax names each instance
    def affine_gemm(
        x_h: T.handle,
        w: T.Buffer((blocks, words, lanes), "uint32"),
        hb: T.Buffer(high_shape, "uint32"),
        s: T.Buffer((blocks, groups, lanes), L.code),
        mn: T.Buffer(min_shape, L.code),
        ss: T.Buffer(super_shape, "float16"),
        sm: T.Buffer(super_min_shape, "float16"),
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
            xm1 = T.alloc_buffer((1, groups), "float32")
            quantize(x, xq1, xs1, xc1, xm1, 0)  # serial: one token is not worth a parallel launch
            for task in T.parallel((blocks + dec_rb - 1) // dec_rb):
                tile(
                    w,
                    hb,
                    s,
                    mn,
                    ss,
                    sm,
                    y,
                    xq1,
                    xs1,
                    xc1,
                    xm1,
                    m,
                    task * dec_rb,
                    T.int64(0),
                    dec_tm,
                    dec_rb,
                    True,
                )
        else:
            xq = T.alloc_buffer((m, in_features), "int8")
            xs = T.alloc_buffer((m, groups), "float32")
            xc = T.alloc_buffer((m, groups), "int32")
            xm = T.alloc_buffer((m, groups), "float32")
            for t in T.parallel(m):
                quantize(x, xq, xs, xc, xm, t)
            rowblock.panels(tile, (w, hb, s, mn, ss, sm, y, xq, xs, xc, xm), m, blocks, tm, rb)

    # Parameters the layout has no use for leave the signature: (x, weight[, high], scale, ..., y).
    uses = ((2, L.planes > 0), (4, L.has_min), (5, L.code == "int8"), (6, L.code == "int8" and L.has_min))
    unused = [i for i, used in uses if not used]
    return passes.without_params(affine_gemm, unused)
