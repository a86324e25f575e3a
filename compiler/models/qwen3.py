"""qwen3 (dense Qwen3): llama's block with an RMSNorm over each q and k head before RoPE, and no
q/k/v biases.

The per-head norms come from `spec.qk_norm` (the attention builds them, as gemma3's), so the layer
itself is llama's.
"""

from __future__ import annotations

from .llama import LlamaLayer

LAYER = LlamaLayer
KIND = "decoder"
