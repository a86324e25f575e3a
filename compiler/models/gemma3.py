"""gemma3: sandwich norms, QK-norm, GELU-tanh MLP, sliding-window layers between global ones.

    h = x + post_attn_norm(attn(attn_norm(x)))    q/k RMS-normed per head before RoPE
    y = h + post_ffw_norm(mlp(ffn_norm(h)))
Embeddings are scaled by sqrt(hidden); windowed layers use their own RoPE base (spec.rope_local_theta)
and the KV cache keeps only their last `sliding_window` positions. Norm weights are (1 + w); GGUF
stores them with the 1 already added, so spec.norm_weight_offset is 0 for GGUF sources.
"""

from __future__ import annotations

from collections.abc import Mapping

from goinfer.artifacts.manifest import ModelSpec
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor

from ..sources.base import SourceTensor
from .decoder import Attention
from .layers import GatedMLP, RMSNorm, RopeTables, SchemePicker


class Gemma3Layer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, pick: SchemePicker, tensors: Mapping[str, SourceTensor]):
        super().__init__()
        d, eps, off = spec.hidden_size, spec.norm_eps, spec.norm_weight_offset
        self.attn_norm = RMSNorm(d, eps, f"blk.{layer}.attn_norm.weight", off)
        self.attn = Attention(spec, layer, pick, tensors)
        self.post_attn_norm = RMSNorm(d, eps, f"blk.{layer}.post_attention_norm.weight", off)
        self.ffn_norm = RMSNorm(d, eps, f"blk.{layer}.ffn_norm.weight", off)
        self.mlp = GatedMLP(spec, layer, pick, tensors)
        self.post_ffw_norm = RMSNorm(d, eps, f"blk.{layer}.post_ffw_norm.weight", off)

    def forward(
        self, x: Tensor, delta: Tensor | None, rope_by_theta: RopeTables, kv
    ) -> tuple[Tensor, Tensor]:
        """As llama's: the stream in is x + delta, and the delta out is added by the next norm."""
        x, xn = self.attn_norm.add_then_norm(x, delta)
        h, hn = self.ffn_norm.add_then_norm(x, self.post_attn_norm(self.attn(xn, rope_by_theta, kv)))
        return h, self.post_ffw_norm(self.mlp(hn))


LAYER = Gemma3Layer
KIND = "decoder"
