"""q8_0: a float checkpoint re-quantized to GGUF's Q8_0 blocks, then read as the gguf mode reads a
Q8_0 file (kernels/affine.py): 8-bit weights with a float16 scale per 32, activations quantized
to int8 per 32 at run time. What `convert_hf_to_gguf --outtype q8_0` writes and llama.cpp runs.

Per-group scales on both sides keep an outlier in one group from costing the rest their bits:
all-MiniLM-L6-v2's vectors held cosine 0.992 to f32 under int8int8 (one scale per token and
per row), against >= 0.9995 here (tests/e2e/test_embed_reference.py).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants
from tvm import tirx

from ..kernels import affine as tir
from ..kernels.affine import Layout
from . import affine, gguf_blocks
from .scheme import ParamSpecs, TeLinear, packs_the_float_image

NAME = "q8_0"
# gguf's quantizer rounds to [-127, 127]: no -128, so AVX2's sign trick holds (full_range False).
layout = Layout(bits=8, group=32, code="float16", has_min=False, zero=128)


def param_specs(out_features: int, in_features: int) -> ParamSpecs:
    return affine.param_specs(layout, out_features, in_features)


def blocks(weight: np.ndarray) -> np.ndarray:
    """(out, in) float32 -> its Q8_0 blocks as gguf's quantizer writes them, (out, in/32 * 34) u8."""
    return quants.quantize(np.asarray(weight, np.float32), GGMLQuantizationType.Q8_0)


def pack(weight: np.ndarray) -> dict[str, np.ndarray]:
    rows, k = weight.shape
    layout.check(k)
    d = gguf_blocks.decode(blocks(weight), "Q8_0", (rows, k))
    u = (d.q + np.int16(layout.zero)).astype(np.uint8)
    scale = d.scale.codes  # float16, as stored
    return affine.pack(layout, u, scale)


def matmul(out_features: int, in_features: int) -> tirx.PrimFunc | TeLinear:
    return tir.kernel(out_features, in_features, layout)


take = tir.take(layout)
transcode = rows = packs_the_float_image
