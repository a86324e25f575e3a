"""What a quantization scheme is: pure numpy packing, paired with the TIR that reads it back.

Each scheme is a module of this package implementing `Scheme` (a module satisfies a Protocol by
its attributes). Its numpy half (pack, and the numpy twins tests and the self-test check the
kernels against) lives in the module; its TIR half in kernels/, which `matmul` and `take` point
at. A model never sees how a weight is stored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
from tvm import te, tirx

ParamSpecs = dict[str, tuple[tuple[int, ...], str]]  # param -> (shape, dtype)
TeLinear = Callable[..., te.Tensor]  # (x, *params) -> y, a te compute the QuantMatmul schedule takes


class Scheme(Protocol):
    NAME: str  # the scheme's name in the manifest
    # The grouped affine layout its kernel reads (kernels/affine.py's Layout: each one the model
    # uses is a self-test fixture), or None.
    layout: Any

    def transcode(self, parts: Sequence[Any]) -> dict[str, np.ndarray] | None:
        """The parameters from the checkpoint's own blocks (its SourceTensor parts, rows
        concatenated), kept exactly; None for a scheme that packs the float image instead."""
        ...

    def rows(self, parts: Sequence[Any]) -> Any:
        """The same a slice of rows at a time (quant/gguf.py's Rows), or None."""
        ...

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        """The packed parameters of an (out, in) weight."""
        ...

    def pack(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        """(out, in) float32 -> the packed parameters; offline, at build time."""
        ...

    def matmul(self, out_features: int, in_features: int) -> tirx.PrimFunc | TeLinear:
        """y = x @ W^T from the packed parameters, dequantizing in the loop: a hand-scheduled TIR
        kernel, called as (x, *params, y), or a te compute."""
        ...

    take: Callable[..., te.Tensor]  # (ids, *params) -> embedding rows (a tied LM head's), dequantized


def packs_the_float_image(parts: Sequence[Any]) -> None:
    """`transcode` and `rows` of a scheme that quantizes the checkpoint's float image (`pack`):
    it keeps no block as it was."""
    return None
