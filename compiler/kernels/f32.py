"""f32 weights read back in te: the matmul and the embedding rows of quant/f32.py's (out, in)."""

from __future__ import annotations

from tvm import te

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
