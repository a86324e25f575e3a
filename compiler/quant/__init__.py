"""Quantization schemes: pure numpy packing paired with the TIR that undoes it.

Each scheme module exposes
  NAME          the scheme's name in the manifest
  param_specs(out_features, in_features) -> {param: (shape, dtype)}
  pack(weight (out, in) float32) -> {param: ndarray}       offline, at build time
  linear(x, **params) -> te.Tensor                          y = x @ W^T, dequantizing in the loop
    or kernel(out, in) -> PrimFunc                          the same, as a hand-scheduled TIR kernel
  take(ids, **params) -> te.Tensor                          embedding rows, dequantized
so a model never sees how a weight is stored.
"""

from __future__ import annotations

from types import ModuleType

from . import f32, int4, int8, int8int8

SCHEMES: dict[str, ModuleType] = {m.NAME: m for m in (f32, int8, int8int8, int4)}
QUANT_MODES = (*SCHEMES, "int4mix")


def scheme_for(quant: str, source_bits: float) -> ModuleType:
    """The scheme for one weight tensor under a build's --quant mode."""
    if quant == "int4mix":
        # Keep the checkpoint's own precision mix: what it stored at >= 5 bits stays 8-bit.
        return int8 if source_bits >= 5 else int4
    try:
        return SCHEMES[quant]
    except KeyError:
        raise ValueError(f"unknown quant {quant!r}; choose one of {', '.join(QUANT_MODES)}") from None
