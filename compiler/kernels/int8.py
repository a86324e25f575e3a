"""int8 weights read back in te: the matmul and the embedding rows of quant/int8.py's packing
(int8 (out, in), one float32 scale per row)."""

from __future__ import annotations

from tvm import te

from .lanes import LANES, lane_matmul


def dequant(weight: te.Tensor, scale: te.Tensor, n, k):
    return weight[n, k].astype("float32") * scale[n]


def linear(x: te.Tensor, weight: te.Tensor, scale: te.Tensor) -> te.Tensor:
    # The row scale is constant along K, so it is applied once after the dot product.
    def product(i, n, ko, ki):
        k = ko * LANES + ki
        return x[i, k] * weight[n, k].astype("float32")

    acc = lane_matmul(x, weight.shape[0], product)
    return te.compute(acc.shape, lambda i, n: acc[i, n] * scale[n], name="qmatmul_scale")


def take(ids: te.Tensor, weight: te.Tensor, scale: te.Tensor) -> te.Tensor:
    return te.compute(
        (ids.shape[0], weight.shape[1]), lambda t, d: dequant(weight, scale, ids[t], d), name="qtake"
    )
