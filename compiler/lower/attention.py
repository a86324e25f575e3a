"""CPU attention kernels for TVM's paged KV cache, in place of its stock CPU ones.

TVM's CPU kernels (relax.frontend.nn.llm) are scalar and serial: one thread walks every query,
head and key. Measured on Qwen-0.5B, 2 threads, a 512-token prompt spent 5.1 s of 16 s in them.
These keep the stock signatures (the cache's C++ side calls them by position) and change how
they run:

1. One parallel task per (query token, head): 512 x 14 tasks for a Qwen prompt, 14 for a decode.
   Measured, Qwen-0.5B, 2 threads: a 512-token prompt's attention 5.1 s -> 1.2 s (24 layers); decode
   went from 22 to 31-35 tok/s, most of it here.
2. Keys come in blocks of KEY_BLOCK with an online softmax per block: the running output is
   rescaled once per block, not once per key, and the scores live in a small stack buffer.
3. Dot products and the weighted sum of values run as vectors over head_dim.
4. Scores are in log2 units (scaled by log2(e)) and `lse` is log2-based, as the stock kernels
   leave them for the cache's merge kernel.

The stock paged prefill (history attention in chunked prefill) also reads `scale_O[d_idx]` from a
one-element buffer, i.e. past its end; tests/test_attention_kernels.py holds ours to numpy.

Only RopeMode.NONE is supported (the models apply RoPE themselves): `rotary_mode` must be 0.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.script import tirx as T

KEY_BLOCK = 16  # keys per online-softmax step
PAGE_SIZE = 16  # the stock kernels' page size, which the cache's pages are laid out with
LOG2E = math.log2(math.e)
_MIN = -1e30  # a finite "minus infinity": exp2(_MIN - m) is 0 and never NaN

# The stock kernels' names in the module TIRPagedKVCache builds (their global symbols, TVM 0.27).
RAGGED = "batch_prefill_ragged_kv"
PREFILL = "batch_prefill_paged_kv_cpu"
PREFILL_SLIDING = "batch_prefill_paged_kv_cpu_sliding_window"
DECODE = "batch_decode_paged_kv_cpu"
DECODE_SLIDING = "batch_decode_paged_kv_cpu_sliding_window"


def _lanes(d: int) -> int:
    return next(v for v in (16, 8, 4, 2, 1) if d % v == 0)


def _attend(d: int, key_row, value_row):
    """The shared core: query `row` of qf attends to keys first .. first + n_keys - 1 and writes
    row `row` of the output and lse. `key_row(where, j)` and `value_row(where, j)` give key j's
    row in the flattened K and V buffers (the kernel's addressing; `where` carries what it needs)."""
    vl = _lanes(d)
    chunks = d // vl

    def at(c):
        return T.ramp(c * vl, 1, vl)

    def hsum(buf):
        total = buf[0]
        for lane in range(1, vl):
            total = total + buf[lane]
        return total

    @T.macro
    def attend(qf, kf, vf, of, lf, row, where, first, n_keys, scale):
        o = T.alloc_buffer((d,), "float32")
        krow = T.alloc_buffer((KEY_BLOCK,), "int32")
        vrow = T.alloc_buffer((KEY_BLOCK,), "int32")
        dot = T.alloc_buffer((vl,), "float32")
        scores = T.alloc_buffer((KEY_BLOCK,), "float32")
        state = T.alloc_buffer((3,), "float32")  # running max, running sum, block max
        for c in T.unroll(chunks):
            o[at(c)] = T.Broadcast(T.float32(0), vl)
        state[0] = T.float32(_MIN)
        state[1] = T.float32(0)
        for blk in T.serial((n_keys + KEY_BLOCK - 1) // KEY_BLOCK):
            state[2] = T.float32(_MIN)
            for jj in T.serial(KEY_BLOCK):
                j = first + T.min(blk * KEY_BLOCK + jj, n_keys - 1)  # past the end: valid, unused
                krow[jj] = key_row(where, j)
                vrow[jj] = value_row(where, j)
            for jj in T.serial(KEY_BLOCK):
                if blk * KEY_BLOCK + jj < n_keys:
                    dot[T.ramp(0, 1, vl)] = qf[row, at(0)] * kf[krow[jj], at(0)]
                    for c in T.unroll(1, chunks):
                        dot[T.ramp(0, 1, vl)] = dot[T.ramp(0, 1, vl)] + qf[row, at(c)] * kf[krow[jj], at(c)]
                    scores[jj] = hsum(dot) * scale
                    state[2] = T.max(state[2], scores[jj])
            # online softmax: fold this block into the running max/sum, rescale the output once
            m_new = T.max(state[0], state[2])
            alpha = T.exp2(state[0] - m_new)
            state[0] = m_new
            state[1] = state[1] * alpha
            for c in T.unroll(chunks):
                o[at(c)] = o[at(c)] * T.Broadcast(alpha, vl)
            for jj in T.serial(KEY_BLOCK):
                if blk * KEY_BLOCK + jj < n_keys:
                    p = T.exp2(scores[jj] - m_new)
                    state[1] = state[1] + p
                    for c in T.unroll(chunks):
                        o[at(c)] = o[at(c)] + vf[vrow[jj], at(c)] * T.Broadcast(p, vl)
        inv = T.float32(1) / T.max(state[1], T.float32(1e-30))  # no keys: output 0, not NaN
        for c in T.unroll(chunks):
            of[row, at(c)] = o[at(c)] * T.Broadcast(inv, vl)
        lf[row] = state[0] + T.log2(T.max(state[1], T.float32(1e-30)))

    return attend


def prefill_ragged(h_kv: int, h_q: int, d: int) -> tirx.PrimFunc:
    """Prompt tokens attending to themselves (causal), the stock `batch_prefill_ragged_kv`'s
    signature. K/V rows are [token, kv head]; a task's keys are one contiguous run of tokens."""
    group = h_q // h_kv

    def token_row(where, j):  # where = (first key token, head)
        return (where[0] + j) * h_kv + where[1] // group

    attend = _attend(d, token_row, token_row)

    @T.prim_func(private=True)
    def attention_prefill_ragged(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_kv_indptr: T.handle,
        var_q_rope_position: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size, qo_len, kv_len = T.int32(), T.int32(), T.int32()
        q_off, kv_off, qr_off, kr_off = T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d), "float32")
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_off)
        k = T.match_buffer(var_k, (kv_len, h_kv, d), "float32")
        v = T.match_buffer(var_v, (kv_len, h_kv, d), "float32")
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_off)
        T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=qr_off)
        T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=kr_off)
        output = T.match_buffer(var_output, (qo_len, h_q, d), "float32")
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")
        assert rotary_mode == 0, "goinfer's attention kernels expect RoPE applied by the model"
        # the same memory seen as rows of d: (token, head) -> row
        qf = T.decl_buffer((qo_len * h_q, d), "float32", data=q.data)
        kf = T.decl_buffer((kv_len * h_kv, d), "float32", data=k.data)
        vf = T.decl_buffer((kv_len * h_kv, d), "float32", data=v.data)
        of = T.decl_buffer((qo_len * h_q, d), "float32", data=output.data)
        lf = T.decl_buffer((qo_len * h_q,), "float32", data=lse.data)
        for b in T.serial(batch_size):
            for task in T.parallel((q_indptr[b + 1] - q_indptr[b]) * h_q):
                qi = task // h_q
                h = task % h_q
                n_q = q_indptr[b + 1] - q_indptr[b]
                n_kv = kv_indptr[b + 1] - kv_indptr[b]
                n_keys = T.if_then_else(causal > 0, T.min(n_kv - n_q + qi + 1, n_kv), n_kv)
                row = (q_indptr[b] + qi) * h_q + h
                attend(qf, kf, vf, of, lf, row, (kv_indptr[b], h), 0, n_keys, sm_scale * LOG2E)

    return attention_prefill_ragged


