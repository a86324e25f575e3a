"""llama (SmolLM2 and friends): pre-norm blocks, SwiGLU MLP, GQA, RoPE.

h = x + attn(rmsnorm(x))          blk.{i}.attn_norm, attn_{q,k,v,output}
y = h + mlp(rmsnorm(h))           blk.{i}.ffn_norm, ffn_{gate,up,down}
"""

from __future__ import annotations

from collections.abc import Mapping

from goinfer.artifacts.manifest import ModelSpec
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor

from ..sources.base import SourceTensor
from .decoder import Attention
from .layers import GatedMLP, RMSNorm, RopeTables, SchemePicker


class LlamaLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, pick: SchemePicker, tensors: Mapping[str, SourceTensor]):
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.norm_eps, f"blk.{layer}.attn_norm.weight")
        self.attn = Attention(spec, layer, pick, tensors)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.norm_eps, f"blk.{layer}.ffn_norm.weight")
        self.mlp = GatedMLP(spec, layer, pick, tensors)

    def forward(
        self, x: Tensor, delta: Tensor | None, rope_by_theta: RopeTables, kv
    ) -> tuple[Tensor, Tensor]:
        """The stream in is x + delta (delta: the last layer's MLP output, added here with the norm
        in one kernel); returns the stream and the delta to add to it, the same way."""
        x, xn = self.attn_norm.add_then_norm(x, delta)
        h, hn = self.ffn_norm.add_then_norm(x, self.attn(xn, rope_by_theta, kv))
        return h, self.mlp(hn)


LAYER = LlamaLayer
KIND = "decoder"
