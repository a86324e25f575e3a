"""The paged KV cache's per-layer copies, in place of TVM's stock CPU ones: splitting the fused QKV
projection into q, k and v, and appending k and v to the cache's pages.

The stock kernels are elementwise over (token, head, element) and our ParallelFallback schedule ran
each as a parallel loop, so a decode step woke the thread pool twice a layer to copy a few hundred
floats. The stock append also keeps the token's slot in a scalar that, inside the parallel loop,
became a workspace allocation and free per element: ~5,000 a token for SmolLM2, 2-4% of a decode
step on the main thread (perf, 2 threads).

These run a token per iteration: on the calling thread while the copy is small (a decode step, a
short chunk), over tokens in parallel past that, each row a vector copy. Same signatures as the
stock ones, which the cache's C++ side calls by position.

Both take the cache's dtype (float32 or float16): the fused qkv, q, k, v and the pages all come in
it (the model casts qkv before the cache's attention), so each is a copy with no conversion.
"""

from __future__ import annotations

import tvm
from goinfer.artifacts.manifest import PAGE_SIZE
from tvm import tirx
from tvm.script import tirx as T

from ..tvm.schedules import SERIAL_MAX
from .attention import check_dtype, stock_dtype, swap_stock

# The stock kernels' names in the module TIRPagedKVCache builds (their global symbols, TVM 0.27).
APPEND = "tir_kv_cache_transpose_append"
SPLIT = "fused_rope"


def transpose_append(h_kv: int, d: int, dtype: str = "float32") -> tirx.PrimFunc:
    """k and v of each token (ntoken, h_kv, d) into its slot of the pages; position -1 skips."""
    check_dtype(dtype)
    serial_tokens = max(1, SERIAL_MAX // (2 * h_kv * d))

    @T.macro
    def append(pages, k_data, v_data, position_map, t):
        pos = T.Bind(position_map[t])
        if pos != -1:
            page = T.Bind(pos // PAGE_SIZE)
            slot = T.Bind(pos % PAGE_SIZE)
            for h in T.serial(h_kv):
                for f in T.vectorized(d):
                    pages[page, 0, h, slot, f] = k_data[t, h, f]
                for f in T.vectorized(d):
                    pages[page, 1, h, slot, f] = v_data[t, h, f]

    @T.prim_func(private=True)
    def kv_transpose_append(
        var_pages: T.handle, var_k_data: T.handle, var_v_data: T.handle, var_position_map: T.handle
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        ntoken, num_pages, pages_off = T.int64(), T.int64(), T.int64()
        pos_off = T.int32()
        page_shape = (num_pages, 2, h_kv, PAGE_SIZE, d)
        pages = T.match_buffer(var_pages, page_shape, dtype, elem_offset=pages_off)
        k_data = T.match_buffer(var_k_data, (ntoken, h_kv, d), dtype)
        v_data = T.match_buffer(var_v_data, (ntoken, h_kv, d), dtype)
        position_map = T.match_buffer(var_position_map, (ntoken,), "int32", elem_offset=pos_off)
        if ntoken <= serial_tokens:
            for t in T.serial(ntoken):
                append(pages, k_data, v_data, position_map, t)
        else:
            for t in T.parallel(ntoken):
                append(pages, k_data, v_data, position_map, t)

    return kv_transpose_append


def split_qkv(h_q: int, h_kv: int, d: int, dtype: str = "float32") -> tirx.PrimFunc:
    """The fused (seq_len, h_q + 2 h_kv, d) projection into q, k and v. RoPE is the model's (the
    cache is built with RopeMode.NONE), so `apply_rope` must be 0, as the attention kernels check."""
    check_dtype(dtype)
    serial_tokens = max(1, SERIAL_MAX // ((h_q + 2 * h_kv) * d))

    @T.macro
    def split(qkv, q, k, v, s):
        for h in T.serial(h_q):
            for f in T.vectorized(d):
                q[s, h, f] = qkv[s, h, f]
        for h in T.serial(h_kv):
            for f in T.vectorized(d):
                k[s, h, f] = qkv[s, h_q + h, f]
            for f in T.vectorized(d):
                v[s, h, f] = qkv[s, h_q + h_kv + h, f]

    @T.prim_func(private=True)
    def kv_split_qkv(
        var_qkv: T.handle,
        var_position_map: T.handle,
        var_q: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        apply_rope: T.int64,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        seq_len, pos_off = T.int32(), T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, h_q + 2 * h_kv, d), dtype)
        q = T.match_buffer(var_q, (seq_len, h_q, d), dtype)
        k = T.match_buffer(var_k, (seq_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (seq_len, h_kv, d), dtype)
        T.match_buffer(var_position_map, (seq_len,), "int32", elem_offset=pos_off)
        assert apply_rope == 0, "goinfer's KV cache expects RoPE applied by the model"
        if seq_len <= serial_tokens:
            for s in T.serial(seq_len):
                split(qkv, q, k, v, s)
        else:
            for s in T.parallel(seq_len):
                split(qkv, q, k, v, s)

    return kv_split_qkv


def use_ours(mod: tvm.IRModule, h_kv: int, h_q: int, d: int) -> tvm.IRModule:
    """Swap the stock split and append kernels in an exported module for ours, in the dtype the
    cache's stock append takes."""
    dt = stock_dtype(mod, APPEND, 0)  # its pages
    mine = {APPEND: lambda: transpose_append(h_kv, d, dt), SPLIT: lambda: split_qkv(h_q, h_kv, d, dt)}
    return swap_stock(mod, mine)
