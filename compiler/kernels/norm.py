"""RMSNorm over the hidden size, alone or with the residual add before it, as one kernel.

A pre-norm block adds each sublayer's output to the residual stream and normalizes the sum for
the next sublayer. Relax ran that as two kernels (its add, then its rms_norm) with the sum written
out between them: two such pairs a decode layer, each kernel a VM call and an output buffer. The
ideas:

1. One kernel, two outputs: s = x + r (the stream, kept for the next add) and y = norm(s) * w,
   s's sum of squares taken while it is written.
2. 16-lane vectors, the sum of squares in 16 partial sums added across once a token; a hidden size
   that 16 does not divide ends in scalar steps.
3. A token a task in parallel once a call is large enough (prefill); a decode step's one token
   runs on the calling thread, less work than waking the pool.

Measured against relax's pair (2-core Xeon, bundles A/B in one process): SmolLM2 pp512 +2-3.5%;
decode within noise on its own, -3.7% on Qwen-0.5B together with the views dropped around every
matmul (models/decoder.py).
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from ..tvm import tvmscript
from ..tvm.schedules import SERIAL_MAX  # calls of at most this many elements run serially

tvmscript.install()  # faster TVMScript parsing, the same kernels

LANES = 16  # one AVX-512 vector of float32 (two AVX2 ones)


def sum_lanes(v, n: int):
    total = v[0]
    for i in range(1, n):
        total = total + v[i]
    return total


@functools.cache
def kernel(hidden: int, eps: float, residual: bool) -> tirx.PrimFunc:
    """residual: (x, r, w) -> (s = x + r, y = s / rms(s) * w); else (x, w) -> y = x / rms(x) * w.
    x, r, s, y are (m, hidden) float32 with m symbolic; w is (hidden,)."""
    n_vec, tail = divmod(hidden, LANES)

    def vec(start):
        return T.ramp(start, 1, LANES)

    @T.macro
    def token(x, r, w, s, y, t):
        sq = T.alloc_buffer((LANES,), "float32")
        sq[vec(0)] = T.Broadcast(T.float32(0), LANES)
        for j in T.serial(n_vec):
            if residual:
                s[t, vec(j * LANES)] = x[t, vec(j * LANES)] + r[t, vec(j * LANES)]
                sq[vec(0)] = sq[vec(0)] + s[t, vec(j * LANES)] * s[t, vec(j * LANES)]
            else:
                sq[vec(0)] = sq[vec(0)] + x[t, vec(j * LANES)] * x[t, vec(j * LANES)]
        for i in T.serial(tail):
            if residual:
                s[t, n_vec * LANES + i] = x[t, n_vec * LANES + i] + r[t, n_vec * LANES + i]
                sq[0] = sq[0] + s[t, n_vec * LANES + i] * s[t, n_vec * LANES + i]
            else:
                sq[0] = sq[0] + x[t, n_vec * LANES + i] * x[t, n_vec * LANES + i]
        inv = T.Bind(T.float32(1) / T.sqrt(sum_lanes(sq, LANES) / T.float32(hidden) + T.float32(eps)))
        for j in T.serial(n_vec):
            src = s[t, vec(j * LANES)] if residual else x[t, vec(j * LANES)]
            y[t, vec(j * LANES)] = src * T.Broadcast(inv, LANES) * w[vec(j * LANES)]
        for i in T.serial(tail):
            k = n_vec * LANES + i
            y[t, k] = (s[t, k] if residual else x[t, k]) * inv * w[k]

    @T.macro
    def every_token(x, r, w, s, y, m):
        if m * hidden <= SERIAL_MAX:
            for t in T.serial(m):
                token(x, r, w, s, y, t)
        else:
            for t in T.parallel(m):
                token(x, r, w, s, y, t)

    if residual:

        @T.prim_func(private=True)  # private: relax names each instance
        def add_rms_norm(
            x_h: T.handle, r_h: T.handle, w: T.Buffer((hidden,), "float32"), s_h: T.handle, y_h: T.handle
        ):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            m = T.int64()
            x = T.match_buffer(x_h, (m, hidden), "float32")
            r = T.match_buffer(r_h, (m, hidden), "float32")
            s = T.match_buffer(s_h, (m, hidden), "float32")
            y = T.match_buffer(y_h, (m, hidden), "float32")
            every_token(x, r, w, s, y, m)

        return add_rms_norm

    @T.prim_func(private=True)
    def rms_norm(x_h: T.handle, w: T.Buffer((hidden,), "float32"), y_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, hidden), "float32")
        y = T.match_buffer(y_h, (m, hidden), "float32")
        every_token(x, None, w, None, y, m)

    return rms_norm
