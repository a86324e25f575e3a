"""What every checkpoint source hands the compiler: a spec, a tokenizer, a template and tensors.

Tensor names are GGUF's (``token_embd.weight``, ``blk.{i}.attn_q.weight``, ...) whatever the source,
and shapes are numpy order: a linear weight is ``(out_features, in_features)``.
Sources return Q/K rows in the half-split ("NeoX") RoPE layout; GGUF's llama files store them
interleaved, so the GGUF source undoes that permutation at load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from goinfer.artifacts.manifest import Embedding, ModelSpec, Tokens


@dataclass(frozen=True)
class SourceTensor:
    name: str
    shape: tuple[int, ...]  # numpy order
    source_type: str  # the stored encoding: "F32", "F16", "Q4_K", ...
    bits: float  # bits per weight of that encoding (int4mix keeps >= 5 bits as int8)
    load: Callable[[], np.ndarray]  # dequantized float32 of `shape`, read lazily from the mmap
    # The stored blocks as (rows, bytes per row) uint8, read-only, rows in `load`'s order: what
    # the gguf scheme transcodes exactly. None where the source has no blocks (float tensors).
    raw: Callable[[], np.ndarray] | None = None


@dataclass(frozen=True)
class Checkpoint:
    spec: ModelSpec
    tokens: Tokens  # BOS and the ids generation stops at
    tokenizer_json: str  # a `tokenizers` Tokenizer serialized to JSON
    chat_template: str  # jinja2 source
    chat_template_origin: str  # "checkpoint" or "family default: <why>"
    tensors: Mapping[str, SourceTensor]
    source: str  # the path or reference the user gave
    sha256: str  # of the checkpoint file(s)
    embedding: Embedding | None = None  # an encoder's output; None for a decoder


class SourceError(ValueError):
    """A checkpoint that cannot be read: the message says what is wrong, in one line."""
