"""The te matmul shape of the schemes without a hand-written kernel (f32, int8): K split as
(word, lane), so the QuantMatmul schedule (tvm/schedules.py) can keep one accumulator per lane
(rfactor) and dequantize a whole word at a time."""

from __future__ import annotations

from collections.abc import Callable

from tvm import te

LANES = 8  # the lane split of K, one rfactor accumulator per lane


def lane_matmul(x: te.Tensor, out_features, product: Callable, dtype: str = "float32") -> te.Tensor:
    """out[i, n] = sum over (ko, ki) of product(i, n, ko, ki), with k = ko * LANES + ki."""
    m, kdim = x.shape
    ko = te.reduce_axis((0, kdim // LANES), name="ko")
    ki = te.reduce_axis((0, LANES), name="ki")
    return te.compute(
        (m, out_features), lambda i, n: te.sum(product(i, n, ko, ki), axis=[ko, ki]), name="qmatmul"
    )
