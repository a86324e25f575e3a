"""Quantization schemes: pure numpy packing paired with the TIR that undoes it (scheme.py).

Each scheme module implements `Scheme`: NAME, param_specs, pack, and the TIR half in kernels/
(matmul, take), so a model never sees how a weight is stored. The gguf mode keeps a GGUF's own
blocks (gguf.py) and is the default for GGUF sources; the others re-quantize its float image.
"""

from __future__ import annotations

from collections.abc import Sequence

from goinfer.artifacts.manifest import ENCODER_QUANTS

from ..sources.base import SourceTensor
from . import f32, gguf, int4, int8, int8int8, q8_0
from .scheme import Scheme

SCHEMES: dict[str, Scheme] = {m.NAME: m for m in (f32, int8, int8int8, int4, q8_0)}
QUANT_MODES = ("gguf", *SCHEMES, "int4mix")
ENCODER_MODES = ENCODER_QUANTS  # the modes an encoder builds in (artifacts/manifest.py says why)
_FLOAT = frozenset({"F32", "F16", "BF16"})


def scheme_for(quant: str, parts: Sequence[SourceTensor]) -> Scheme:
    """The scheme for one weight (its checkpoint tensors, several where fused) under a --quant mode."""
    if quant == "gguf":
        layout = gguf.layout_for(parts)
        if layout is not None:
            return gguf.Transcode(layout)
        # Float tensors stay float32 (exact for F16 and BF16 too); so does a fused weight with one
        # float part. Encodings with no affine form (IQ*, Q2_K, Q3_K) are re-quantized to W8A8.
        return f32 if any(p.source_type in _FLOAT for p in parts) else int8int8
    if quant == "int4mix":
        # Keep the checkpoint's own precision mix: what it stored at >= 5 bits stays 8-bit.
        return int8 if max(p.bits for p in parts) >= 5 else int4
    try:
        return SCHEMES[quant]
    except KeyError:
        raise ValueError(f"unknown quant {quant!r}; choose one of {', '.join(QUANT_MODES)}") from None
