"""qwen2 (Qwen2.5, the default model): llama's block with biases on the q/k/v projections.

The bias comes from `spec.attention_bias`, so the layer itself is llama's.
"""

from __future__ import annotations

from .llama import LlamaLayer

LAYER = LlamaLayer
KIND = "decoder"
