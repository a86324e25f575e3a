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


class _ManyTokens:
    """f32 for callers whose every matmul has many tokens (an encoder's whole inputs): the same
    weights, read by the register-tiled GEMM (kernels/f32.gemm) where k is a multiple of 16."""

    NAME, layout = NAME, None
    take, pack, param_specs = staticmethod(take), staticmethod(pack), staticmethod(param_specs)
    transcode = rows = staticmethod(packs_the_float_image)

    @staticmethod
    def matmul(out_features: int, in_features: int):
        if in_features % tir.KLANES:
            return tir.linear
        return tir.gemm(out_features, in_features)


MANY_TOKENS = _ManyTokens()
