"""int8int8: int8 weights per row (as int8) and int8 activations per token, int32 accumulation.

Activations are quantized at run time: scale_x[t] = max|x[t, :]| / 127. The product of the two
scales turns the int32 dot product back into float32.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from . import int8
from .lanes import LANES, lane_matmul

NAME = "int8int8"
param_specs = int8.param_specs
pack = int8.pack
dequant = int8.dequant
take = int8.take


def linear(x: te.Tensor, weight: te.Tensor, scale: te.Tensor) -> te.Tensor:
    m, kdim = x.shape
    ra = te.reduce_axis((0, kdim), name="ka")
    amax = te.compute((m,), lambda i: te.max(tirx.abs(x[i, ra]), axis=ra), name="act_amax")
    xscale = te.compute(
        (m,),
        lambda i: tirx.Select(amax[i] > 0, amax[i] / 127.0, tirx.const(1.0, "float32")),
        name="act_scale",
    )
    xq = te.compute(
        (m, kdim),
        lambda i, k: tirx.max(tirx.min(tirx.round(x[i, k] / xscale[i]), 127.0), -127.0).astype("int8"),
        name="act_quant",
    )

    def product(i, n, ko, ki):
        k = ko * LANES + ki
        return xq[i, k].astype("int32") * weight[n, k].astype("int32")

    acc = lane_matmul(x, weight.shape[0], product)
    return te.compute(
        acc.shape, lambda i, n: acc[i, n].astype("float32") * (xscale[i] * scale[n]), name="qmatmul_scale"
    )


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The numpy twin of the run-time activation quantization (used by tests)."""
    amax = np.abs(x).max(axis=-1)
    s = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    return np.clip(np.rint(x / s[..., None]), -127, 127).astype(np.int8), s
