"""The gated MLP's activation: out = act(gate) * up over a fused (m, 2*inter) gate_up, one kernel.

Relax's fused split + silu/gelu + multiply parallelized only its outer loop and called scalar libm
expf/tanhf per element (Gemma-3-270M, 512-token prefill: 500 ms of a 2.0 s prefill, 26 ns an
element). The ideas, each measured on this 2-core VM (TVM_NUM_THREADS=2, its cores shared):

1. Both activations are x times a sigmoid: silu(x) = x / (1 + e^-x) and gelu_tanh(x) =
   x / (1 + e^-2u), u = sqrt(2/pi) (x + 0.044715 x^3) (0.5 (1 + tanh u) = 1 / (1 + e^-2u)), so one
   exp, one add, one divide per element, and no cancellation in the negative tail.
2. e^-v in registers (`vector_math.exp_neg`): -v = n ln2 + r with the reduction exact, a degree-6
   polynomial for e^r, 2^n built in the exponent bits. Relative error: silu 1.4e-7; gelu_tanh the
   float32 rounding of its argument, ~2 |2u| 2^-24 (9e-6 at x = -9, where gelu is 1e-28). An
   overflowing e^-v gives x / inf = 0, the right limit (with a finite clamp there, silu(-3e38)
   was -1.8).
3. 16-lane vectors along the row; when 16 does not divide inter, the last inter % 16 elements go as
   8/4/2/1-lane pieces, so every width keeps the 16-lane body.
4. A flattened (token, chunk) grid of ~CHUNK-element tasks in parallel (smaller chunks measured no
   better); a call of at most SERIAL_OUTPUTS elements runs serially. With the other core idle,
   m = 1: 1536 silu 0.57 us serial vs 1.24 in parallel, 2048 gelu_tanh 1.28 vs 1.83, 4864 silu
   2.60 vs 2.34, 8960 silu 3.38 vs 2.71; with it busy, 4864 silu 2.3 vs 5.2. An output here costs
   an exp and a divide (~20 vector ops a 16), several times a norm's or a copy's element, which
   is why this switch sits at half of schedules.SERIAL_MAX.
5. Tried and dropped: the divide as rcp14 plus a Newton step (slower: the divide is not the
   bottleneck: this core has one 512-bit FMA port, and each vector of 16 costs ~20 ops).
"""

from __future__ import annotations

import functools
import math

from tvm import tirx
from tvm.script import tirx as T

from ..tvm import tvmscript
from .vector_math import exp_neg, splat

tvmscript.install()  # faster TVMScript parsing, the same kernels

ACTIVATIONS = ("silu", "gelu_tanh")
LANES = 16  # one AVX-512 vector of float32
CHUNK = 2048  # elements per parallel task (a row is split into chunks of about this size)
# Calls of at most this many output elements run serially: its own threshold, below the shared
# schedules.SERIAL_MAX, as an output costs an exp and a divide (module doc, idea 4).
SERIAL_OUTPUTS = 4096

_GELU_C = math.sqrt(2 / math.pi)
_GELU_A = 0.044715


def _activate(g, up, activation: str, lanes: int):
    """act(g) * up on `lanes`-wide vectors: g / (1 + e^-v) * up, v = g (silu) or 2u (gelu_tanh)."""
    if activation == "silu":
        v = g
    else:  # 2u = g * (2c + 2ca g^2)
        v = g * (splat(2 * _GELU_C, lanes) + splat(2 * _GELU_C * _GELU_A, lanes) * (g * g))
    return g / (splat(1.0, lanes) + exp_neg(v, lanes)) * up


def _tail_pieces(inter: int) -> list[tuple[int, int]]:
    """(start, lanes) of the pieces covering inter % LANES elements past the 16-lane body."""
    pieces, start = [], inter // LANES * LANES
    for lanes in (8, 4, 2, 1):
        if (inter - start) >= lanes:
            pieces.append((start, lanes))
            start += lanes
    return pieces


# Every layer asks for the same few shapes, and parsing the TVMScript is most of an export
# (Qwen-0.5B: 260 s for 96 linears x 3 forms): build each shape once. PrimFuncs are immutable.
@functools.cache
def kernel(inter: int, activation: str) -> tirx.PrimFunc:
    """y (m, inter) = act(x[:, :inter]) * x[:, inter:] for x (m, 2*inter) float32, m symbolic."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    n_vec = inter // LANES  # 16-lane vectors in the body of a row
    chunks = max(1, -(-inter // CHUNK))
    per_chunk = -(-n_vec // chunks) if n_vec else 0  # body vectors per task
    chunks = -(-n_vec // per_chunk) if n_vec else 1
    tail = _tail_pieces(inter)

    def at(start, lanes):
        return start if lanes == 1 else T.ramp(start, 1, lanes)

    @T.macro
    def piece(x, y, t, start, lanes):
        y[t, at(start, lanes)] = _activate(
            x[t, at(start, lanes)], x[t, at(inter + start, lanes)], activation, lanes
        )

    @T.macro
    def span(x, y, t, c):
        """Token t's chunk c: its body vectors, then the tail pieces when it is the row's last."""
        for j in T.serial(T.min(per_chunk, n_vec - c * per_chunk)):
            piece(x, y, t, (c * per_chunk + j) * LANES, LANES)
        if c == chunks - 1:
            if len(tail) > 0:
                piece(x, y, t, *tail[0])
            if len(tail) > 1:
                piece(x, y, t, *tail[1])
            if len(tail) > 2:
                piece(x, y, t, *tail[2])
            if len(tail) > 3:
                piece(x, y, t, *tail[3])

    # private: relax names each instance. A one-input kernel needs an explicit root block (relax's
    # reshape detection asserts one), which the parser's well-formedness check does not expect.
    @T.prim_func(private=True, check_well_formed=False)
    def gated(x_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, 2 * inter), "float32")
        y = T.match_buffer(y_h, (m, inter), "float32")
        with T.sblock("root"):
            if m * inter <= SERIAL_OUTPUTS:
                for task in T.serial(m * chunks):
                    span(x, y, task // chunks, task % chunks)
            else:
                for task in T.parallel(m * chunks):
                    span(x, y, task // chunks, task % chunks)

    return gated
