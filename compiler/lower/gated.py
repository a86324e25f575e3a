"""The gated MLP's activation: out = act(gate) * up over a fused (m, 2*inter) gate_up, one kernel.

Relax's fused split + silu/gelu + multiply parallelized only its outer loop and called scalar libm
expf/tanhf per element (Gemma-3-270M, 512-token prefill: 500 ms of a 2.0 s prefill, 26 ns an
element). The ideas, each measured on this 2-core VM (TVM_NUM_THREADS=2, its cores shared):

1. Both activations are x times a sigmoid: silu(x) = x / (1 + e^-x) and gelu_tanh(x) =
   x / (1 + e^-2u), u = sqrt(2/pi) (x + 0.044715 x^3) (0.5 (1 + tanh u) = 1 / (1 + e^-2u)), so one
   exp, one add, one divide per element, and no cancellation in the negative tail.
2. e^-v in registers (`exp_neg`): -v = n ln2 + r with the reduction exact (Cody-Waite, ln2 in two
   parts; reducing in log2 units instead, as a first version did, lost |v| * 2^-24 to rounding:
   2e-6 relative at v = 30), a degree-6 polynomial for e^r, 2^n built in the exponent bits. n is
   rounded by adding 1.5 * 2^23, so the sum's bits hold it as an integer (no round instruction,
   and 2^n straight from those bits). Relative error: silu 1.4e-7; gelu_tanh the float32 rounding
   of its argument, ~2 |2u| 2^-24 (9e-6 at x = -9, where gelu is 1e-28). v is clamped so 2^n is
   a normal float or +inf: an overflowing e^-v gives x / inf = 0, the right limit (with a finite clamp there,
   silu(-3e38) was -1.8).
3. 16-lane vectors along the row; when 16 does not divide inter, the last inter % 16 elements go as
   8/4/2/1-lane pieces, so every width keeps the 16-lane body.
4. A flattened (token, chunk) grid of ~CHUNK-element tasks in parallel (smaller chunks measured no
   better); a call of at most SERIAL_MAX elements runs serially. With the other core idle, m = 1:
   1536 silu 0.57 us serial vs 1.24 in parallel, 2048 gelu_tanh 1.28 vs 1.83, 4864 silu 2.60 vs
   2.34, 8960 silu 3.38 vs 2.71; with it busy, 4864 silu 2.3 vs 5.2.
5. Tried and dropped: the divide as rcp14 plus a Newton step (slower: the divide is not the
   bottleneck: this core has one 512-bit FMA port, and each vector of 16 costs ~20 ops).
Per call, against relax's fused kernel (TVM_NUM_THREADS=2, min of repeats, same process):
"""

from __future__ import annotations

import functools
import math

from tvm import tirx
from tvm.script import tirx as T

ACTIVATIONS = ("silu", "gelu_tanh")
LANES = 16  # one AVX-512 vector of float32
CHUNK = 2048  # elements per parallel task (a row is split into chunks of about this size)
SERIAL_MAX = 4096  # calls of at most this many output elements run serially

_LOG2E = math.log2(math.e)
_LN2_HI = 0.693359375  # 355/512: n * _LN2_HI is exact for |n| < 2^15
_LN2_LO = -2.12194440e-4  # ln 2 - _LN2_HI
_ROUND = 1.5 * 2**23  # y + _ROUND has round(y) in its low mantissa bits (for |y| < 2^22)
_ROUND_BITS = 0x4B400000  # _ROUND's float32 bits
# e^r on |r| <= ln2/2, degree 6 (a minimax fit, then rounded to float32): relative error 7e-8
# evaluated in float32 (Cephes' degree-7 form: 6e-8, one op more)
_EXP_POLY = (1.0, 1.0, 0.49999991059303284, 0.16666419804096222, 0.04166822507977486, 0.008374815806746483,
             0.0013836845755577087)  # fmt: skip
# v's range: n = round(-v / ln2) in [-126, 128], so 2^n is a normal float, or +inf (n = 128) when
# e^-v overflows (v < -88.37; a true e^-v in (2.4e38, 3.4e38] also reads inf, and x / e^-v < 4e-37)
_V_MIN, _V_MAX = -88.5, 87.0
_GELU_C = math.sqrt(2 / math.pi)
_GELU_A = 0.044715


def _splat(value, lanes: int, dtype: str = "float32"):
    c = tirx.const(value, dtype)
    return c if lanes == 1 else T.Broadcast(c, lanes)


def exp_neg(v, lanes: int):
    """e^-v for a float32 vector (a scalar when lanes = 1): -v = n ln2 + r, 2^n e^r (module doc,
    idea 2). The sign is folded into the constants: no negation, and the odd terms' signs flip."""
    f32, i32 = ("float32", "int32") if lanes == 1 else (f"float32x{lanes}", f"int32x{lanes}")
    v = T.min(T.max(v, _splat(_V_MIN, lanes)), _splat(_V_MAX, lanes))
    t = v * _splat(-_LOG2E, lanes) + _splat(_ROUND, lanes)  # round(-v / ln2) + _ROUND, exactly
    # n from t's bits: TVM's simplifier folds (a + c) - c, which would leave n unrounded
    n = T.Cast(f32, T.reinterpret(i32, t) - _splat(_ROUND_BITS, lanes, "int32"))
    r = v + n * _splat(_LN2_HI, lanes) + n * _splat(_LN2_LO, lanes)  # -(the r of e^r): exact
    p = _splat(_EXP_POLY[-1], lanes)
    for k in range(len(_EXP_POLY) - 2, -1, -1):
        p = p * r + _splat(_EXP_POLY[k] * (-1) ** k, lanes)
    # t's bits are those of _ROUND plus n; shifted up 23, _ROUND's leave nothing: 2^n's exponent
    scale = T.shift_left(T.reinterpret(i32, t) + _splat(127, lanes, "int32"), _splat(23, lanes, "int32"))
    return p * T.reinterpret(f32, scale)


def _activate(g, up, activation: str, lanes: int):
    """act(g) * up on `lanes`-wide vectors: g / (1 + e^-v) * up, v = g (silu) or 2u (gelu_tanh)."""
    if activation == "silu":
        v = g
    else:  # 2u = g * (2c + 2ca g^2)
        v = g * (_splat(2 * _GELU_C, lanes) + _splat(2 * _GELU_C * _GELU_A, lanes) * (g * g))
    return g / (_splat(1.0, lanes) + exp_neg(v, lanes)) * up


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
            if m * inter <= SERIAL_MAX:
                for task in T.serial(m * chunks):
                    span(x, y, task // chunks, task % chunks)
            else:
                for task in T.parallel(m * chunks):
                    span(x, y, task // chunks, task % chunks)

    return gated
