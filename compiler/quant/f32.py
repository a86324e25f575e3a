"""f32: weights kept as float32 (out, in); the reference the int schemes are measured against."""

from __future__ import annotations

import numpy as np

from ..kernels import f32 as tir
from .scheme import ParamSpecs, TeLinear, packs_the_float_image

NAME = "f32"


def param_specs(out_features: int, in_features: int) -> ParamSpecs:
    return {"weight": ((out_features, in_features), "float32")}


def pack(weight: np.ndarray) -> dict[str, np.ndarray]:
    return {"weight": np.ascontiguousarray(weight, dtype=np.float32)}


def matmul(out_features: int, in_features: int) -> TeLinear:
    return tir.linear


take = tir.take
layout = None
transcode = rows = packs_the_float_image
