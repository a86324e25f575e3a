"""int4: symmetric 4-bit, one float16 scale per group of 32 along K (the default): 4.5 bits/weight.

Layout: weight (out, in/8) uint32; word j of row n holds k = 8j .. 8j+7, nibble i at bits 4i..4i+3,
each stored as q + 8 with q in [-8, 7]. scale (out, in/32) float16 (the kernel converts a vector
of them with one vcvtph2ps). Both are laid out at build time so the kernel reads them in order
and never transposes or materialises a dequantized weight.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx
from tvm.script import tirx as T

NAME = "int4"
GROUP = 32
PER_WORD = 8


def param_specs(out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], str]]:
    if in_features % GROUP:
        raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {in_features}")
    return {
        "weight": ((out_features, in_features // PER_WORD), "uint32"),
        "scale": ((out_features, in_features // GROUP), "float16"),
    }


# Candidate divisors for a group's scale: the largest-magnitude weight lands on a level near the
# edge of [-8, 7]. Trying a few and keeping the least squared error per group matters when the
# source is itself 4-bit (re-quantizing a Q4_K/Q4_1 grid onto ours): 9.3% -> 8.2% rms error on
# SmolLM2's ffn_down, measured.
_DIVISORS = (-8.0, -7.5, -7.0, -6.5, 6.5, 7.0, 7.5, 8.0)


def pack(weight: np.ndarray) -> dict[str, np.ndarray]:
    w = np.asarray(weight, dtype=np.float32)
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    peak = np.take_along_axis(groups, np.abs(groups).argmax(axis=2)[..., None], axis=2)[..., 0]
    scale = best_err = None
    for div in _DIVISORS:
        # rounded to the stored float16 first, so the nibbles are chosen for the scale kept
        s = np.where(peak != 0, peak / div, 1.0).astype(np.float16).astype(np.float32)
        err = ((np.clip(np.rint(groups / s[..., None]), -8, 7) * s[..., None] - groups) ** 2).sum(axis=2)
        if scale is None:
            scale, best_err = s, err
        else:
            better = err < best_err
            scale, best_err = np.where(better, s, scale), np.where(better, err, best_err)
    q = np.clip(np.rint(groups / scale[..., None]), -8, 7).astype(np.int32) + 8
    nib = q.reshape(n, k // PER_WORD, PER_WORD).astype(np.uint32)
    shifts = (np.arange(PER_WORD, dtype=np.uint32) * 4)[None, None, :]
    words = np.bitwise_or.reduce(nib << shifts, axis=2).astype(np.uint32)
    return {"weight": words, "scale": scale.astype(np.float16)}


def unpack(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """numpy twin of `dequant` (tests)."""
    n, words = weight.shape
    shifts = (np.arange(PER_WORD, dtype=np.uint32) * 4)[None, None, :]
    q = ((weight[:, :, None] >> shifts) & 0xF).astype(np.float32).reshape(n, words * PER_WORD) - 8
    return q * np.repeat(scale.astype(np.float32), GROUP, axis=1)


def dequant(weight: te.Tensor, scale: te.Tensor, n, k):
    word = weight[n, k // PER_WORD]
    nibble = (word >> ((k % PER_WORD) * 4).astype("uint32")) & tirx.const(0xF, "uint32")
    return (nibble.astype("float32") - 8.0) * scale[n, k // GROUP].astype("float32")


ROWS = 8  # output rows per parallel task (a task's rows stay in L1 while a token tile reuses them)
TOKENS = 4  # prompt tokens sharing one dequantized weight vector (prefill); decode is the tail
PREFETCH_BYTES = 2048  # software prefetch distance along a row: the hardware prefetcher lags
PANEL_ROWS = 32  # prefill: output rows per dequantized panel (two 16-lane vectors)
PANEL_TOKENS = 6  # prefill: tokens per register tile (6 x 2 accumulators, 12 of 32 zmm)
PANEL_MIN_TOKENS = 32  # below this a panel's dequantization is not paid back: word-lane path


def _vector_lanes(words: int) -> int:
    """Words per vector: a whole AVX-512 register (16) when the row allows, else 8 or 4."""
    return next(v for v in (16, 8, 4) if words % v == 0)


def kernel(out_features: int, in_features: int) -> tirx.PrimFunc:
    """y = x @ W^T for int4 weights, scheduled by hand (the ideas, each measured on Qwen-0.5B shapes):

    1. Lanes run over consecutive packed *words*, not over k. A prologue (O(m*K)) rearranges x as
       xr[t, i, word] = x[t, 8*word + i] / 16**i, so nibble i of a word is just `word & (0xF << 4i)`
       converted to float and multiplied by xr: a mask, a convert and an FMA, no shifts. The +8
       offset folds into xs[t, word] = -8 * sum_i x[t, 8*word + i].
    2. A vector of 16 words spans 4 groups: their 4 scales are loaded once and spread with a
       shuffle, applied once per vector (indexing the scale per lane would scalarize into a gather).
    3. Accumulators are small buffers inside the parallel task, so LLVM keeps them in registers.
    4. Software prefetch PREFETCH_BYTES ahead along the row.
    5. Short inputs: TOKENS tokens share each dequantized vector (weights read once per tile, not
       per token); decode (m = 1) runs the one-token tail.
    6. Prefill (m >= PANEL_MIN_TOKENS): the weights' dequantization is worth paying once per
       prompt, so each task dequantizes PANEL_ROWS rows into an f32 panel laid out [k][row] and runs
       a register-tiled f32 GEMM over it: per k, two row-vectors of the panel times PANEL_TOKENS
       broadcast x values into 12 accumulators (one FMA per weight-vector load; no dequant in the
       inner loop). Qwen-0.5B's shapes at 512 tokens: 33-48 -> 114-139 GFLOP/s on 2 cores.
    Decode reads 6-14 GB/s of int4 weights by shape on this 2-core VM (the K=576 shapes, on 8-word
    vectors, are the slowest), against 16-18 GB/s from `python -m bench.bandwidth` (the previous
    lane-rfactor schedule: ~2.9 GB/s).
    """
    n_rows, words, groups = out_features, in_features // PER_WORD, in_features // GROUP
    vl = _vector_lanes(words)
    blocks = (n_rows + ROWS - 1) // ROWS
    ahead = PREFETCH_BYTES // 4
    per_group = GROUP // PER_WORD  # words per scale

    def vec(j):
        return T.ramp(j * vl, 1, vl)

    def nibble_mask(i):
        return T.Broadcast(T.shift_left(T.uint32(15), T.Cast("uint32", 4 * i)), vl)

    def spread_scales(s, row, j):
        if vl == per_group:
            return T.Broadcast(T.Cast("float32", s[row, j]), vl)
        lanes = vl // per_group
        spread = T.Shuffle(
            [s[row, T.ramp(j * lanes, 1, lanes)]] * per_group, [lane // per_group for lane in range(vl)]
        )
        return T.Cast(f"float32x{vl}", spread)

    def hsum(acc, t):
        total = acc[t, 0]
        for lane in range(1, vl):
            total = total + acc[t, lane]
        return total

    @T.macro
    def token_tile(x, w, s, y, xr, xs, acc, tmp, rb, t0, tile):
        for r in T.serial(ROWS):
            row = T.min(rb * ROWS + r, n_rows - 1)  # clamped: the last task reads, never writes, past the end
            for t in T.unroll(tile):
                acc[t, T.ramp(0, 1, vl)] = T.Broadcast(T.float32(0), vl)
            for j in T.serial(words // vl):
                T.evaluate(
                    T.call_llvm_intrin(
                        "void", "llvm.prefetch.p0", T.address_of(w[row, j * vl + ahead]), 0, 3, 1
                    )
                )
                for t in T.unroll(tile):
                    tmp[t, T.ramp(0, 1, vl)] = xs[t0 + t, vec(j)]
                for i in T.unroll(PER_WORD):
                    for t in T.unroll(tile):
                        tmp[t, T.ramp(0, 1, vl)] = (
                            tmp[t, T.ramp(0, 1, vl)]
                            + T.Cast(f"float32x{vl}", w[row, vec(j)] & nibble_mask(i)) * xr[t0 + t, i, vec(j)]
                        )
                for t in T.unroll(tile):
                    acc[t, T.ramp(0, 1, vl)] = acc[t, T.ramp(0, 1, vl)] + tmp[
                        t, T.ramp(0, 1, vl)
                    ] * spread_scales(s, row, j)
            for t in T.unroll(tile):
                if rb * ROWS + r < n_rows:
                    y[t0 + t, rb * ROWS + r] = hsum(acc, t)

    panel_gemm = _panel_gemm(n_rows, in_features)

    @T.prim_func(private=True)  # private: relax names each instance
    def int4_gemm(
        x_h: T.handle,
        w: T.Buffer((n_rows, words), "uint32"),
        s: T.Buffer((n_rows, groups), "float16"),
        y_h: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, in_features), "float32")
        y = T.match_buffer(y_h, (m, n_rows), "float32")
        if m >= PANEL_MIN_TOKENS:
            panel_gemm(x, w, s, y, m)
        else:
            xr = T.alloc_buffer((m, PER_WORD, words), "float32")
            xs = T.alloc_buffer((m, words), "float32")
            for t in T.parallel(m):
                for j in T.serial(words):
                    xs[t, j] = T.float32(0)
                    for i in T.unroll(PER_WORD):
                        # 2**(-4i) built from its exponent bits: exact, and folds to a constant
                        xr[t, i, j] = x[t, j * PER_WORD + i] * T.reinterpret(
                            "float32", T.shift_left(T.Cast("uint32", 127 - 4 * i), T.uint32(23))
                        )
                        xs[t, j] = xs[t, j] - T.float32(8) * x[t, j * PER_WORD + i]
            for rb in T.parallel(blocks):
                acc = T.alloc_buffer((TOKENS, vl), "float32")
                tmp = T.alloc_buffer((TOKENS, vl), "float32")
                for tb in T.serial(m // TOKENS):
                    token_tile(x, w, s, y, xr, xs, acc, tmp, rb, tb * TOKENS, TOKENS)
                for tt in T.serial(m % TOKENS):
                    token_tile(x, w, s, y, xr, xs, acc, tmp, rb, m // TOKENS * TOKENS + tt, 1)

    return int4_gemm


def _panel_gemm(n_rows: int, in_features: int):
    """Prefill GEMM: dequantize PANEL_ROWS rows once into panel[k, row], then tiles of
    PANEL_TOKENS tokens x PANEL_ROWS rows accumulate in registers over k."""
    words, nr, mr, lanes = in_features // PER_WORD, PANEL_ROWS, PANEL_TOKENS, 16
    halves = nr // lanes
    panels = (n_rows + nr - 1) // nr

    @T.macro
    def panel_gemm(x, w, s, y, m):
        for pb in T.parallel(panels):
            panel = T.alloc_buffer((in_features, nr), "float32")
            acc = T.alloc_buffer((mr, nr), "float32")
            for r in T.serial(nr):
                row = T.min(pb * nr + r, n_rows - 1)  # clamped: a short last panel repeats its row
                for j in T.serial(words):
                    scale = T.Cast("float32", s[row, j // (GROUP // PER_WORD)])
                    for i in T.unroll(PER_WORD):
                        q = T.shift_right(w[row, j], T.uint32(4 * i)) & T.uint32(0xF)
                        panel[j * PER_WORD + i, r] = (T.Cast("float32", q) - T.float32(8)) * scale
            for tb in T.serial((m + mr - 1) // mr):
                for t in T.unroll(mr):
                    for c in T.unroll(halves):
                        acc[t, T.ramp(c * lanes, 1, lanes)] = T.Broadcast(T.float32(0), lanes)
                for k in T.serial(in_features):
                    for t in T.unroll(mr):
                        xt = x[T.min(tb * mr + t, m - 1), k]  # clamped: the tail tile recomputes
                        for c in T.unroll(halves):
                            acc[t, T.ramp(c * lanes, 1, lanes)] = (
                                acc[t, T.ramp(c * lanes, 1, lanes)]
                                + T.Broadcast(xt, lanes) * panel[k, T.ramp(c * lanes, 1, lanes)]
                            )
                for t in T.unroll(mr):
                    if tb * mr + t < m:
                        for r in T.serial(nr):
                            if pb * nr + r < n_rows:
                                y[tb * mr + t, pb * nr + r] = acc[t, r]

    return panel_gemm


def take(ids: te.Tensor, weight: te.Tensor, scale: te.Tensor) -> te.Tensor:
    return te.compute(
        (ids.shape[0], weight.shape[1] * PER_WORD),
        lambda t, d: dequant(weight, scale, ids[t], d),
        name="qtake",
    )
