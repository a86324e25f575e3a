"""int8int8 (W8A8): int8 weights per row, the kernel quantizing activations to int8 per token.

The numpy half: packing into the row-block layout kernels/int8int8.py documents and reads, and
the numpy twins of what it computes, which the tests and the startup self-test hold it to.
"""

from __future__ import annotations

import numpy as np

from ..kernels import int8int8 as tir
from ..kernels.int8int8 import PER_WORD, ROW_BLOCK
from . import int8
from .scheme import ParamSpecs, packs_the_float_image

NAME = "int8int8"


def param_specs(out_features: int, in_features: int) -> ParamSpecs:
    if in_features % PER_WORD:
        raise ValueError(f"int8int8 needs in_features divisible by {PER_WORD}, got {in_features}")
    blocks = -(-out_features // ROW_BLOCK)
    return {
        "weight": ((blocks, in_features // PER_WORD, ROW_BLOCK), "int32"),
        "wsum": ((out_features,), "int32"),
        "scale": ((out_features,), "float32"),
    }


def pack(weight: np.ndarray) -> dict[str, np.ndarray]:
    p = int8.pack(weight)  # per-row symmetric int8, as weight-only int8
    q, scale = p["weight"], p["scale"]
    n, k = q.shape
    blocks = -(-n // ROW_BLOCK)
    padded = np.zeros((blocks * ROW_BLOCK, k), np.int8)
    padded[:n] = q
    words = padded.reshape(blocks, ROW_BLOCK, k // PER_WORD, PER_WORD).transpose(0, 2, 1, 3)
    return {
        "weight": np.ascontiguousarray(words).view("<i4").reshape(blocks, k // PER_WORD, ROW_BLOCK),
        "wsum": q.astype(np.int32).sum(axis=1, dtype=np.int32),
        "scale": scale,
    }


def unpack(weight: np.ndarray, out_features: int) -> np.ndarray:
    """numpy twin of the layout: the (out, in) int8 weights `pack` quantized (tests)."""
    blocks, words, _ = weight.shape
    b = np.ascontiguousarray(weight).view(np.int8).reshape(blocks, words, ROW_BLOCK, PER_WORD)
    return b.transpose(0, 2, 1, 3).reshape(blocks * ROW_BLOCK, words * PER_WORD)[:out_features]


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The numpy twin of the run-time activation quantization (used by tests)."""
    amax = np.abs(x).max(axis=-1)
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    inv = np.float32(1) / s  # the kernels multiply by the reciprocal, rounded as here
    return np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int8), s


def reference(x: np.ndarray, weight: np.ndarray, wsum: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What the kernels compute, in numpy: int8 activations x int8 weights, exact int32 sums."""
    xq, xs = quantize_activations(x)
    dot = xq.astype(np.int64) @ unpack(weight, scale.shape[0]).astype(np.int64).T
    return (dot * (xs.astype(np.float64)[:, None] * scale[None, :])).astype(np.float32)


matmul = tir.kernel  # (out, in) -> the W8A8 kernel with its ISA forms
take = tir.take
layout = None
transcode = rows = packs_the_float_image
