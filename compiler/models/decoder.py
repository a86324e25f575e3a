"""The decoder-only skeleton the families share: attention over the paged KV cache, and the
exported entry points (prefill_all / decode / batch_prefill / batch_decode /
create_kv_cache).

A family supplies its layer class; behaviour that differs between families comes from ModelSpec
flags (bias, qk-norm, sliding layers), never from the family's name. A layer's forward takes the
residual stream as (x, delta), delta not yet added, and returns it the same way, so each residual
add runs inside the norm after it (`RMSNorm.add_then_norm`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tvm
from goinfer.artifacts.manifest import ModelSpec
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..kernels import attention, kv_append
from ..sources.base import SourceTensor
from ..tvm import graph, targets
from .layers import (
    Bias,
    QLinear,
    RMSNorm,
    RopeFrequencies,
    RopeTables,
    SchemePicker,
    fused_linear,
    gpu_graph,
    rope,
    rope_tables,
)

# The RoPE scalings whose frequencies come from a table the build computes (RopeFrequencies).
_TABLE_SCALINGS = ("llama3", "yarn", "longrope")


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, pick: SchemePicker, tensors: Mapping[str, SourceTensor]):
        super().__init__()
        self.layer, self.spec = layer, spec
        h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        fused = f"blk.{layer}.attn_qkv.weight"  # phi3 stores q, k and v as one tensor
        names = (fused,) if fused in tensors else tuple(f"blk.{layer}.attn_{n}.weight" for n in "qkv")
        self.qkv = fused_linear(pick, tensors, spec.hidden_size, (h + 2 * hkv) * d, names)
        self.qkv_bias = (
            Bias((h + 2 * hkv) * d, tuple(f"blk.{layer}.attn_{n}.bias" for n in ("q", "k", "v")))
            if spec.attention_bias
            else None
        )
        out = f"blk.{layer}.attn_output.weight"
        self.o = QLinear(pick([tensors[out]]), h * d, spec.hidden_size, (out,))
        if spec.qk_norm:
            off = spec.norm_weight_offset
            self.q_norm = RMSNorm(d, spec.norm_eps, f"blk.{layer}.attn_q_norm.weight", off)
            self.k_norm = RMSNorm(d, spec.norm_eps, f"blk.{layer}.attn_k_norm.weight", off)

    def forward(self, x: Tensor, rope_by_theta: RopeTables, kv: graph.PagedKVCache) -> Tensor:
        s = self.spec
        h, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        t = x.shape[0]
        qkv = self.qkv(x)
        if self.qkv_bias is not None:
            qkv = self.qkv_bias(qkv)
        qkv = op.reshape(qkv, (t, h + 2 * hkv, d))
        if s.qk_norm:
            q, k, v = op.split(qkv, [h, h + hkv], axis=1)
            qkv = op.concat([self.q_norm(q), self.k_norm(k), v], dim=1)
        rot = s.rope_dims if s.rope_dims != d else 0
        qkv = rope(qkv, rope_by_theta[s.layer_rope_theta(self.layer)], h + hkv, rot)
        o = graph.attention_with_fused_qkv(kv, self.layer, qkv, h, s.softmax_scale)
        return self.o(op.reshape(o, (t, h * d)))


def _linear_factor(spec: ModelSpec) -> float:
    return spec.rope_scaling.factor if spec.rope_scaling.kind == "linear" else 1.0


class CausalLM(nn.Module):
    """Token embedding, a stack of family layers, final norm, LM head (maybe tied)."""

    def __init__(
        self,
        spec: ModelSpec,
        layer_cls: type[nn.Module],
        pick: SchemePicker,
        tensors: Mapping[str, SourceTensor],
        target: targets.Target,
        kv_dtype: str,
    ):
        super().__init__()
        self.spec, self.target, self.kv_dtype = spec, target, kv_dtype
        self.graph_variant = kv_dtype  # beside the spec, what the compile cache keys on
        emb = "token_embd.weight"
        self.embed_tokens = QLinear(pick([tensors[emb]]), spec.hidden_size, spec.vocab_size, (emb,))
        self.layers = nn.ModuleList([layer_cls(spec, i, pick, tensors) for i in range(spec.num_layers)])
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps, "output_norm.weight", spec.norm_weight_offset)
        scaled = spec.rope_scaling.kind in _TABLE_SCALINGS
        self.rope_freqs = RopeFrequencies(spec) if scaled else None
        # A tied head reuses embed_tokens; it is not stored twice (nor registered twice).
        self.lm_head = (
            None
            if spec.tie_embeddings
            else QLinear(
                pick([tensors["output.weight"]]), spec.hidden_size, spec.vocab_size, ("output.weight",)
            )
        )

    def _logits(self, h: Tensor) -> Tensor:
        """(tokens, hidden) -> (1, tokens, vocab), the shape the entry points return."""
        logits = (self.lm_head or self.embed_tokens)(h)
        return op.reshape(logits, (1, h.shape[0], self.spec.vocab_size))

    def _embed(self, input_ids: Tensor) -> Tensor:
        """(seq_len,) token ids -> (seq_len, hidden)."""
        x = self.embed_tokens.take(input_ids)
        return x * self.spec.embed_scale if self.spec.embed_scale != 1.0 else x

    # The residual stream is (tokens, hidden): the layout the matmuls take, so no view is made
    # around each one (a decode layer made 7-8 such views, each a VM instruction and an object).
    def _body(self, x: Tensor, kv: graph.PagedKVCache) -> Tensor:
        s = self.spec
        positions = kv.get_query_positions(x.shape[0])
        thetas = {s.layer_rope_theta(i) for i in range(s.num_layers)}
        if self.rope_freqs is not None:  # one theta: the sources refuse these scalings beside two
            tables = {theta: self.rope_freqs.tables(positions) for theta in thetas}
        else:
            tables = rope_tables(positions, thetas, s.rotary_dims, _linear_factor(s))
        # Each layer hands back its last residual term unadded: the next norm adds it (see
        # RMSNorm.add_then_norm), and the final norm adds the last layer's.
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, tables, kv)
        return self.norm.add_then_norm(x, delta)[1]

    # -- exported entry points -------------------------------------------------------------
    # Each takes token ids and returns only the logits (the cache is updated in place). A separate
    # embed call and a reshape cost a decode step 20 + 31 us on the cold cache a step leaves
    # behind, and handing the cache back a tuple and a wrapper more (SmolLM2, measured: 3% a token).
    def prefill_all(self, input_ids: Tensor, kv: graph.PagedKVCache):
        """Logits of every prompt position: (1, seq_len, vocab) (prompt log-probs, tests)."""
        return self._logits(self._body(self._embed(input_ids), kv))

    def decode(self, input_ids: Tensor, kv: graph.PagedKVCache):
        """One new token of one sequence: (1,) -> (1, 1, vocab)."""
        return self._logits(self._body(self._embed(input_ids), kv))

    def batch_prefill(self, input_ids: Tensor, logit_positions: Tensor, kv: graph.PagedKVCache):
        """Several sequences' tokens packed in `begin_forward`'s order: (n,) -> (1, b, vocab), the
        logits at the b packed positions asked for (each sequence's last token)."""
        h = self._body(self._embed(input_ids), kv)

        def rows(x: te.Tensor, at: te.Tensor) -> te.Tensor:
            return te.compute((at.shape[0], x.shape[1]), lambda i, k: x[at[i], k], name="logit_rows")

        return self._logits(op.tensor_expr_op(rows, "logit_rows", [h, logit_positions]))

    def batch_decode(self, input_ids: Tensor, kv: graph.PagedKVCache):
        """One new token for each of b sequences: (b,) -> (1, b, vocab). Every weight is read once
        for all b rows (the quantized kernels take their m > 1 paths)."""
        return self._logits(self._body(self._embed(input_ids), kv))

    def create_kv_cache(
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
    ) -> graph.PagedKVCache:
        return graph.paged_kv_cache(
            self.spec,
            self.target,
            max_batch_size,
            max_total_seq_len,
            prefill_chunk_size,
            page_size,
            self.kv_dtype,
        )

    def exported(
        self, target: targets.Target | None = None
    ) -> tuple[tvm.IRModule, list[tuple[str, nn.Parameter]]]:
        """The Relax module for `target`'s kind (default: the CPU's) and its parameters, exported
        now (the build keeps it for every tier it compiles). On the CPU our attention and KV-copy
        kernels replace the cache's stock ones; a GPU graph keeps the stock GPU kernels the cache
        generates for its target."""
        s = self.spec
        if target is None or target.kind.name == "llvm":
            mod, params = graph.export(self, self.export_spec())
            mod = attention.use_ours(mod, s.num_kv_heads, s.num_heads, s.head_dim, graph.kv_window(s))
            return kv_append.use_ours(mod, s.num_kv_heads, s.num_heads, s.head_dim), params
        cpu, self.target = self.target, target  # the cache generates kernels for it
        try:
            with gpu_graph():
                return graph.export(self, self.export_spec())
        finally:
            self.target = cpu

    def export_spec(self) -> nn.spec.ModuleSpec:
        kv = nn.spec.Object(object_type=graph.kv_cache_type(self.kv_dtype))
        packed = {"param_mode": "packed", "effect_mode": "none"}
        return nn.spec.ModuleSpec.from_raw(
            {
                "prefill_all": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "kv": kv, "$": packed},
                # One sequence, static shapes: the VM plans every buffer at build time, and the
                # small elementwise kernels run serial (schedules.SmallSerial).
                "decode": {"input_ids": nn.spec.Tensor([1], "int32"), "kv": kv, "$": packed},
                "batch_prefill": {
                    "input_ids": nn.spec.Tensor(["seq_len"], "int32"),
                    "logit_positions": nn.spec.Tensor(["batch"], "int32"),
                    "kv": kv,
                    "$": packed,
                },
                "batch_decode": {"input_ids": nn.spec.Tensor(["batch"], "int32"), "kv": kv, "$": packed},
                "create_kv_cache": {
                    "max_batch_size": int,
                    "max_total_seq_len": int,
                    "prefill_chunk_size": int,
                    "page_size": int,
                    "$": {"param_mode": "none", "effect_mode": "none"},
                },
            },
            self,
        )


def build_model(
    spec: ModelSpec,
    layer_cls: type,
    pick: SchemePicker,
    tensors: Mapping[str, SourceTensor],
    target: dict[str, Any],
    kv_dtype: str,
) -> CausalLM:
    """The causal LM of `layer_cls` blocks, each weight in the scheme `pick` gives it, over a KV
    cache in `kv_dtype`."""
    return CausalLM(spec, layer_cls, pick, tensors, targets.make_target(target), kv_dtype)