def decode_paged(h_kv: int, h_q: int, d: int, sliding: bool) -> tirx.PrimFunc:
    """One new token per sequence over its paged history, the stock `batch_decode_paged_kv`'s
    signature. With `sliding`, length_info is (3, batch): last page length, window offset, sink."""
    attend = _paged_attend(h_kv, h_q, d, sliding)

    @T.prim_func(private=True)
    def attention_decode_paged(
        q_handle: T.handle,
        pages_handle: T.handle,
        page_indptr_handle: T.handle,
        page_values_handle: T.handle,
        var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch, nnz_pages, max_pages = T.int32(), T.int32(), T.int32()
        ip_off, pv_off, kr_off, qr_off, li_off = T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(q_handle, (batch, h_q, d), "float32")
        pages = T.match_buffer(pages_handle, (max_pages, 2, h_kv, PAGE_SIZE, d), "float32")
        page_indptr = T.match_buffer(page_indptr_handle, (batch + 1,), "int32", elem_offset=ip_off)
        page_values = T.match_buffer(page_values_handle, (nnz_pages,), "int32", elem_offset=pv_off)
        info = T.match_buffer(var_length_info, _info_shape(sliding, batch), "int32", elem_offset=li_off)
        T.match_buffer(k_rope_pos_offset_handle, (batch,), "int32", elem_offset=kr_off)
        T.match_buffer(q_rope_position_handle, (batch,), "int32", elem_offset=qr_off)
        output = T.match_buffer(output_handle, (batch, h_q, d), "float32")
        lse = T.match_buffer(lse_handle, (batch, h_q), "float32")
        assert rotary_mode == 0, "goinfer's attention kernels expect RoPE applied by the model"
        qf = T.decl_buffer((batch * h_q, d), "float32", data=q.data)
        # pages (page, k|v, kv head, slot, d) seen as rows of d
        pf = T.decl_buffer((max_pages * 2 * h_kv * PAGE_SIZE, d), "float32", data=pages.data)
        of = T.decl_buffer((batch * h_q, d), "float32", data=output.data)
        lf = T.decl_buffer((batch * h_q,), "float32", data=lse.data)
        for task in T.parallel(batch * h_q):
            b = task // h_q
            h = task % h_q
            first = page_indptr[b]
            n_pages = page_indptr[b + 1] - first
            n_keys = T.if_then_else(n_pages > 0, _kv_len(info, sliding, b, n_pages), 0)
            where = (page_values, first, info, b, h)
            attend(qf, pf, pf, of, lf, task, where, 0, n_keys, sm_scale * LOG2E)

    return attention_decode_paged


def prefill_paged(h_kv: int, h_q: int, d: int, sliding: bool, window: int) -> tirx.PrimFunc:
    """Prompt tokens attending to the paged history of their sequence, the stock
    `batch_prefill_paged_kv_cpu`'s signature (its causal mask, and for sliding layers its
    "cross" mask: query i of the chunk sees the last window - i - 1 history slots)."""
    attend = _paged_attend(h_kv, h_q, d, sliding)
    window = window if sliding else 0

    @T.prim_func(private=True)
    def attention_prefill_paged(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_values: T.handle,
        var_length_info: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch, total, nnz_pages, max_pages = T.int32(), T.int32(), T.int32(), T.int32()
        qi_off, ip_off, pv_off = T.int32(), T.int32(), T.int32()
        kr_off, qr_off, li_off = T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (total, h_q, d), "float32")
        q_indptr = T.match_buffer(var_q_indptr, (batch + 1,), "int32", elem_offset=qi_off)
        pages = T.match_buffer(var_pages, (max_pages, 2, h_kv, PAGE_SIZE, d), "float32")
        page_indptr = T.match_buffer(var_page_indptr, (batch + 1,), "int32", elem_offset=ip_off)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=pv_off)
        info = T.match_buffer(var_length_info, _info_shape(sliding, batch), "int32", elem_offset=li_off)
        T.match_buffer(var_k_rope_pos_offset, (batch,), "int32", elem_offset=kr_off)
        T.match_buffer(var_q_rope_position, (total,), "int32", elem_offset=qr_off)
        output = T.match_buffer(var_output, (total, h_q, d), "float32")
        lse = T.match_buffer(var_lse, (total, h_q), "float32")
        assert rotary_mode == 0, "goinfer's attention kernels expect RoPE applied by the model"
        qf = T.decl_buffer((total * h_q, d), "float32", data=q.data)
        pf = T.decl_buffer((max_pages * 2 * h_kv * PAGE_SIZE, d), "float32", data=pages.data)
        of = T.decl_buffer((total * h_q, d), "float32", data=output.data)
        lf = T.decl_buffer((total * h_q,), "float32", data=lse.data)
        for b in T.serial(batch):
            for task in T.parallel((q_indptr[b + 1] - q_indptr[b]) * h_q):
                qi = task // h_q
                h = task % h_q
                n_q = q_indptr[b + 1] - q_indptr[b]
                n_pages = page_indptr[b + 1] - page_indptr[b]
                n_kv = T.if_then_else(n_pages > 0, _kv_len(info, sliding, b, n_pages), 0)
                lo, hi = _visible(causal, window, n_kv, n_q, qi)
                row = (q_indptr[b] + qi) * h_q + h
                where = (page_values, page_indptr[b], info, b, h)
                attend(qf, pf, pf, of, lf, row, where, lo, T.max(hi - lo, 0), sm_scale * LOG2E)

    return attention_prefill_paged


