"""Derive a small, float32-weight GGUF from a real one, to check the reference tightly.

llama.cpp rounds every matmul input to 8 bits when the weights are quantized, and through many
layers that rounding is chaotic (a 1e-7 nudge moves log-probs by ~0.1), so a quantized model can
only be compared loosely. With float32 block weights llama.cpp does float32 math, and the reference
must then agree to ~1e-4. Deterministic: the same source file always gives the same tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def derive_f32_gguf(
    src: str | Path | GGUFReader, dst: str | Path, n_layer: int, overrides: dict[str, int]
) -> None:
    """Copy src's first n_layer blocks as F32 to dst, and quantized token_embd/output as F16.

    F16 rather than F32 for the vocab-sized matrices halves the file; llama.cpp then rounds the
    final activations to f16, which reference_logits(..., llama_cpp_activations=True) mirrors.

    overrides: integer metadata to set (written as UINT32 when src lacks the key). src may be an
    open reader, to spare a second parse of a large vocabulary.
    """
    r = src if isinstance(src, GGUFReader) else GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    meta: dict[str, Any] = {f"{arch}.block_count": n_layer, **overrides}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, meta.pop(key, field.contents()), vtype, sub_type=sub)
    for key, value in meta.items():
        w.add_key_value(key, value, GGUFValueType.UINT32)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layer:
            continue
        shape = [int(n) for n in reversed(t.shape)]
        values = dequantize(t.data, t.tensor_type).reshape(shape)
        small = t.name.startswith("blk.") or t.tensor_type == GGMLQuantizationType.F32
        w.add_tensor(t.name, values.astype(np.float32 if small else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
