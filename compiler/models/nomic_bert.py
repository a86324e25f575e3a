"""nomic_bert (nomic-embed-text, CodeRankEmbed): post-norm blocks, rotary positions, SwiGLU, no
biases.

    h = LayerNorm(x + o(attn(rope(qkv(x)))))   blk.{i}.attn_{qkv,output}, attn_output_norm
    y = LayerNorm(h + down(up(h) * silu(gate(h))))   blk.{i}.ffn_{up,gate,down}, layer_output_norm
nomic's fc11 is up and fc12 the gate (its `y * act(gate)`), so the MLP is llama's GatedMLP.
"""

from __future__ import annotations

from collections.abc import Mapping

from goinfer.artifacts.manifest import ModelSpec
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor

from ..sources.base import SourceTensor
from .encoder import SelfAttention
from .layers import GatedMLP, LayerNorm, SchemePicker


class NomicBertLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, pick: SchemePicker, tensors: Mapping[str, SourceTensor]):
        super().__init__()
        d, blk = spec.hidden_size, f"blk.{layer}"
        self.attn = SelfAttention(spec, layer, pick, tensors)
        self.attn_norm = LayerNorm(d, spec.norm_eps, f"{blk}.attn_output_norm")
        self.mlp = GatedMLP(spec, layer, pick, tensors)
        self.out_norm = LayerNorm(d, spec.norm_eps, f"{blk}.layer_output_norm")

    def forward(self, x: Tensor, rope_table, offsets: Tensor) -> Tensor:
        x = self.attn_norm.add_then_norm(x, self.attn(x, rope_table, offsets))
        return self.out_norm.add_then_norm(x, self.mlp(x))


LAYER = NomicBertLayer
KIND = "encoder"
