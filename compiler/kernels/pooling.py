"""An encoder's last step: each packed input's token states -> one L2-normalized vector.

The inputs are packed (input b is rows [offsets[b], offsets[b+1]) of x), so the pool is a loop
over each input's own rows: no padding, no mask. The modes are sentence-transformers' (its
Pooling module): the mean of the input's tokens, its first token ([CLS]) or its last; then its
Normalize module, x / max(|x|, 1e-12).
"""

from __future__ import annotations

import functools

from goinfer.artifacts.manifest import POOLINGS
from tvm import tirx
from tvm.script import tirx as T

from ..tvm import tvmscript

tvmscript.install()

NORM_EPS = 1e-12  # torch.nn.functional.normalize's default, as sentence-transformers calls it


@functools.cache
def kernel(hidden: int, mode: str) -> tirx.PrimFunc:
    """(x (n, hidden), offsets (b + 1,)) -> (b, hidden) float32."""
    if mode not in POOLINGS:
        raise ValueError(f"pooling {mode!r}: choose one of {', '.join(POOLINGS)}")

    @T.macro
    def mean(x, acc, lo, hi):
        for t in T.serial(hi - lo):
            for c in T.vectorized(hidden):
                acc[c] = acc[c] + x[lo + t, c]
        for c in T.vectorized(hidden):
            acc[c] = acc[c] / T.Cast("float32", T.max(hi - lo, 1))

    @T.macro
    def first(x, acc, lo, hi):
        for c in T.vectorized(hidden):
            acc[c] = x[lo, c]

    @T.macro
    def last(x, acc, lo, hi):
        for c in T.vectorized(hidden):
            acc[c] = x[hi - 1, c]

    # chosen here: a Python `if mode == ...` inside the TVMScript kept only its first branch
    reduce = {"mean": mean, "cls": first, "last": last}[mode]

    @T.prim_func(private=True)
    def pool(var_x: T.handle, var_offsets: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n, edges, off = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(var_x, (n, hidden), "float32")
        offsets = T.match_buffer(var_offsets, (edges,), "int32", elem_offset=off)
        out = T.match_buffer(var_out, (edges - 1, hidden), "float32")
        for b in T.parallel(edges - 1):
            acc = T.alloc_buffer((hidden,), "float32")
            sq = T.alloc_buffer((1,), "float32")
            lo = T.Bind(T.Cast("int64", offsets[b]))
            hi = T.Bind(T.Cast("int64", offsets[b + 1]))
            for c in T.serial(hidden):
                acc[c] = T.float32(0)
            reduce(x, acc, lo, hi)
            sq[0] = T.float32(0)
            for c in T.serial(hidden):
                sq[0] = sq[0] + acc[c] * acc[c]
            inv = T.Bind(T.float32(1) / T.max(T.sqrt(sq[0]), T.float32(NORM_EPS)))
            for c in T.vectorized(hidden):
                out[b, c] = acc[c] * inv

    return pool
