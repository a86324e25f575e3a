"""int4: symmetric 4-bit, one float16 scale per group of 32 along K: 4.5 bits/weight, the smallest.

The quantizer: the scale per group, chosen for the least squared error. The layout, the kernel
(W4A8: activations quantized to int8 per group at run time) and their numpy twins are the grouped
affine ones (kernels/affine.py, quant/affine.py) with signed nibbles stored as q + 8.
"""

from __future__ import annotations

import numpy as np
from tvm import tirx

from ..kernels import affine as tir
from . import affine
from .scheme import ParamSpecs, packs_the_float_image

NAME = "int4"
GROUP = 32
ZERO = 8  # the stored offset: nibble = q + 8
LAYOUT = tir.Layout(bits=4, group=GROUP, code="float16", has_min=False, zero=ZERO)


def param_specs(out_features: int, in_features: int) -> ParamSpecs:
    if in_features % GROUP:
        raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {in_features}")
    return affine.param_specs(LAYOUT, out_features, in_features)


# Candidate divisors for a group's scale: the largest-magnitude weight lands on a level near the
# edge of [-8, 7]. Trying a few and keeping the least squared error per group matters when the
# source is itself 4-bit (re-quantizing a Q4_K/Q4_1 grid onto ours): 9.3% -> 8.2% rms error on
# SmolLM2's ffn_down, measured.
_DIVISORS = (-8.0, -7.5, -7.0, -6.5, 6.5, 7.0, 7.5, 8.0)


def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out, in) float32 -> q (out, in) int8 in [-8, 7] and scale (out, in/32) float16."""
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
    q = np.clip(np.rint(groups / scale[..., None]), -8, 7).astype(np.int8).reshape(n, k)
    return q, scale.astype(np.float16)


def pack(weight: np.ndarray) -> dict[str, np.ndarray]:
    q, scale = quantize(weight)
    return affine.pack(LAYOUT, q.astype(np.int32) + ZERO, scale)


def unpack_q(weight: np.ndarray, out_features: int) -> np.ndarray:
    """numpy twin of the layout: the (out, in) q values in [-8, 7] (tests, self-test)."""
    return (affine.unpack_u(LAYOUT, weight, out_features) - ZERO).astype(np.int8)


def unpack_scale(scale: np.ndarray, out_features: int) -> np.ndarray:
    return affine.scales(LAYOUT, {"scale": scale}, out_features)[0]


def unpack(weight: np.ndarray, scale: np.ndarray, out_features: int) -> np.ndarray:
    """The dequantized (out, in) float32 weights (tests)."""
    return affine.dequantize(LAYOUT, {"weight": weight, "scale": scale}, out_features)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy twin of the kernels' prologue: int8 per group of 32 and one float32 scale per group."""
    return affine.quantize_activations(x, GROUP)


def reference(x: np.ndarray, weight: np.ndarray, scale: np.ndarray, n: int) -> np.ndarray:
    """What the kernels compute for n output rows, in numpy."""
    return affine.reference(LAYOUT, x, {"weight": weight, "scale": scale}, n)


def matmul(out_features: int, in_features: int) -> tirx.PrimFunc:
    """The W4A8 kernel with its ISA forms."""
    return tir.kernel(out_features, in_features, LAYOUT)


take = tir.take(LAYOUT)
layout = LAYOUT
transcode = rows = packs_the_float_image
