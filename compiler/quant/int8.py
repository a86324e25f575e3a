"""int8: weight-only, symmetric, one float32 scale per output row."""

from __future__ import annotations

import numpy as np

from ..kernels import int8 as tir
from .scheme import ParamSpecs, TeLinear, packs_the_float_image

NAME = "int8"


def param_specs(out_features: int, in_features: int) -> ParamSpecs:
    return {"weight": ((out_features, in_features), "int8"), "scale": ((out_features,), "float32")}


def pack(weight: np.ndarray) -> dict[str, np.ndarray]:
    w = np.asarray(weight, dtype=np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return {"weight": q, "scale": scale}


def matmul(out_features: int, in_features: int) -> TeLinear:
    return tir.linear


take = tir.take
layout = None
transcode = rows = packs_the_float_image
