"""mistral (Mistral 7B, Ministral, Mistral Nemo): llama's block, with a sliding window over every
layer where the config sets one (`spec.sliding_window`: each query sees itself and the W - 1 keys
before it, and the KV cache keeps only those).

Mistral GGUFs say architecture "llama" and carry no window; Hugging Face folders say "mistral".
"""

from __future__ import annotations

from .llama import LlamaLayer

LAYER = LlamaLayer
KIND = "decoder"
