"""f32 weights read back in te: the matmul and the embedding rows of quant/f32.py's (out, in)."""

from __future__ import annotations

import functools

from tvm import te, tirx
from tvm.script import tirx as T

from .lanes import LANES, lane_matmul


def dequant(weight: te.Tensor, n, k):
    return weight[n, k]


def linear(x: te.Tensor, weight: te.Tensor) -> te.Tensor:
    def product(i, n, ko, ki):
        k = ko * LANES + ki
        return x[i, k] * dequant(weight, n, k)

    return lane_matmul(x, weight.shape[0], product)


def take(ids: te.Tensor, weight: te.Tensor) -> te.Tensor:
    return te.compute((ids.shape[0], weight.shape[1]), lambda t, d: dequant(weight, ids[t], d), name="qtake")


# gemm's register tile: TOKENS x ROWS dot products, each a 16-lane accumulator along k (16 of 32
# zmm), fed by TOKENS + ROWS vector loads a step; a task is BLOCK tokens, its x rows held in L2
# while every weight row passes once.
TOKENS, ROWS, BLOCK = 4, 4, 48
KLANES = 16


@functools.cache
def gemm(out_features: int, in_features: int) -> tirx.PrimFunc:
    """y = x @ W^T for float32 W (out, in) as stored, in % 16 == 0: the encoders' matmul, where
    every call has many tokens (the te GEMV above reads W once per token).

    Each output is a dot product along k in 16 lanes, the lanes summed at the end by a transpose
    of the tile's 16 accumulators (attention.py's `_transpose16`): no repacking of W, and every
    output is computed the same way whichever tile it falls in, so a row of x gives the same bits
    alone or among others. Tokens are clamped into the last tile (read again, stored once)."""
    from .attention import _transpose16

    assert in_features % KLANES == 0 and TOKENS * ROWS == 16
    steps = in_features // KLANES
    row_tiles = -(-out_features // ROWS)

    def lanes(start):
        return T.ramp(start, 1, KLANES)

    @T.macro
    def tile(x, w, y, m, t0, r0):
        # two halves of 8 accumulators: a buffer of 1024 bytes or more is a workspace allocation,
        # stored to every step, where smaller ones stay in registers (int8int8.py's idea 3)
        lo = T.alloc_buffer((8, KLANES), "float32")
        hi = T.alloc_buffer((8, KLANES), "float32")
        for i in T.unroll(8):
            lo[i, lanes(0)] = T.Broadcast(T.float32(0), KLANES)
            hi[i, lanes(0)] = T.Broadcast(T.float32(0), KLANES)
        for s in T.serial(steps):
            for t in T.unroll(TOKENS):
                for r in T.unroll(ROWS):
                    if t * ROWS + r < 8:
                        lo[t * ROWS + r, lanes(0)] = (
                            lo[t * ROWS + r, lanes(0)]
                            + x[T.min(t0 + t, m - 1), lanes(s * KLANES)]
                            * w[T.min(r0 + r, out_features - 1), lanes(s * KLANES)]
                        )
                    else:
                        hi[t * ROWS + r - 8, lanes(0)] = (
                            hi[t * ROWS + r - 8, lanes(0)]
                            + x[T.min(t0 + t, m - 1), lanes(s * KLANES)]
                            * w[T.min(r0 + r, out_features - 1), lanes(s * KLANES)]
                        )
        vals = T.meta_var([lo[i, lanes(0)] for i in range(8)] + [hi[i, lanes(0)] for i in range(8)])
        lo[0, lanes(0)] = _sum16(_transpose16(vals))  # lane t * ROWS + r: token t0 + t, row r0 + r
        for t in T.unroll(TOKENS):
            for r in T.unroll(ROWS):
                if t0 + t < m and r0 + r < out_features:
                    y[t0 + t, r0 + r] = lo[0, t * ROWS + r]

    @T.prim_func(private=True)
    def f32_gemm(x_h: T.handle, w: T.Buffer((out_features, in_features), "float32"), y_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, in_features), "float32")
        y = T.match_buffer(y_h, (m, out_features), "float32")
        for task in T.parallel((m + BLOCK - 1) // BLOCK):
            for rt in T.serial(row_tiles):
                for tt in T.serial(BLOCK // TOKENS):
                    if task * BLOCK + tt * TOKENS < m:
                        tile(x, w, y, m, task * BLOCK + tt * TOKENS, rt * ROWS)

    return f32_gemm


def _sum16(cols: list):
    """The 16 transposed columns added in a balanced tree: lane i is row i's sum over its lanes."""
    while len(cols) > 1:
        cols = [cols[i] + cols[i + 1] for i in range(0, len(cols), 2)]
    return cols[0]
