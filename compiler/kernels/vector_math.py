"""Elementwise math on TIR vectors that stays in registers.

LLVM turns exp/exp2 on a vector into one libm call per lane (no vector math library is linked),
which made a 512-token gated MLP's activation 26 ns an element. These are one polynomial instead:
x = n + f (2^n built in the exponent bits), and e^r for the rest.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

_LN2 = math.log(2)
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


def splat(value, lanes: int, dtype: str = "float32"):
    """A constant as a `lanes`-wide vector (a scalar when lanes = 1)."""
    c = tirx.const(value, dtype)
    return c if lanes == 1 else T.Broadcast(c, lanes)


def exp_neg(v, lanes: int):
    """e^-v for a float32 vector (a scalar when lanes = 1): -v = n ln2 + r, 2^n e^r.

    The reduction is exact (Cody-Waite, ln2 in two parts; reducing in log2 units instead, as a
    first version did, lost |v| * 2^-24 to rounding: 2e-6 relative at v = 30). n is rounded by
    adding 1.5 * 2^23, so the sum's bits hold it as an integer (no round instruction, and 2^n
    straight from those bits). v is clamped so 2^n is a normal float or +inf: an overflowing e^-v
    gives x / inf = 0 in a sigmoid, the right limit. The sign is folded into the constants: no
    negation, and the odd terms' signs flip."""
    f32, i32 = ("float32", "int32") if lanes == 1 else (f"float32x{lanes}", f"int32x{lanes}")
    v = T.min(T.max(v, splat(_V_MIN, lanes)), splat(_V_MAX, lanes))
    t = v * splat(-_LOG2E, lanes) + splat(_ROUND, lanes)  # round(-v / ln2) + _ROUND, exactly
    # n from t's bits: TVM's simplifier folds (a + c) - c, which would leave n unrounded
    n = T.Cast(f32, T.reinterpret(i32, t) - splat(_ROUND_BITS, lanes, "int32"))
    r = v + n * splat(_LN2_HI, lanes) + n * splat(_LN2_LO, lanes)  # -(the r of e^r): exact
    p = splat(_EXP_POLY[-1], lanes)
    for k in range(len(_EXP_POLY) - 2, -1, -1):
        p = p * r + splat(_EXP_POLY[k] * (-1) ** k, lanes)
    # t's bits are those of _ROUND plus n; shifted up 23, _ROUND's leave nothing: 2^n's exponent
    scale = T.shift_left(T.reinterpret(i32, t) + splat(127, lanes, "int32"), splat(23, lanes, "int32"))
    return p * T.reinterpret(f32, scale)


def exp2(x, lanes: int, bounded_above: bool = False):
    """2**x for a float32 vector: 2**round(x) built in the exponent bits, times e^r's polynomial
    at r = (x - n) ln2 (ln2^k folded into its coefficients). x is clamped to [-126, 127], so it
    never overflows, goes subnormal or NaN (`bounded_above`: the caller knows x <= 0, and the upper
    clamp is skipped). 2**0 is exactly 1: a softmax's largest weight stays 1."""
    x = T.max(x, splat(-126.0, lanes))
    if not bounded_above:
        x = T.min(x, splat(127.0, lanes))
    n = T.nearbyint(x)
    p = splat(_EXP_POLY[-1] * _LN2 ** (len(_EXP_POLY) - 1), lanes)
    for k in range(len(_EXP_POLY) - 2, -1, -1):
        p = p * (x - n) + splat(_EXP_POLY[k] * _LN2**k, lanes)  # x - n is in [-0.5, 0.5]
    bits = T.shift_left(T.Cast(f"int32x{lanes}", n) + splat(127, lanes, "int32"), splat(23, lanes, "int32"))
    return p * T.reinterpret(f"float32x{lanes}", bits)
