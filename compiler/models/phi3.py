"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): llama's block over fused weights.

q, k and v are one tensor (attn_qkv / qkv_proj), gate and up another (ffn_up / gate_up_proj, the
gate's rows first); RoPE turns only the first `spec.rope_dims` dims of each head (partial rotary),
maybe with longrope's factors; a sliding window covers every layer where the config sets one. The
attention and the MLP read the fused tensors where the checkpoint has them, so the layer is llama's.
"""

from __future__ import annotations

from .llama import LlamaLayer

LAYER = LlamaLayer
KIND = "decoder"