def _visible(causal, window: int, n_kv, n_q, qi):
    """The run [lo, hi) of history slots query qi of an n_q-token chunk sees (the stock masks)."""
    if window > 0:  # sliding layers, causal: the last window - qi - 1 slots
        lo = T.if_then_else(causal > 0, T.max(n_kv - T.max(window - qi - 1, 0), 0), 0)
        return lo, n_kv
    return 0, T.if_then_else(causal > 0, T.min(n_kv - n_q + qi + 1, n_kv), n_kv)


def _paged_attend(h_kv: int, h_q: int, d: int, sliding: bool):
    """The core, addressing keys in pages: where = (page table values, first page, length info,
    sequence, head)."""
    group = h_q // h_kv

    def slot(where, j, kv):
        values, first, info, b, h = where
        pos = _seq_pos(info, sliding, b, j)
        page = values[first + pos // PAGE_SIZE]
        return ((page * 2 + kv) * h_kv + h // group) * PAGE_SIZE + pos % PAGE_SIZE

    return _attend(d, lambda where, j: slot(where, j, 0), lambda where, j: slot(where, j, 1))


def _info_shape(sliding: bool, batch):
    return (3, batch) if sliding else (batch,)


def _kv_len(info, sliding: bool, b, n_pages):
    """Keys visible to sequence b: its pages' length, minus what slid out, plus the sink."""
    if not sliding:
        return (n_pages - 1) * PAGE_SIZE + info[b]
    return (n_pages - 1) * PAGE_SIZE + info[0, b] - info[1, b] + info[2, b]


def _seq_pos(info, sliding: bool, b, j):
    """Slot of the j-th visible key: the sink first, then the window."""
    if not sliding:
        return j
    return T.if_then_else(j < info[2, b], j, j - info[2, b] + info[1, b])


def use_ours(mod: tvm.IRModule, h_kv: int, h_q: int, d: int, window: int) -> tvm.IRModule:
    """Swap the stock CPU kernels in an exported module for ours. `window` is the sliding layers'
    window, as the cache was built with."""
    mine = {
        RAGGED: lambda: prefill_ragged(h_kv, h_q, d),
        PREFILL: lambda: prefill_paged(h_kv, h_q, d, sliding=False, window=window),
        PREFILL_SLIDING: lambda: prefill_paged(h_kv, h_q, d, sliding=True, window=window),
        DECODE: lambda: decode_paged(h_kv, h_q, d, sliding=False),
        DECODE_SLIDING: lambda: decode_paged(h_kv, h_q, d, sliding=True),
    }
    names = {gv.name_hint: gv for gv in mod.get_global_vars()}
    missing = [name for name in mine if name not in names]
    if missing:  # a TVM upgrade renamed them: fail the build rather than run the slow ones
        raise RuntimeError(f"TVM's paged KV cache no longer defines {', '.join(missing)}")
    for name, make in mine.items():
        mod[names[name]] = make().with_attr("global_symbol", name)
    return mod
