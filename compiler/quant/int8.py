"""int8: weight-only, symmetric, one float32 scale per output row."""

from __future__ import annotations

import numpy as np
from tvm import te

from .lanes import LANES, lane_matmul

NAME = "int8"


def param_specs(out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], str]]:
    return {"weight": ((out_features, in_features), "int8"), "scale": ((out_features,), "float32")}


def pack(weight: np.ndarray) -> dict[str, np.ndarray]:
    w = np.asarray(weight, dtype=np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return {"weight": q, "scale": scale}


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
