"""The Relax graph's TVM pieces: exporting an nn.Module, the paged KV cache with TVM's CPU attention
kernels, and attention on a fused qkv. Written against TVM 0.27.
"""

from __future__ import annotations

import functools
from typing import Any

import tvm
from goinfer.artifacts.manifest import ModelSpec
from tvm import relax, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.core import _attribute_finder
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target

__all__ = [
    "PagedKVCache",
    "attention_with_fused_qkv",
    "export",
    "kv_cache_type",
    "modules_of_type",
    "paged_kv_cache",
]


def modules_of_type(root: nn.Module, cls: type) -> list[tuple[str, Any]]:
    """(dotted name, module) for every sub-module of `root` that is an instance of `cls`."""
    return list(_attribute_finder(root, "", condition_yield=lambda x: isinstance(x, cls)))


def export(model: nn.Module, spec: nn.spec.ModuleSpec) -> tuple[tvm.IRModule, list[tuple[str, nn.Parameter]]]:
    mod, params = model.export_tvm(spec=spec)
    return mod, params


def kv_window(spec: ModelSpec) -> int:
    """The window the cache's sliding-layer kernels are built for (unused without sliding layers)."""
    return spec.sliding_window or 1024


def paged_kv_cache(
    spec: ModelSpec,
    target: Target,
    max_batch_size: tirx.Var,
    max_total_seq_len: tirx.Var,
    prefill_chunk_size: tirx.Var,
    page_size: tirx.Var,
    dtype: str,
) -> PagedKVCache:
    """TVM's paged KV cache with its CPU (TIR) attention kernels, its pages in `dtype` ("float16"
    or "float32"); the cache also takes q/k/v and gives the attention output in it, so each
    layer's `attention_with_fused_qkv` casts to and from it.

    RoPE is applied by the model itself (RopeMode.NONE), since gemma3 needs two bases and QK-norm
    before rotation; the cache only stores and attends.
    """
    kinds = ["mha_sliding" if w else "mha" for w in spec.sliding_layers] or "mha"
    if "mha" not in kinds:
        # TVM's cache allocates its q/k/v staging buffers only where some kind is plain "mha"
        # (paged_kv_cache.cc), so a model windowed at every layer (Mistral, Phi-3) would fail its
        # first forward. A kind past the last layer makes it allocate them and names no layer:
        # the cache has pages for num_hidden_layers layers only.
        kinds = [*kinds, "mha"]
    return TIRPagedKVCache(
        attn_kind=kinds,
        max_batch_size=max_batch_size,
        max_total_seq_len=max_total_seq_len,
        prefill_chunk_size=prefill_chunk_size,
        page_size=page_size,
        support_sliding_window=0,
        layer_partition=relax.ShapeExpr([0, spec.num_layers]),
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        qk_head_dim=spec.head_dim,
        v_head_dim=spec.head_dim,
        mla_original_qk_head_dim=0,
        mla_original_v_head_dim=0,
        rope_mode=RopeMode.NONE,
        rope_scale=1,
        rope_theta=int(spec.rope_theta),
        rope_scaling={},
        rope_ext_factors=tirx.IntImm("int64", 0),
        rotary_dim=spec.head_dim,
        enable_disaggregation=False,
        dtype=dtype,
        target=target,
        layer_sliding_window_size=kv_window(spec),
    )


class _TypedKVCache(PagedKVCache):
    """The cache as an entry point's argument, knowing the dtype it was created with."""

    kv_dtype: str = "float32"


@functools.cache
def kv_cache_type(dtype: str) -> type[PagedKVCache]:
    """The object type of an entry point's cache argument (`nn.spec.Object(object_type=...)`)
    for a cache created in `dtype`: each layer's `attention_with_fused_qkv` reads the dtype off
    the argument, so it needs no parameter of its own (and cannot disagree with the cache)."""
    return type(f"PagedKVCache_{dtype}", (_TypedKVCache,), {"kv_dtype": dtype})


def attention_with_fused_qkv(
    kv: PagedKVCache, layer: int, qkv: nn.Tensor, heads: int, sm_scale: float
) -> nn.Tensor:
    """The cache's attention for one layer on a fused qkv of (tokens, q + k + v heads, dim),
    returning (tokens, heads, dim) in qkv's dtype. `PagedKVCache.attention_with_fused_qkv` takes
    and returns (batch, tokens, heads, dim) and views to and from the 3-D form the builtin works
    on: two views a decode layer, each a VM instruction and an object (one sequence here: batch 1).

    The builtin takes qkv and gives the output in the cache's dtype (`kv_cache_type`; float32 for
    an untyped cache): in another, qkv is cast to it before (fused into the RoPE kernel) and the
    output back after (a small kernel of its own: the output projection takes float32)."""
    t, _, d = qkv.shape
    dtype = getattr(kv, "kv_dtype", "float32")
    fused = qkv if qkv.dtype == dtype else qkv.astype(dtype)
    out = nn.Tensor(
        _expr=relax.BlockBuilder.current().emit(
            relax.call_dps_packed(
                "vm.builtin.attention_kv_cache_attention_with_fused_qkv",
                [kv._expr, relax.prim_value(layer), relax.prim_value(sm_scale), fused._expr],
                out_ty=relax.TensorType((t, heads, d), dtype),
            )
        )
    )
    return out if dtype == qkv.dtype else out.astype(qkv.dtype)
