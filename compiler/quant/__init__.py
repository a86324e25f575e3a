"""Quantization schemes: pure numpy packing paired with the TIR that undoes it (scheme.py).

Each scheme module implements `Scheme`: NAME, param_specs, pack, and the TIR half in kernels/
(matmul, take), so a model never sees how a weight is stored.
"""

from __future__ import annotations

from . import f32, int4, int8, int8int8
from .scheme import Scheme

SCHEMES: dict[str, Scheme] = {m.NAME: m for m in (f32, int8, int8int8, int4)}
QUANT_MODES = (*SCHEMES, "int4mix")


def scheme_for(quant: str, source_bits: float) -> Scheme:
    """The scheme for one weight tensor under a build's --quant mode."""
    if quant == "int4mix":
        # Keep the checkpoint's own precision mix: what it stored at >= 5 bits stays 8-bit.
        return int8 if source_bits >= 5 else int4
    try:
        return SCHEMES[quant]
    except KeyError:
        raise ValueError(f"unknown quant {quant!r}; choose one of {', '.join(QUANT_MODES)}") from None
