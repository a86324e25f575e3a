"""CPU attention kernels for TVM's paged KV cache, in place of its stock CPU ones.

TVM's CPU kernels (relax.frontend.nn.llm) are scalar and serial: one thread walks every query,
head and key. Measured on Qwen-0.5B, 2 threads, a 512-token prompt spent 5.1 s of 16 s in them.
Scores here are in log2 units (scaled by log2(e)) and `lse` is log2-based, as the stock kernels
leave them.

One core (`_tile`) computes every query, prefill or decode, in one order fixed by key position:
keys in blocks of KEY_BLOCK = 16 at absolute positions [16 i, 16 i + 16), an online softmax over
the blocks in order, each block's arithmetic the same whatever its keys' storage. A query's output
is then the same bits whichever prefill chunk it was in, wherever that chunk began, whatever else
ran in the batch, and whether it was prefilled or decoded: with every other kernel computing a row
alone, a warm sequence resumes at any token, exactly (runtime/kv_pool.py). TVM attends a prefill
chunk in two calls and merges them (the chunk to itself, then to the history), which ties the
result to where the chunk began; `prefill` attends to both at once, and the runtime routes the
cache's two calls to it (tvm_runtime `_PrefillRoute`), so its signature is the stock paged one
plus the chunk's K/V.

The tile (`_tile`):
1. GQA: a tile is ROWS = 16 (query, q head) rows of one kv head, so a key or value row is loaded
   once for all the group's heads (Qwen 6-7, Gemma 4) and, in prefill, for ROWS / group queries.
   A decode step is one tile a kv head: its group's heads (before, a task per q head read each
   K/V row once per head).
2. Query tiling: the 16 rows are the 16 lanes of a vector, queries transposed into columns: a key
   element, broadcast, multiplies one column of all 16 rows, with no horizontal sums; softmax
   (max, exp2, sum) runs on 16 rows at once; each row keeps its own key range, so the causal and
   sliding masks hold inside a tile that spans several queries (and ends mid-query's heads).
3. Registers: the 16 score accumulators and 8 output columns x 16 rows stay in registers through
   the head_dim loops (small buffers inside the task); exp2 is a polynomial on vectors (T.exp2 is a
   libm call per lane); a block wholly in pages or wholly in the chunk is read in place, an edge
   block is copied (no slot past a sequence's end is read); tiles go to threads zigzag, so causal
   work splits evenly.

Measured (the two-call prefill these replaced had the same tile), 2 threads, one layer's kernel:
Gemma-3-270M shape (4 q / 1 kv heads, d 256) 512 tokens 21.3 -> 5.6 ms against the task per
(query, head) before; Qwen2.5-0.5B shape (14 / 2 heads, d 64) 512 tokens 33.1 -> 5.0 ms.
Decode (`_group`: the same arithmetic, keys in the lanes, a kv head's K/V read once for its group):
Intel Xeon, 2 threads, float16 pages, one call a layer over 28 page pools (A/B in one process,
min of 3), against the task per (sequence, q head) before: Qwen2.5-1.5B shape (12 q / 2 kv heads,
d 128) 1k keys 0.17 -> 0.14 ms, 4k 1.17 -> 0.70 ms, 15k 6.0 -> 2.7 ms; Qwen2.5-0.5B shape (14 / 2,
d 64) 1k 0.105 -> 0.070, 4k 0.54 -> 0.35, 15k 3.4 -> 1.55 ms. The tile itself in decode (16 lanes,
6 of them rows) was 3.1 ms at 15k on the 1.5B shape. What is left is the reading: a kv head's K
(or V) block is a 4 KB run with the other heads' between them in TVM's page layout, which the
hardware prefetcher streams at ~6 GB/s here (numpy reads one head of such pages at 7 GB/s, a
whole pool at 14); prefetching two blocks ahead in software made it slower.

Every kernel takes the cache's dtype (`dtype`: float32 or float16) for q, the K/V (pages or the
ragged chunk) and the output, as TVM's cache hands them all in its one dtype; lse is float32 either
way. A float16 kernel loads half, widens each block into a float32 copy (LLVM's fpext: vcvtph2ps
with F16C or AVX-512), computes exactly as the float32 one, and narrows only the output it stores.

Only RopeMode.NONE is supported (the models apply RoPE themselves): `rotary_mode` must be 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import tvm
from goinfer.artifacts.manifest import PAGE_SIZE
from tvm import tirx
from tvm.script import tirx as T

from ..tvm import passes, tvmscript
from .vector_math import exp2

tvmscript.install()  # faster TVMScript parsing, the same kernels

KEY_BLOCK = 16  # keys per online-softmax step; prefill: equal to PAGE_SIZE, a block is one page
ROWS = 16  # query rows per prefill tile: the float32 lanes of one AVX-512 register
PV_UNROLL = 8  # prefill: head_dim columns of output += p @ V summed at once
LOG2E = math.log2(math.e)
_MIN = -1e30  # a finite "minus infinity": exp2(_MIN - m) is 0 and never NaN
KV_DTYPES = ("float32", "float16")  # the cache dtypes the kernels are built for

# The stock kernels' names in the module TIRPagedKVCache builds (their global symbols, TVM 0.27).
RAGGED = "batch_prefill_ragged_kv"
PREFILL = "batch_prefill_paged_kv_cpu"
PREFILL_SLIDING = "batch_prefill_paged_kv_cpu_sliding_window"
DECODE = "batch_decode_paged_kv_cpu"
DECODE_SLIDING = "batch_decode_paged_kv_cpu_sliding_window"


def _lanes(d: int) -> int:
    return next(v for v in (16, 8, 4, 2, 1) if d % v == 0)


def _as(dtype: str, x):
    """x (a scalar or vector) as element type `dtype`, lanes kept: a float16 load widened to
    float32, or a float32 result narrowed for a float16 store. x itself when already `dtype`."""
    have, x_, lanes = str(x.ty).partition("x")
    return x if have == dtype else T.Cast(dtype + x_ + lanes, x)


def _f32(x):
    return _as("float32", x)


def check_dtype(dtype: str) -> None:
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {dtype!r}: the attention kernels take {', '.join(KV_DTYPES)}")


def _weight(x):
    """2**x for x <= 0 (scores minus the running max, in log2 units), on 16 lanes."""
    return exp2(x, 16, bounded_above=True)


def _tree(op, values):
    """op over values as a balanced tree (a chain would serialize on op's latency)."""
    while len(values) > 1:
        values = [
            op(*values[i : i + 2]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)
        ]
    return values[0]


def _add(a, b):
    return a + b


def _vec(x):
    return T.Broadcast(x, ROWS)


def _zigzag(u, n):
    """Task u of n -> tile: 0, n-1, 1, n-2, ... The parallel loop hands each thread a contiguous
    run of tasks, and a causal tile's work grows with its index: each run now gets both ends."""
    return T.if_then_else(u % 2 == 0, u // 2, n - 1 - u // 2)


def _tile(d: int, h_kv: int, h_q: int, dtype: str):
    """The one attention core: `attend(...)` runs one tile of up to ROWS (query, q head) rows of
    one kv head against their keys, in an order fixed by the keys' absolute positions.

    Keys live in two places: the sequence's history in the cache's pages (absolute positions
    [hist_lo, H): key j at page slot j + shift, the slots of a page KEY_BLOCK rows of d apart),
    and the chunk being prefilled in the ragged K/V (positions [H, chunk_end): key j at row
    (row0 + j - H, hk), h_kv rows of d apart). `where` = (page table values, first page, shift,
    hist_lo, H, row0, chunk_end, hk). Lane r's row is rows[r] of q and the output; it sees keys
    [lo_b[r], hi_b[r]) (its causal and sliding masks; empty for an unused lane).

    Blocks are the KEY_BLOCK keys [16 i, 16 i + 16) of absolute positions, in order, whichever
    place each key comes from: a row's result depends on its query and its keys only, never on
    where a prefill chunk was cut, which rows share its tile, or whether it is a decode step.
    That is what lets a warm sequence resume at any token, bit for bit (runtime/kv_pool.py).
    A block wholly in one place is read in place (float32); an edge block is copied, its keys
    from wherever they live and zeros where none is visible (masked: weight exactly 0). A
    float16 block is widened into the copy first. Fully masked blocks leave a row unchanged:
    its max stays, 2**0 is exactly 1, and its weights are 0."""
    assert KEY_BLOCK == PAGE_SIZE
    R, KB = ROWS, KEY_BLOCK
    U = math.gcd(d, PV_UNROLL)
    vl = _lanes(d)  # copies, vl floats at a time
    chunk_stride = h_kv * d

    def at(i):  # the i-th vector of ROWS lanes
        return T.ramp(i * R, 1, R)

    def over_keys(op, s):  # op over the block's KB vectors s[at(jj)], as a balanced tree
        return _tree(op, [s[at(jj)] for jj in range(KB)])

    def sees(j, lo, hi):  # which rows see key j
        return T.And(_vec(j) >= lo, _vec(j) < hi)

    def page_at(where, j, kv):  # flat offset of history key j's row (kv 0) or its value's (kv 1)
        values, first, shift, _, _, _, _, hk = where
        p = j + shift
        return (((values[first + p // PAGE_SIZE] * 2 + kv) * h_kv + hk) * PAGE_SIZE + p % PAGE_SIZE) * d

    def chunk_at(where, j):  # flat offset of chunk key j's row in the ragged K (or V)
        _, _, _, _, h, row0, _, hk = where
        return ((row0 + j - h) * h_kv + hk) * d

    zeros = _vec(T.float32(0))
    lowest = _vec(T.float32(_MIN))
    in_place = dtype == "float32"

    @T.macro
    def block(ks, k0, vs, v0, kstride, j0, lo, hi, qt, ot, s, ms, ls, acc):
        """Keys j0 .. j0 + KB - 1, rows ks[k0 + jj * kstride + (0 .. d-1)] (values: vs, v0)."""
        # 1. scores, KB keys x ROWS rows: a key element, broadcast, times the ROWS rows' query
        #    column (one load feeds ROWS products; no horizontal sums). The KB accumulators stay
        #    in registers through the loop over head_dim.
        for jj in T.unroll(KB):
            s[at(jj)] = zeros
        for c in T.serial(d):
            for jj in T.unroll(KB):
                s[at(jj)] = s[at(jj)] + _vec(ks[k0 + jj * kstride + c]) * qt[at(c)]
        # 2. online softmax, all rows at once: mask, fold the block's max in, rescale the sum
        for jj in T.unroll(KB):
            s[at(jj)] = T.Select(sees(j0 + jj, lo, hi), s[at(jj)], lowest)
        m_new = T.Bind(T.max(ms[at(0)], over_keys(T.max, s)))
        alpha = T.Bind(_weight(ms[at(0)] - m_new))
        ms[at(0)] = m_new
        for jj in T.unroll(KB):  # scores -> weights p; a masked key's is exactly 0
            s[at(jj)] = T.Select(sees(j0 + jj, lo, hi), _weight(s[at(jj)] - m_new), zeros)
        ls[at(0)] = ls[at(0)] * alpha + over_keys(_add, s)
        # 3. output = output * alpha + p @ V: a value element, broadcast, times the rows' weights;
        #    U columns at a time (U independent FMA chains, KB weights held in registers)
        for c0 in T.serial(d // U):
            for u in T.unroll(U):
                acc[at(u)] = ot[at(c0 * U + u)] * alpha
            for jj in T.unroll(KB):
                for u in T.unroll(U):
                    acc[at(u)] = acc[at(u)] + _vec(vs[v0 + jj * kstride + c0 * U + u]) * s[at(jj)]
            for u in T.unroll(U):
                ot[at(c0 * U + u)] = acc[at(u)]

    @T.macro
    def copy_row(kb, vb, jj, ksrc, k_row, vsrc, v_row):
        """Key and value rows at k_row, v_row into row jj of the float32 block copies."""
        for c in T.serial(d // vl):
            kb[T.ramp(jj * d + c * vl, 1, vl)] = _f32(ksrc[T.ramp(k_row + c * vl, 1, vl)])
            vb[T.ramp(jj * d + c * vl, 1, vl)] = _f32(vsrc[T.ramp(v_row + c * vl, 1, vl)])

    @T.macro
    def attend(qf, of, lf, rows, n_live, scale, lo_b, hi_b, pf, kf, vf, where):
        qt = T.alloc_buffer((d * R,), "float32")  # the tile's queries, transposed: qt[c, row]
        ot = T.alloc_buffer((d * R,), "float32")  # its output, transposed
        kb = T.alloc_buffer((KB * d,), "float32")  # an edge (or float16) block's keys, copied
        vb = T.alloc_buffer((KB * d,), "float32")
        s = T.alloc_buffer((KB * R,), "float32")  # scores, then weights: [key, row]
        acc = T.alloc_buffer((U * R,), "float32")
        ms = T.alloc_buffer((R,), "float32")  # running max
        ls = T.alloc_buffer((R,), "float32")  # running sum
        span = T.alloc_buffer((2,), "int32")  # the keys any row sees
        hist_lo, h, chunk_end = T.meta_var((where[3], where[4], where[6]))
        span[0] = T.int32(2**31 - 1)
        span[1] = 0
        for r in T.serial(R):
            if r >= n_live:  # an unused lane: sees nothing, written nowhere
                lo_b[r] = 0
                hi_b[r] = 0
            if lo_b[r] < hi_b[r]:
                span[0] = T.min(span[0], lo_b[r])
                span[1] = T.max(span[1], hi_b[r])
        for c in T.serial(d):  # transpose: a column at a time, one masked broadcast per row
            qt[at(c)] = zeros
            for r in T.unroll(R):
                qt[at(c)] = T.Select(T.ramp(0, 1, R) == _vec(r), _vec(_f32(qf[rows[r], c])), qt[at(c)])
            qt[at(c)] = qt[at(c)] * _vec(scale)
        for c in T.serial(d):
            ot[at(c)] = zeros
        ms[at(0)] = lowest
        ls[at(0)] = zeros
        lo = T.Bind(lo_b[at(0)])
        hi = T.Bind(hi_b[at(0)])
        if span[0] < span[1]:
            for blk in T.serial((span[1] + KB - 1) // KB - span[0] // KB):
                j0 = T.Bind((span[0] // KB + blk) * KB)
                if j0 >= hist_lo and j0 + KB <= h:  # one page of history
                    k0 = T.Bind(page_at(where, j0, 0))
                    v0 = T.Bind(page_at(where, j0, 1))
                    if in_place:
                        block(pf, k0, pf, v0, d, j0, lo, hi, qt, ot, s, ms, ls, acc)
                    else:
                        for jj in T.serial(KB):
                            copy_row(kb, vb, jj, pf, k0 + jj * d, pf, v0 + jj * d)
                        block(kb, 0, vb, 0, d, j0, lo, hi, qt, ot, s, ms, ls, acc)
                elif j0 >= h and j0 + KB <= chunk_end:  # KB keys of the chunk
                    k0 = T.Bind(chunk_at(where, j0))
                    if in_place:
                        block(kf, k0, vf, k0, chunk_stride, j0, lo, hi, qt, ot, s, ms, ls, acc)
                    else:
                        for jj in T.serial(KB):
                            copy_row(kb, vb, jj, kf, k0 + jj * chunk_stride, vf, k0 + jj * chunk_stride)
                        block(kb, 0, vb, 0, d, j0, lo, hi, qt, ot, s, ms, ls, acc)
                else:  # an edge: each key from its place, zeros where there is none
                    for jj in T.serial(KB):
                        j = T.Bind(j0 + jj)
                        if j >= span[0] and j >= hist_lo and j < h:
                            copy_row(kb, vb, jj, pf, page_at(where, j, 0), pf, page_at(where, j, 1))
                        elif j >= span[0] and j >= h and j < chunk_end:
                            copy_row(kb, vb, jj, kf, chunk_at(where, j), vf, chunk_at(where, j))
                        else:
                            for c in T.serial(d // vl):
                                kb[T.ramp(jj * d + c * vl, 1, vl)] = T.Broadcast(T.float32(0), vl)
                                vb[T.ramp(jj * d + c * vl, 1, vl)] = T.Broadcast(T.float32(0), vl)
                    block(kb, 0, vb, 0, d, j0, lo, hi, qt, ot, s, ms, ls, acc)
        ls[at(0)] = T.max(ls[at(0)], _vec(T.float32(1e-30)))  # no keys: output 0, not NaN
        for r in T.serial(R):
            if r < n_live:
                lf[rows[r]] = ms[r] + T.log2(ls[r])
        ls[at(0)] = _vec(T.float32(1)) / ls[at(0)]  # now 1 / sum
        for r in T.serial(R):
            if r < n_live:
                for c in T.serial(d):
                    of[rows[r], c] = _as(dtype, ot[c * R + r] * ls[r])

    return attend


def _window_lo(window: int, pos):
    """The first key position a query at `pos` sees: its window's start, or 0 without one."""
    return T.max(pos - window + 1, 0) if window > 0 else 0


def prefill(h_kv: int, h_q: int, d: int, sliding: bool, window: int, dtype: str = "float32") -> tirx.PrimFunc:
    """A prefill chunk attending to its sequence's history and to itself, in one pass.

    TVM's cache runs prefill attention as two kernels, the chunk against itself (ragged) and
    against the history (paged), then merges the two results: a query's output would then
    depend on where its chunk began. This kernel sees both: the stock paged prefill's arguments,
    then the chunk's ragged K/V with its indptr, each sequence's history length (`hist`, the
    ragged kernel's k_rope_pos_offset) and `mode`: 0, the sequences without history (run in the
    ragged kernel's place, with no pages), 1, those with some (in the paged kernel's place). The
    runtime (tvm_runtime) routes TVM's two calls here and makes the merge a no-op; `output` and
    `lse` are the ragged call's, where the layer's result is read. With `sliding`, length_info
    is (3, batch): last page length, window offset, sink (0: goinfer sets no attention sink)."""
    check_dtype(dtype)
    group = h_q // h_kv
    window = window if sliding else 0
    attend = _tile(d, h_kv, h_q, dtype)

    @T.prim_func(private=True)
    def attention_prefill(
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
        var_k: T.handle,
        var_v: T.handle,
        var_kv_indptr: T.handle,
        var_hist: T.handle,
        mode: T.int32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch, total, kv_len, nnz_pages, max_pages = T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        n_ptr, n_info, n_kr = T.int32(), T.int32(), T.int32()
        qi_off, ip_off, pv_off, kv_off, hi_off = T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        kr_off, qr_off, li_off = T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (total, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch + 1,), "int32", elem_offset=qi_off)
        pages = T.match_buffer(var_pages, (max_pages, 2, h_kv, PAGE_SIZE, d), dtype)
        # the page table and length info are read only in mode 1 (mode 0 passes stand-ins)
        page_indptr = T.match_buffer(var_page_indptr, (n_ptr,), "int32", elem_offset=ip_off)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=pv_off)
        info = T.match_buffer(var_length_info, _info_shape(sliding, n_info), "int32", elem_offset=li_off)
        T.match_buffer(var_k_rope_pos_offset, (n_kr,), "int32", elem_offset=kr_off)
        T.match_buffer(var_q_rope_position, (total,), "int32", elem_offset=qr_off)
        output = T.match_buffer(var_output, (total, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total, h_q), "float32")
        k = T.match_buffer(var_k, (kv_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch + 1,), "int32", elem_offset=kv_off)
        hist = T.match_buffer(var_hist, (batch,), "int32", elem_offset=hi_off)
        assert rotary_mode == 0, "goinfer's attention kernels expect RoPE applied by the model"
        qf = T.decl_buffer((total * h_q, d), dtype, data=q.data)
        pf = T.decl_buffer((max_pages * 2 * h_kv * PAGE_SIZE * d,), dtype, data=pages.data)
        kf = T.decl_buffer((kv_len * h_kv * d,), dtype, data=k.data)
        vf = T.decl_buffer((kv_len * h_kv * d,), dtype, data=v.data)
        of = T.decl_buffer((total * h_q, d), dtype, data=output.data)
        lf = T.decl_buffer((total * h_q,), "float32", data=lse.data)
        for b in T.serial(batch):
            h = T.Bind(hist[b])
            if (mode == 0 and h == 0) or (mode == 1 and h > 0):
                n_q = T.Bind(q_indptr[b + 1] - q_indptr[b])
                n_pages = T.Bind(T.if_then_else(mode == 1, page_indptr[b + 1] - page_indptr[b], 0))
                n_kv = T.Bind(T.if_then_else(n_pages > 0, _kv_len(info, sliding, b, n_pages), 0))
                offset = T.Bind(_window_offset(info, sliding, b))
                first = T.Bind(T.if_then_else(mode == 1, page_indptr[b], 0))
                n_tiles = T.Bind((n_q * group + ROWS - 1) // ROWS)
                for task in T.parallel(n_tiles * h_kv):
                    hk = T.Bind(task % h_kv)
                    tile = T.Bind(_zigzag(task // h_kv, n_tiles))
                    rows = T.alloc_buffer((ROWS,), "int32")
                    lo_b = T.alloc_buffer((ROWS,), "int32")  # each row's keys [lo, hi)
                    hi_b = T.alloc_buffer((ROWS,), "int32")
                    for r in T.serial(ROWS):  # row f: query f // group, head hk * group + f % group
                        f = T.Bind(T.min(tile * ROWS + r, n_q * group - 1))
                        rows[r] = (q_indptr[b] + f // group) * h_q + hk * group + f % group
                        lo_b[r] = _window_lo(window, h + f // group)
                        hi_b[r] = h + f // group + 1
                    where = T.meta_var((page_values, first, offset - (h - n_kv), h - n_kv, h,
                                        kv_indptr[b], h + n_q, hk))  # fmt: skip
                    attend(qf, of, lf, rows, n_q * group - tile * ROWS, sm_scale * LOG2E,
                           lo_b, hi_b, pf, kf, vf, where)  # fmt: skip

    return attention_prefill


def packed(h: int, d: int, scale: float) -> tirx.PrimFunc:
    """An encoder's attention: several inputs packed one after another, each token attending to
    every token of its own input (no mask inside an input, nothing across inputs), in `_tile`'s
    order and arithmetic. q, k, v: (n, h, d) float32, input b the rows [offsets[b], offsets[b+1]);
    out: (n, h, d); lse: (n, h), the log2-sum-exp `_tile` leaves (unused by the model). `scale`:
    the softmax's, head_dim ** -0.5 for every encoder we build.

    The keys are `_tile`'s "chunk" with no history: positions from 0 within the input. A task is
    one (input, head), its query tiles in turn: 64 inputs of a batch give 768 tasks a layer to
    share among the threads, one 16-token query 12."""
    attend = _tile(d, h, h, "float32")

    @T.prim_func(private=True)
    def attention_packed(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_offsets: T.handle,
                         var_out: T.handle, var_lse: T.handle):  # fmt: skip
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n, edges, off = T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (n, h, d), "float32")
        k = T.match_buffer(var_k, (n, h, d), "float32")
        v = T.match_buffer(var_v, (n, h, d), "float32")
        offsets = T.match_buffer(var_offsets, (edges,), "int32", elem_offset=off)
        out = T.match_buffer(var_out, (n, h, d), "float32")
        lse = T.match_buffer(var_lse, (n, h), "float32")
        qf = T.decl_buffer((n * h, d), "float32", data=q.data)
        kf = T.decl_buffer((n * h * d,), "float32", data=k.data)
        vf = T.decl_buffer((n * h * d,), "float32", data=v.data)
        of = T.decl_buffer((n * h, d), "float32", data=out.data)
        lf = T.decl_buffer((n * h,), "float32", data=lse.data)
        for task in T.parallel((edges - 1) * h):
            b = T.Bind(task // h)
            hk = T.Bind(task % h)
            n_q = T.Bind(offsets[b + 1] - offsets[b])
            rows = T.alloc_buffer((ROWS,), "int32")
            lo_b = T.alloc_buffer((ROWS,), "int32")  # each row's keys [lo, hi): its whole input
            hi_b = T.alloc_buffer((ROWS,), "int32")
            for tile in T.serial((n_q + ROWS - 1) // ROWS):
                for r in T.serial(ROWS):
                    rows[r] = (offsets[b] + T.min(tile * ROWS + r, n_q - 1)) * h + hk
                    lo_b[r] = 0
                    hi_b[r] = n_q
                # no history (pages: none, read nowhere): every key is the input's own, row0 on
                where = T.meta_var((offsets, 0, 0, 0, 0, offsets[b], n_q, hk))
                attend(
                    qf,
                    of,
                    lf,
                    rows,
                    n_q - tile * ROWS,
                    T.float32(scale * LOG2E),
                    lo_b,
                    hi_b,
                    kf,
                    kf,
                    vf,
                    where,
                )

    return attention_packed


def ragged_unrouted(h_kv: int, h_q: int, d: int, dtype: str = "float32") -> tirx.PrimFunc:
    """In the stock ragged kernel's place: the runtime routes that call to `prefill` (mode 0),
    so this runs only where it was not, and says so rather than attend half the keys."""
    check_dtype(dtype)

    @T.prim_func(private=True)
    def attention_ragged_unrouted(
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
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        T.match_buffer(var_q, (n, h_q, d), dtype)  # the cache's dtype, as the stock kernel's
        assert rotary_mode < 0, "goinfer's prefill attention runs through its runtime (tvm_runtime)"

    return attention_ragged_unrouted


def _butterfly(op, x):
    """op over a 16-lane vector's lanes, the result in every lane. Lane l meets lane l ^ 1, then
    l ^ 2, l ^ 4, l ^ 8: for a sum that is `_tree`'s pairing of neighbours exactly (a + b is b + a
    in IEEE arithmetic), so a key-lane sum equals the tile's sum over its key vectors."""
    for bit in (1, 2, 4, 8):
        x = T.Bind(op(x, T.Shuffle([x], [lane ^ bit for lane in range(16)])))
    return x


def _transpose16(rows: list) -> list:
    """16 vectors of 16 lanes -> the 16 columns, by swapping off-diagonal blocks of 8, 4, 2, 1."""
    v = [T.Bind(r) for r in rows]
    for bit in (8, 4, 2, 1):
        low = [lane if not lane & bit else 16 + (lane ^ bit) for lane in range(16)]
        high = [16 + lane if lane & bit else lane ^ bit for lane in range(16)]
        nxt = list(v)
        for i in (i for i in range(16) if not i & bit):
            nxt[i] = T.Bind(T.Shuffle([v[i], v[i | bit]], low))
            nxt[i | bit] = T.Bind(T.Shuffle([v[i], v[i | bit]], high))
        v = nxt
    return v


def _group(d: int, h_kv: int, heads: int, dtype: str):
    """The decode core: `attend(...)` runs up to `heads` q heads of one kv head, one query each,
    over keys [lo, hi) in pages, with the tile's arithmetic (`_tile`) but keys in the lanes.

    A decode step has one query, so the tile's lanes (rows) would hold only the group's heads
    (6 of 16 on Qwen2.5-1.5B) and do 16-lane work for each. Here a block's 16 keys are the lanes:
    its K block transposed once into columns serves every head (scores: a K column times the
    head's query element, broadcast), and the output's head_dim is the lanes of p @ V. Each
    (head, key) score and each output element is computed by the very operations, in the very
    order, the tile uses for that row (tests compare the bits); the per-head softmax values are
    vectors with every lane equal, computed as the tile computes a lane."""
    assert KEY_BLOCK == PAGE_SIZE == 16
    KB, G = KEY_BLOCK, heads
    vl = _lanes(d)
    width = -(-d // 16) * 16  # a copied row, padded with zeros to whole 16-column chunks

    def page_at(where, j, kv):
        values, first, shift, hk = where
        p = j + shift
        return (((values[first + p // PAGE_SIZE] * 2 + kv) * h_kv + hk) * PAGE_SIZE + p % PAGE_SIZE) * d

    def head(g):  # head g's 16 lanes (its scores, or its max and sum in every lane)
        return T.ramp(g * KB, 1, KB)

    def chunk(r, c0):  # columns c0 * vl .. of row r of a (rows, d) buffer
        return T.ramp(r * d + c0 * vl, 1, vl)

    def live(j0, lo, hi):  # which of the block's keys are visible (a bool vector cannot be bound)
        return T.And(T.ramp(j0, 1, KB) >= _vec(lo), T.ramp(j0, 1, KB) < _vec(hi))

    zeros = _vec(T.float32(0))
    lowest = _vec(T.float32(_MIN))

    @T.macro
    def attend(qf, of, lf, rows, n_live, scale, lo, hi, pf, where, hist_lo, h):
        qs = T.alloc_buffer((G * d,), "float32")  # each head's query, scaled
        ot = T.alloc_buffer((G * d,), "float32")  # each head's output
        kb = T.alloc_buffer((KB * width,), "float32")  # the block's K rows, then its columns
        kt = T.alloc_buffer((width * KB,), "float32")
        vb = T.alloc_buffer((KB * d,), "float32")
        s = T.alloc_buffer((G * KB,), "float32")  # scores, then weights: [head, key]
        ms = T.alloc_buffer((G * KB,), "float32")  # running max and sum, every lane equal
        ls = T.alloc_buffer((G * KB,), "float32")
        state = T.alloc_buffer((2 * KB,), "float32")  # a head's new max, and its alpha
        acc = T.alloc_buffer((d,), "float32")  # a head's output, in registers through the keys
        for g in T.serial(G):
            for c in T.serial(d):
                qs[g * d + c] = _f32(qf[rows[g], c]) * scale
                ot[g * d + c] = T.float32(0)
            ms[T.ramp(g * KB, 1, KB)] = lowest
            ls[T.ramp(g * KB, 1, KB)] = zeros
        for i in T.serial(KB * width):
            kb[i] = T.float32(0)
        for blk in T.serial((hi + KB - 1) // KB - lo // KB):
            j0 = T.Bind((lo // KB + blk) * KB)
            # 1. the block's K and V rows, widened; zeros where no key is visible (masked)
            for jj in T.serial(KB):
                if j0 + jj >= lo and j0 + jj < hi and j0 + jj >= hist_lo and j0 + jj < h:
                    k_row = T.Bind(page_at(where, j0 + jj, 0))
                    v_row = T.Bind(page_at(where, j0 + jj, 1))
                    for c in T.serial(d // vl):
                        kb[T.ramp(jj * width + c * vl, 1, vl)] = _f32(pf[T.ramp(k_row + c * vl, 1, vl)])
                        vb[T.ramp(jj * d + c * vl, 1, vl)] = _f32(pf[T.ramp(v_row + c * vl, 1, vl)])
                else:
                    for c in T.serial(d // vl):
                        kb[T.ramp(jj * width + c * vl, 1, vl)] = T.Broadcast(T.float32(0), vl)
                        vb[T.ramp(jj * d + c * vl, 1, vl)] = T.Broadcast(T.float32(0), vl)
            # 2. K columns: kt[c, key]
            for c16 in T.serial(width // 16):
                cols = _transpose16([kb[T.ramp(jj * width + c16 * 16, 1, 16)] for jj in range(KB)])
                kt[T.ramp(c16 * 16 * KB, 1, 16 * KB)] = T.Shuffle(cols, list(range(16 * KB)))
            # 3. scores, every head at once (independent FMA chains): as the tile, summed over c
            for g in T.unroll(G):
                s[T.ramp(g * KB, 1, KB)] = zeros
            for c in T.serial(d):
                for g in T.unroll(G):
                    s[T.ramp(g * KB, 1, KB)] = s[T.ramp(g * KB, 1, KB)] + kt[T.ramp(c * KB, 1, KB)] * _vec(
                        qs[g * d + c]
                    )
            # 4. online softmax per head, and output = output * alpha + p @ V (head_dim in lanes);
            #    unrolled, so every index into the scores is constant and they stay in registers
            for g in T.unroll(G):
                sc = T.Bind(T.Select(live(j0, lo, hi), s[head(g)], lowest))
                state[head(0)] = T.max(ms[head(g)], _butterfly(T.max, sc))  # the new max
                state[head(1)] = _weight(ms[head(g)] - state[head(0)])  # alpha
                ms[head(g)] = state[head(0)]
                s[head(g)] = T.Select(live(j0, lo, hi), _weight(sc - state[head(0)]), zeros)
                ls[head(g)] = ls[head(g)] * state[head(1)] + _butterfly(_add, s[head(g)])
                # the d / vl column chunks are independent FMA chains, each over the keys in order
                for c0 in T.unroll(d // vl):
                    acc[chunk(0, c0)] = ot[chunk(g, c0)] * T.Broadcast(state[KB], vl)
                for jj in T.unroll(KB):
                    p = T.Bind(T.Broadcast(s[g * KB + jj], vl))  # key jj's weight
                    for c0 in T.unroll(d // vl):
                        acc[chunk(0, c0)] = acc[chunk(0, c0)] + vb[chunk(jj, c0)] * p
                for c0 in T.unroll(d // vl):
                    ot[chunk(g, c0)] = acc[chunk(0, c0)]
        for g in T.serial(n_live):
            ls[g * KB] = T.max(ls[g * KB], T.float32(1e-30))  # no keys: output 0, not NaN
            lf[rows[g]] = ms[g * KB] + T.log2(ls[g * KB])
            ls[g * KB] = T.float32(1) / ls[g * KB]
            for c in T.serial(d):
                of[rows[g], c] = _as(dtype, ot[g * d + c] * ls[g * KB])

    return attend


def decode(h_kv: int, h_q: int, d: int, sliding: bool, window: int, dtype: str = "float32") -> tirx.PrimFunc:
    """One new token per sequence over its pages (its own K/V among them: TVM appends before a
    decode step attends), the stock `batch_decode_paged_kv`'s signature.

    The tile's arithmetic with keys in the lanes (`_group`), so a decode step's output is a
    prefill's bit for bit. A task is one sequence's kv head and its group's q heads: each K/V row
    is read once for the group (once per q head before: 7 times on Qwen2.5-0.5B). With one kv
    head the group is split over two tasks, so two cores share the keys."""
    check_dtype(dtype)
    group = h_q // h_kv
    window = window if sliding else 0
    splits = 2 if h_kv == 1 and group > 1 else 1
    per_task = -(-group // splits)
    attend = _group(d, h_kv, per_task, dtype)

    @T.prim_func(private=True)
    def attention_decode(
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
        q = T.match_buffer(q_handle, (batch, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_pages, 2, h_kv, PAGE_SIZE, d), dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (batch + 1,), "int32", elem_offset=ip_off)
        page_values = T.match_buffer(page_values_handle, (nnz_pages,), "int32", elem_offset=pv_off)
        info = T.match_buffer(var_length_info, _info_shape(sliding, batch), "int32", elem_offset=li_off)
        T.match_buffer(k_rope_pos_offset_handle, (batch,), "int32", elem_offset=kr_off)
        q_pos = T.match_buffer(q_rope_position_handle, (batch,), "int32", elem_offset=qr_off)
        output = T.match_buffer(output_handle, (batch, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (batch, h_q), "float32")
        assert rotary_mode == 0, "goinfer's attention kernels expect RoPE applied by the model"
        qf = T.decl_buffer((batch * h_q, d), dtype, data=q.data)
        pf = T.decl_buffer((max_pages * 2 * h_kv * PAGE_SIZE * d,), dtype, data=pages.data)
        of = T.decl_buffer((batch * h_q, d), dtype, data=output.data)
        lf = T.decl_buffer((batch * h_q,), "float32", data=lse.data)
        for task in T.parallel(batch * h_kv * splits):
            b = T.Bind(task // (h_kv * splits))
            hk = T.Bind(task // splits % h_kv)
            head0 = T.Bind(task % splits * per_task)
            n_pages = T.Bind(page_indptr[b + 1] - page_indptr[b])
            n_kv = T.Bind(T.if_then_else(n_pages > 0, _kv_len(info, sliding, b, n_pages), 0))
            # the query's absolute position: the last key's (with a window, from the rope map)
            pos = T.Bind(_query_pos(q_pos, sliding, b, n_kv))
            offset = T.Bind(_window_offset(info, sliding, b))
            rows = T.alloc_buffer((per_task,), "int32")
            for g in T.serial(per_task):
                rows[g] = b * h_q + hk * group + T.min(head0 + g, group - 1)
            where = T.meta_var((page_values, page_indptr[b], offset - (pos + 1 - n_kv), hk))
            attend(qf, of, lf, rows, T.min(per_task, group - head0), sm_scale * LOG2E,
                   _window_lo(window, pos), pos + 1, pf, where, pos + 1 - n_kv, pos + 1)  # fmt: skip

    return attention_decode


def _window_offset(info, sliding: bool, b):
    """The slot of the first key in sequence b's window (sliding layers), else 0."""
    return info[1, b] if sliding else 0


def _query_pos(q_pos, sliding: bool, b, n_kv):
    """A decode query's absolute position: the last key's, or with a window (whose keys are the
    last ones only) from the rope position map."""
    return q_pos[b] if sliding else n_kv - 1


def _info_shape(sliding: bool, batch):
    return (3, batch) if sliding else (batch,)


def _kv_len(info, sliding: bool, b, n_pages):
    """Keys visible to sequence b: its pages' length, minus what slid out, plus the sink."""
    if not sliding:
        return (n_pages - 1) * PAGE_SIZE + info[b]
    return (n_pages - 1) * PAGE_SIZE + info[0, b] - info[1, b] + info[2, b]


def use_ours(mod: tvm.IRModule, h_kv: int, h_q: int, d: int, window: int) -> tvm.IRModule:
    """Swap the stock CPU kernels in an exported module for ours. `window` is the sliding layers'
    window, as the cache was built with; the dtype is the one the cache's stock kernels take."""
    dt = stock_dtype(mod, DECODE, 1)  # its pages
    mine = {
        RAGGED: lambda: ragged_unrouted(h_kv, h_q, d, dt),
        PREFILL: lambda: prefill(h_kv, h_q, d, sliding=False, window=window, dtype=dt),
        PREFILL_SLIDING: lambda: prefill(h_kv, h_q, d, sliding=True, window=window, dtype=dt),
        DECODE: lambda: decode(h_kv, h_q, d, sliding=False, window=window, dtype=dt),
        DECODE_SLIDING: lambda: decode(h_kv, h_q, d, sliding=True, window=window, dtype=dt),
    }
    return swap_stock(mod, mine)


def stock_dtype(mod: tvm.IRModule, name: str, param: int) -> str:
    """The element type of parameter `param` of the stock kernel `name` in `mod`: the dtype the
    cache was built with, so ours take what its C++ side hands them."""
    func = next((f for gv, f in mod.functions_items() if gv.name_hint == name), None)
    if func is None:  # a TVM upgrade renamed it: fail the build rather than guess
        raise RuntimeError(f"TVM's paged KV cache no longer defines {name}")
    return passes.param_dtype(func, param)


def swap_stock(mod: tvm.IRModule, mine: dict[str, Callable[[], tirx.PrimFunc]]) -> tvm.IRModule:
    """Each PrimFunc named in `mine` replaced by what its maker builds, under the stock name."""
    names = {gv.name_hint: gv for gv in mod.get_global_vars()}
    missing = [name for name in mine if name not in names]
    if missing:  # a TVM upgrade renamed them: fail the build rather than run the slow ones
        raise RuntimeError(f"TVM's paged KV cache no longer defines {', '.join(missing)}")
    for name, make in mine.items():
        mod[names[name]] = make().with_attr("global_symbol", name)
    return mod
