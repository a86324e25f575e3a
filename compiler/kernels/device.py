"""Kernels for GPU targets: plain te computes that dlight's GPU rules schedule (tvm/schedules.py).

The CPU kernels beside this file are hand-scheduled for one core's registers and cache (VNNI
dot products, parallel loops, software prefetch) and mean nothing to a GPU. Here each is written
as what it computes, and the GPU schedule decides threads, shared memory and tensor cores:

- `linear`: y = x @ W^T with W dequantized in the kernel from the same packed parameters the CPU
  reads, through the scheme's own `take` (the exact dequantization the embedding uses), so one
  bundle's weights serve every target. Quantized weights go to the matmul in float16 against
  float16 activations, accumulated in float32: decode is a dequant-fused GEMV, and a prefill
  chunk meets the tensor-core schedule, which takes float16 operands only. f32 weights stay f32.
- `gated`: act(gate) * up over the fused gate_up, elementwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tvm import te, tirx

_GELU_C = math.sqrt(2 / math.pi)
_GELU_A = 0.044715


def _i64(v: int) -> tirx.IntImm:
    # Relax hands te int64 shapes; a static dimension in int32 beside them fails the GPU
    # matmul schedule's layout rewrite (mixed index types on one buffer).
    return tirx.IntImm("int64", v)


def linear(take: Callable[..., te.Tensor], out_features: int, in_features: int, half: bool):
    """te compute (x, *params) -> (tokens, out) float32, dequantizing with `take`."""
    dtype = "float16" if half else "float32"

    def compute(x: te.Tensor, *params: te.Tensor) -> te.Tensor:
        rows = te.compute((_i64(out_features),), lambda n: n, name="rows")
        w = take(rows, *params)  # (out, in) float32: every row's dequantized weights
        if half:
            w = te.compute(w.shape, lambda n, k: w[n, k].astype(dtype), name="w_half")
            x = te.compute(x.shape, lambda i, k: x[i, k].astype(dtype), name="x_half")
        k = te.reduce_axis((0, _i64(in_features)), name="k")
        return te.compute(
            (x.shape[0], _i64(out_features)),
            lambda i, n: te.sum(x[i, k].astype("float32") * w[n, k].astype("float32"), axis=k),
            name="matmul",
        )

    return compute


def gated(inter: int, activation: str):
    """te compute gate_up (tokens, 2*inter) -> act(gate) * up (tokens, inter).

    Both activations as x times a sigmoid (kernels/gated.py, idea 1): silu(g) = g / (1 + e^-g),
    gelu_tanh(g) = g / (1 + e^-2u), u = sqrt(2/pi) (g + 0.044715 g^3)."""

    def compute(gate_up: te.Tensor) -> te.Tensor:
        def f(t, j):
            g, up = gate_up[t, j], gate_up[t, j + inter]
            v = g if activation == "silu" else g * (2 * _GELU_C + 2 * _GELU_C * _GELU_A * g * g)
            return g / (tirx.const(1.0, "float32") + tirx.exp(-v)) * up

        return te.compute((gate_up.shape[0], _i64(inter)), f, name="gated")

    return compute
