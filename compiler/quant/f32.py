"""f32: weights kept as float32 (out, in); the reference the int schemes are measured against."""

from __future__ import annotations

import numpy as np
from tvm import te

from .lanes import LANES, lane_matmul

NAME = "f32"


def param_specs(out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], str]]:
    return {"weight": ((out_features, in_features), "float32")}


def pack(weight: np.ndarray) -> dict[str, np.ndarray]:
    return {"weight": np.ascontiguousarray(weight, dtype=np.float32)}


def dequant(weight: te.Tensor, n, k):
    return weight[n, k]


def linear(x: te.Tensor, weight: te.Tensor) -> te.Tensor:
    def product(i, n, ko, ki):
        k = ko * LANES + ki
        return x[i, k] * dequant(weight, n, k)

    return lane_matmul(x, weight.shape[0], product)


def take(ids: te.Tensor, weight: te.Tensor) -> te.Tensor:
    return te.compute((ids.shape[0], weight.shape[1]), lambda t, d: dequant(weight, ids[t], d), name="qtake")
