"""ModelSpec: everything the lowering needs to know about a checkpoint, and nothing else.

A source (GGUF today, safetensors later) fills one of these in; a model family reads it.
It is frozen and JSON-round-trippable, so it goes into the bundle manifest verbatim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # "none" | "linear" | "yarn"
    factor: float = 1.0
    original_context: int = 0


@dataclass(frozen=True)
class ModelSpec:
    family: str  # registry key of compiler/models: "llama" | "qwen2" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_embeddings: bool = False
    attention_bias: bool = False  # qwen2: q/k/v projections carry a bias
    # Tokens.
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()  # EOS and EOT: generation stops at any of them
    add_bos: bool = False
    # Family specifics (defaults are llama's).
    activation: str = "silu"  # "silu" | "gelu_tanh" (gated MLP either way)
    embed_scale: float = 1.0  # gemma: sqrt(hidden_size)
    norm_weight_offset: float = 0.0  # gemma RMSNorm uses (offset + w); GGUF already folds the 1 in
    qk_norm: bool = False  # gemma3: RMSNorm over each q and k head before RoPE
    post_norms: bool = False  # gemma3: norms after attention and after the MLP too
    attn_scale: float = 0.0  # softmax scale; 0 means head_dim ** -0.5 (gemma3: query_pre_attn_scalar ** -0.5)
    sliding_window: int = 0  # 0: no sliding-window layers
    sliding_layers: tuple[bool, ...] = ()  # per layer: True where attention is windowed
    rope_local_theta: float = 0.0  # gemma3: the rope base of the sliding-window layers

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def layer_rope_theta(self, layer: int) -> float:
        if self.sliding_layers and self.sliding_layers[layer] and self.rope_local_theta:
            return self.rope_local_theta
        return self.rope_theta

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
        d["eos_ids"] = tuple(d.get("eos_ids", ()))
        d["sliding_layers"] = tuple(d.get("sliding_layers", ()))
        return cls(**d)
