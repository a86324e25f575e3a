"""bert (all-MiniLM-L6-v2, bge-small-en-v1.5, e5-small): post-norm blocks, GELU MLP, biases.

    h = LayerNorm(x + o(attn(x)))      blk.{i}.attn_{q,k,v,output}, attn_output_norm
    y = LayerNorm(h + down(gelu(up(h))))   blk.{i}.ffn_{up,down}, layer_output_norm
Positions are learned (models/encoder.py adds them to the token embeddings); GELU is erf's.
"""

from __future__ import annotations

from collections.abc import Mapping

from goinfer.artifacts.manifest import ModelSpec
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..kernels import encoder_ops
from ..sources.base import SourceTensor
from .encoder import SelfAttention
from .layers import Bias, LayerNorm, QLinear, SchemePicker


class BertLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, pick: SchemePicker, tensors: Mapping[str, SourceTensor]):
        super().__init__()
        d, f, blk = spec.hidden_size, spec.intermediate_size, f"blk.{layer}"
        self.attn = SelfAttention(spec, layer, pick, tensors)
        self.attn_norm = LayerNorm(d, spec.norm_eps, f"{blk}.attn_output_norm")
        self.up = QLinear(pick([tensors[f"{blk}.ffn_up.weight"]]), d, f, (f"{blk}.ffn_up.weight",))
        self.up_bias = Bias(f, (f"{blk}.ffn_up.bias",))
        self.down = QLinear(pick([tensors[f"{blk}.ffn_down.weight"]]), f, d, (f"{blk}.ffn_down.weight",))
        self.down_bias = Bias(d, (f"{blk}.ffn_down.bias",))
        self.out_norm = LayerNorm(d, spec.norm_eps, f"{blk}.layer_output_norm")

    def forward(self, x: Tensor, rope_table, offsets: Tensor) -> Tensor:
        x = self.attn_norm.add_then_norm(x, self.attn(x, rope_table, offsets), self.attn.o_bias)
        up = self.up(x)
        h = op.tensor_ir_op(
            encoder_ops.bias_gelu(self.up.out_features), "bias_gelu", [up, self.up_bias.weight],
            out=Tensor.placeholder(up.shape, "float32"),
        )  # fmt: skip
        return self.out_norm.add_then_norm(x, self.down(h), self.down_bias)


LAYER = BertLayer
KIND = "encoder"
