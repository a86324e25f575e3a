"""The encoder skeleton the embedding families share: token embeddings (+ learned positions),
a LayerNorm, a stack of family layers, then pooling into one L2-normalized vector per input.

The one entry point, `embed`, takes several inputs packed one after another (no padding): their
token ids, each token's position in its input, and the inputs' offsets; every layer's matmuls run
over all tokens at once, attention and pooling stay inside each input (kernels/attention.packed,
kernels/pooling). A family supplies its layer class: `forward(x, rope_table, offsets) -> x`, with
rope_table None where the family has learned positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import tvm
from goinfer.artifacts.manifest import ModelSpec
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..kernels import attention, encoder_ops, pooling
from ..quant import f32
from ..sources.base import SourceTensor
from ..tvm import graph, targets
from .layers import Bias, LayerNorm, QLinear, SchemePicker, Weighted, fused_linear, rope, rope_tables


def _gather(table: te.Tensor, ids: te.Tensor) -> te.Tensor:
    return te.compute((ids.shape[0], table.shape[1]), lambda t, c: table[ids[t], c], name="rows")


class Table(Weighted):
    """A float32 table read a row per token (embeddings are gathered, not multiplied: kept exact).
    `fold` adds the first row of another tensor to every row at pack time: the token-type
    embedding of type 0, which every token of an embedding request has (HF adds it to the word
    embedding first, so the folded sum is the same float)."""

    def __init__(self, rows: int, width: int, source: str, fold: str | None = None):
        super().__init__()
        self.sources = (source,) if fold is None else (source, fold)
        self.weight = nn.Parameter((rows, width), "float32")

    def pack(self, tensors: Mapping[str, SourceTensor]) -> dict[str, np.ndarray]:
        w = tensors[self.sources[0]].load().astype(np.float32)
        if len(self.sources) > 1:
            w = w + tensors[self.sources[1]].load()[0].astype(np.float32)
        return {"weight": np.ascontiguousarray(w)}

    def take(self, ids: Tensor) -> Tensor:
        return op.tensor_expr_op(_gather, "take_rows", [self.weight, ids])


class SelfAttention(nn.Module):
    """Bidirectional attention inside each packed input: q, k, v from one fused matmul (the
    checkpoint's three weights, or its one `attn_qkv`), RoPE where the family has no learned
    positions, the output projection; biases where the spec has them."""

    def __init__(self, spec: ModelSpec, layer: int, pick: SchemePicker, tensors: Mapping[str, SourceTensor]):
        super().__init__()
        self.spec, d = spec, spec.hidden_size
        blk = f"blk.{layer}"
        fused = f"{blk}.attn_qkv.weight"
        names = (fused,) if fused in tensors else tuple(f"{blk}.attn_{n}.weight" for n in ("q", "k", "v"))
        self.qkv = fused_linear(pick, tensors, d, 3 * d, names)
        self.o = QLinear(pick([tensors[f"{blk}.attn_output.weight"]]), d, d, (f"{blk}.attn_output.weight",))
        self.qkv_bias = self.o_bias = None
        if spec.attention_bias:
            self.qkv_bias = Bias(3 * d, tuple(f"{blk}.attn_{n}.bias" for n in ("q", "k", "v")))
            self.o_bias = Bias(d, (f"{blk}.attn_output.bias",))

    def forward(self, x: Tensor, rope_table, offsets: Tensor) -> Tensor:
        """The output projection of attention, its bias (`o_bias`) not yet added: the norm after
        adds it with the residual (LayerNorm.add_then_norm)."""
        s = self.spec
        h, d, t = s.num_heads, s.head_dim, x.shape[0]
        bias = [self.qkv_bias.weight] if self.qkv_bias is not None else []
        third = Tensor.placeholder((t, h, d), "float32")
        q, k, v = op.tensor_ir_op(
            encoder_ops.split_qkv(h, d, bool(bias)),
            "split_qkv",
            [self.qkv(x), *bias],
            out=[third, third, third],
        )
        if rope_table is not None:
            q, k = rope(q, rope_table, h), rope(k, rope_table, h)
        o, _lse = op.tensor_ir_op(
            attention.packed(h, d, s.softmax_scale),
            "attention_packed",
            [q, k, v, offsets],
            out=[third, Tensor.placeholder((t, h), "float32")],
        )
        return self.o(op.reshape(o, (t, h * d)))


class Encoder(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer_cls: type[nn.Module],
        pick: SchemePicker,
        tensors: Mapping[str, SourceTensor],
        target: targets.Target,
        pooling_mode: str,
    ):
        super().__init__()
        self.spec, self.target, self.pooling = spec, target, pooling_mode
        self.graph_variant = f"pooling:{pooling_mode}"  # beside the spec, what the compile cache keys on
        d = spec.hidden_size
        self.tokens = Table(spec.vocab_size, d, "token_embd.weight", fold="token_types.weight")
        self.positions = (
            Table(spec.context_length, d, "position_embd.weight") if spec.learned_positions else None
        )
        self.embed_norm = LayerNorm(d, spec.norm_eps, "token_embd_norm")
        self.layers = nn.ModuleList([layer_cls(spec, i, pick, tensors) for i in range(spec.num_layers)])

    def embed(self, input_ids: Tensor, positions: Tensor, offsets: Tensor) -> Tensor:
        """Inputs packed: ids and positions (n,), input b the tokens [offsets[b], offsets[b+1]).
        Returns (b, hidden): each input's pooled, L2-normalized vector."""
        s = self.spec
        x = self.tokens.take(input_ids)
        if self.positions is not None:
            x = self.embed_norm.add_then_norm(x, self.positions.take(positions))
        else:
            x = self.embed_norm(x)
        table = None
        if not s.learned_positions:
            table = rope_tables(positions, {s.rope_theta}, s.head_dim)[s.rope_theta]
        for layer in self.layers:
            x = layer(x, table, offsets)
        batch = offsets.shape[0] - 1
        return op.tensor_ir_op(
            pooling.kernel(s.hidden_size, self.pooling),
            f"pool_{self.pooling}",
            [x, offsets],
            out=Tensor.placeholder((batch, s.hidden_size), "float32"),
        )

    def exported(
        self, target: targets.Target | None = None
    ) -> tuple[tvm.IRModule, list[tuple[str, nn.Parameter]]]:
        """The Relax module for the CPU and its parameters (encoders build for llvm only)."""
        if target is not None and target.kind.name != "llvm":
            raise ValueError(f"encoders build for the CPU only, not {target.kind.name}")
        return graph.export(self, self.export_spec())

    def export_spec(self) -> nn.spec.ModuleSpec:
        packed = {"param_mode": "packed", "effect_mode": "none"}
        n = tirx.Var("n", "int64")
        return nn.spec.ModuleSpec.from_raw(
            {
                "embed": {
                    "input_ids": nn.spec.Tensor([n], "int32"),
                    "positions": nn.spec.Tensor([n], "int32"),
                    "offsets": nn.spec.Tensor(["edges"], "int32"),
                    "$": packed,
                }
            },
            self,
        )


def build_model(
    spec: ModelSpec,
    layer_cls: type,
    pick: SchemePicker,
    tensors: Mapping[str, SourceTensor],
    target: dict[str, Any],
    kv_dtype: str = "",
    pooling: str = "mean",
) -> Encoder:
    """The encoder of `layer_cls` blocks, each weight in the scheme `pick` gives it, pooled by
    `pooling` (manifest.POOLINGS). `kv_dtype` is the decoders' and unused here."""

    def many_tokens(parts):  # every call has whole inputs: f32 takes its GEMM, not the GEMV
        scheme = pick(parts)
        return f32.MANY_TOKENS if scheme is f32 else scheme

    return Encoder(spec, layer_cls, many_tokens, tensors, targets.make_target(target), pooling)
