"""CPU attention kernels for TVM's paged KV cache, in place of its stock CPU ones.

TVM's CPU kernels (relax.frontend.nn.llm) are scalar and serial: one thread walks every query,
head and key. Measured on Qwen-0.5B, 2 threads, a 512-token prompt spent 5.1 s of 16 s in them.
These keep the stock signatures (the cache's C++ side calls them by position) and change how
they run. Scores are in log2 units (scaled by log2(e)) and `lse` is log2-based, as the stock
kernels leave them for the cache's merge kernel.

Decode (one query per sequence): one parallel task per (sequence, q head), keys in blocks of
KEY_BLOCK with an online softmax (the output rescaled once per block), the block's dot products
reduced together and its weights computed as one vector (see `_attend`). Against the stock
kernels: Qwen-0.5B decode 22 -> 31-35 tok/s, most of it here.

Prefill (ragged: the chunk attending to itself; paged: the chunk attending to the history, and its
sliding-window variant) ran the same way, one task per (query, q head), and was bound by loading
every key row once per query and head. It now runs tiles (`_prefill_tile`):

1. GQA: a tile is ROWS = 16 (query, q head) rows of one kv head, so a key or value row is loaded
   once for all the group's heads (Qwen 7, Gemma 4) and for ROWS / group queries.
2. Query tiling: the 16 rows are the 16 lanes of a vector, queries transposed into columns: a key
   element, broadcast, multiplies one column of all 16 rows, with no horizontal sums; softmax
   (max, exp2, sum) runs on 16 rows at once; each row keeps its own key range, so the causal and
   sliding masks hold inside a tile that spans several queries (and ends mid-query's heads).
3. Registers: the 16 score accumulators and 8 output columns x 16 rows stay in registers through
   the head_dim loops (small buffers inside the task); exp2 is a polynomial on vectors (T.exp2 is a
   libm call per lane); key blocks are pages, read in place (a partial one is copied, so no slot
   past a sequence's end is read); tiles go to threads zigzag, so causal work splits evenly.

Measured, 2 threads, one layer's kernel (tests' calling convention; min of repeats, old and new in
one process): Gemma-3-270M shape (4 q / 1 kv heads, d 256) ragged 256 tokens 5.7 -> 1.6 ms, 512
tokens 21.3 -> 5.6 ms (25 -> 96 GFLOP/s), paged 256 over 256 of history 9.1 -> 2.8 ms (sliding)
and 11.0 -> 2.9 ms; Qwen2.5-0.5B shape (14 / 2 heads, d 64) ragged 512 tokens 33.1 -> 5.0 ms.
Decode unchanged. The inner loops run near this machine's broadcast-FMA rate (~3 G vector FMA/s a
core); the rest is the per-block softmax and the transposes in and out.

The stock paged prefill (history attention in chunked prefill) also reads `scale_O[d_idx]` from a
one-element buffer, i.e. past its end; tests/test_attention_kernels.py holds ours to numpy.

Every kernel takes the cache's dtype (`dtype`: float32 or float16) for q, the K/V (pages or the
ragged chunk) and the output, as TVM's cache hands them all in its one dtype; lse is float32 either
way. A float16 kernel loads half, widens to float32 (LLVM's fpext: vcvtph2ps with F16C or
AVX-512), computes exactly as the float32 one, and narrows only the output it stores. The float32
kernels are unchanged by this (`_as` adds no cast to a value already float32). Measured, Qwen2.5-0.5B
shape, 2 threads, each call on one of 24 page pools in turn (a step's layers, so the KV comes from
memory): decode over 1k / 4k / 16k keys takes 0.87-0.96 / 0.81 / 0.62 of the float32 time (16k:
159 -> 99 ns a key); prefill, which widens each block into its copy, 8% longer (512-token ragged
2.77 -> 2.98 ms, 256 over 1024 of history 4.94 -> 5.36 ms).

Only RopeMode.NONE is supported (the models apply RoPE themselves): `rotary_mode` must be 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..lower import tvm_api, tvmscript
from .paging import PAGE_SIZE
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


def _attend(d: int, key_row, value_offset: int, paged_blocks: bool, dtype: str):
    """The decode core: query `row` of qf attends to keys first .. first + n_keys - 1 and writes
    row `row` of the output (in `dtype`) and lse. `key_row(where, j)` gives key j's row in the
    flattened K/V buffer (the kernel's addressing; `where` carries what it needs), and its value's
    row is `value_offset` rows on. With `paged_blocks`, a block's keys are one page's consecutive
    rows.

    A block of KEY_BLOCK keys at a time, all vector work:
    1. each key's dot product as vl partial sums (independent FMA chains across the block's keys);
    2. the partials reduced for all keys at once by a transpose tree (`_pair_sums`): no horizontal
       sum per key, and the block's scores come out as one vector in key order;
    3. softmax weights with the vector exp2 polynomial (T.exp2 is a libm call per lane), a masked
       key's weight exactly 0;
    4. output += weight x value row, d / vl independent accumulators.
    Against one key at a time (a horizontal sum and a libm exp2f per key and head, and local
    scalars, see tests/test_kernel_locals.py), 2 threads, one layer, min of interleaved runs:
    SmolLM2 shape (9 q / 3 kv heads, d 64) 64 keys 13.0 -> 4.5 us, 512 keys 53.5 -> 26.4 us;
    Qwen2.5-0.5B (14 / 2) 12.4 -> 5.0 and 95.7 -> 43.9 us; Gemma-3 (4 / 1, d 256) 11.3 -> 10.4 and
    63.6 -> 55.7 us. Also tried: a task per (kv head, key range) with the group's heads sharing each
    block and a merge pass (flash-decoding). It gained 20-30% at 2048 keys with d 64, but lost at
    64 keys (fewer tasks than threads to share) and at d 256 everywhere, so it is not kept."""
    vl = _lanes(d)
    chunks = d // vl
    KB = KEY_BLOCK

    def at(c):
        return T.ramp(c * vl, 1, vl)

    def live(blk, n_keys):  # which of the block's keys exist (a bool vector cannot be bound)
        return T.ramp(blk * KB, 1, KB) < T.Broadcast(n_keys, KB)

    def dot(qf, kf, row, krow):  # q . k as vl partial sums: one FMA chain over d / vl chunks
        acc = _f32(qf[row, at(0)]) * _f32(kf[krow, at(0)])
        for c in range(1, chunks):
            acc = acc + _f32(qf[row, at(c)]) * _f32(kf[krow, at(c)])
        return acc

    @T.macro
    def attend(qf, kf, vf, of, lf, row, where, first, n_keys, scale):
        o = T.alloc_buffer((d,), "float32")
        krow = T.alloc_buffer((KB,), "int32")
        p = T.alloc_buffer((KB,), "float32")
        state = T.alloc_buffer((2,), "float32")  # running max, running sum
        for c in T.unroll(chunks):
            o[at(c)] = T.Broadcast(T.float32(0), vl)
        state[0] = T.float32(_MIN)
        state[1] = T.float32(0)
        for blk in T.serial((n_keys + KB - 1) // KB):
            if paged_blocks:  # one page lookup a block
                base = T.Bind(key_row(where, first + blk * KB))
                for jj in T.serial(KB):
                    krow[jj] = base + T.min(jj, n_keys - 1 - blk * KB)  # past the end: valid, masked
            else:
                for jj in T.serial(KB):
                    krow[jj] = key_row(where, first + T.min(blk * KB + jj, n_keys - 1))
            dots = _pair_sums([dot(qf, kf, row, krow[jj]) for jj in range(KB)], vl)
            scores = T.Bind(T.Select(live(blk, n_keys), dots * T.Broadcast(scale, KB), _splat(_MIN)))
            p[T.ramp(0, 1, KB)] = scores
            # online softmax: fold this block into the running max/sum, rescale the output once
            m_new = T.Bind(T.max(state[0], _tree(T.max, [p[jj] for jj in range(KB)])))
            alpha = T.Bind(T.exp2(state[0] - m_new))
            weights = T.Bind(_weight(scores - T.Broadcast(m_new, KB)))
            p[T.ramp(0, 1, KB)] = T.Select(live(blk, n_keys), weights, _splat(0))
            state[0] = m_new
            state[1] = state[1] * alpha + _tree(_add, [p[jj] for jj in range(KB)])
            for c in T.unroll(chunks):
                o[at(c)] = o[at(c)] * T.Broadcast(alpha, vl)
            for jj in T.unroll(KB):
                for c in T.unroll(chunks):
                    o[at(c)] = o[at(c)] + _f32(vf[krow[jj] + value_offset, at(c)]) * T.Broadcast(p[jj], vl)
        inv = T.Bind(T.float32(1) / T.max(state[1], T.float32(1e-30)))  # no keys: output 0, not NaN
        for c in T.unroll(chunks):
            of[row, at(c)] = _as(dtype, o[at(c)] * T.Broadcast(inv, vl))
        lf[row] = state[0] + T.log2(T.max(state[1], T.float32(1e-30)))

    return attend


def _pair_sums(vectors: list, vl: int):
    """n vectors of vl partial sums each (one per key) -> the n totals as one n-lane vector, in
    order. Each level adds neighbouring lanes of two vectors into one (two shuffles and an add):
    a vector then holds twice the keys, with half the partials each. Called while a kernel is
    parsed: every vector is bound once (T.Bind), or each use would copy its whole subtree."""
    evens = [2 * i for i in range(vl)]
    odds = [2 * i + 1 for i in range(vl)]
    partials = vl
    vectors = [T.Bind(v) for v in vectors]
    while partials > 1:
        vectors = [
            T.Bind(T.Shuffle([a, b], evens) + T.Shuffle([a, b], odds))
            for a, b in zip(vectors[0::2], vectors[1::2], strict=True)
        ]
        partials //= 2
    return vectors[0] if len(vectors) == 1 else T.Shuffle(vectors, list(range(len(vectors) * vl)))


def _splat(x):
    return T.Broadcast(T.float32(x), KEY_BLOCK)


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


def _prefill_tile(d: int, h_kv: int, h_q: int, stride: int, aligned: bool, block_at, dtype: str):
    """The prefill core: `attend(...)` runs one tile of ROWS query rows against its keys.

    A tile's rows are (query, q head) pairs of one kv head, query-major (row f of a sequence is
    query f // group, head hk * group + f % group): ROWS / group queries times the group's heads,
    possibly ending part-way through a query's heads. Each row has its own key range
    [lo_b[r], hi_b[r]), so the causal and sliding masks hold inside a tile.

    Keys come in runs (segments) [a, b) whose key j sits at position p = j + shift of the
    sequence's storage; `block_at(where, p, kv)` is the flat offset of the key (kv=0) or value
    (kv=1) row at p, and the rows at p, p+1, ... are `stride` apart up to the next multiple of
    KEY_BLOCK (a page) when `aligned`, or for good otherwise (the ragged K/V).

    q, K/V and the output are `dtype`. float32 K/V blocks are read in place; float16 ones are
    widened into the edge blocks' float32 copy first (a key element, broadcast, then is one load
    as in float32; the copy costs one conversion per element against ROWS x 2 FMAs)."""
    assert KEY_BLOCK == PAGE_SIZE
    R, KB, group = ROWS, KEY_BLOCK, h_q // h_kv
    U = math.gcd(d, PV_UNROLL)
    vl = _lanes(d)  # edge copies, vl floats at a time

    def at(i):  # the i-th vector of ROWS lanes
        return T.ramp(i * R, 1, R)

    def over_keys(op, s):  # op over the block's KB vectors s[at(jj)], as a balanced tree
        return _tree(op, [s[at(jj)] for jj in range(KB)])

    def sees(j, lo, hi):  # which rows see key j
        return T.And(_vec(j) >= lo, _vec(j) < hi)

    def pick(segs, seg, i):  # field i of segment `seg` (a loop variable) of the Python tuple
        value = segs[-1][i]
        for k in range(len(segs) - 1):
            value = T.if_then_else(seg == k, segs[k][i], value)
        return value

    def q_row(q0, hk, f):
        return (q0 + f // group) * h_q + hk * group + f % group

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
    def attend(qf, of, lf, q0, hk, tile, n_rows, scale, lo_b, hi_b, ksrc, vsrc, where, segs):
        qt = T.alloc_buffer((d * R,), "float32")  # the tile's queries, transposed: qt[c, row]
        ot = T.alloc_buffer((d * R,), "float32")  # its output, transposed
        kb = T.alloc_buffer((KB * d,), "float32")  # an edge (or float16) block's keys, copied
        vb = T.alloc_buffer((KB * d,), "float32")
        s = T.alloc_buffer((KB * R,), "float32")  # scores, then weights: [key, row]
        acc = T.alloc_buffer((U * R,), "float32")
        ms = T.alloc_buffer((R,), "float32")  # running max
        ls = T.alloc_buffer((R,), "float32")  # running sum
        span = T.alloc_buffer((2,), "int32")  # the keys any row sees
        bounds = T.alloc_buffer((3,), "int32")
        rows = T.alloc_buffer((R,), "int32")  # each row's q / output row (past the last: the last's)
        span[0] = T.int32(2**31 - 1)
        span[1] = 0
        for r in T.serial(R):
            rows[r] = q_row(q0, hk, T.min(tile * R + r, n_rows - 1))
            if tile * R + r >= n_rows:  # past the last query: sees nothing, written nowhere
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
        for seg in T.serial(len(segs)):
            # the segment's keys [a, b) and shift, kept in memory: as bound values LLVM
            # specializes the segment loop and a sliding kernel takes 10x as long to compile
            bounds[0] = T.max(span[0], pick(segs, seg, 0))
            bounds[1] = T.min(span[1], pick(segs, seg, 1))
            bounds[2] = pick(segs, seg, 2)
            a, b, shift = T.meta_var((bounds[0], bounds[1], bounds[2]))
            if a < b:
                lo = T.Bind(T.max(lo_b[at(0)], _vec(a)))  # each row's range, cut to this segment
                hi = T.Bind(T.min(hi_b[at(0)], _vec(b)))
                p_start = T.Bind((a + shift) // KB * KB if aligned else a + shift)
                for blk in T.serial((b + shift - p_start + KB - 1) // KB):
                    j0 = T.Bind(p_start + blk * KB - shift)
                    if j0 >= a and j0 + KB <= b:  # KB real keys, contiguous: read in place
                        k0 = T.Bind(block_at(where, j0 + shift, 0))
                        v0 = T.Bind(block_at(where, j0 + shift, 1))
                        if in_place:
                            block(ksrc, k0, vsrc, v0, stride, j0, lo, hi, qt, ot, s, ms, ls, acc)
                        else:  # float16: widened into kb / vb first
                            for jj in T.serial(KB):
                                copy_row(kb, vb, jj, ksrc, k0 + jj * stride, vsrc, v0 + jj * stride)
                            block(kb, 0, vb, 0, d, j0, lo, hi, qt, ot, s, ms, ls, acc)
                    else:  # an edge: copy the real keys, zeros elsewhere (masked; never garbage)
                        for jj in T.serial(KB):
                            if j0 + jj >= a and j0 + jj < b:
                                k_row = T.Bind(block_at(where, j0 + jj + shift, 0))
                                v_row = T.Bind(block_at(where, j0 + jj + shift, 1))
                                copy_row(kb, vb, jj, ksrc, k_row, vsrc, v_row)
                            else:
                                for c in T.serial(d // vl):
                                    kb[T.ramp(jj * d + c * vl, 1, vl)] = T.Broadcast(T.float32(0), vl)
                                    vb[T.ramp(jj * d + c * vl, 1, vl)] = T.Broadcast(T.float32(0), vl)
                        block(kb, 0, vb, 0, d, j0, lo, hi, qt, ot, s, ms, ls, acc)
        ls[at(0)] = T.max(ls[at(0)], _vec(T.float32(1e-30)))  # no keys: output 0, not NaN
        for r in T.serial(R):
            if tile * R + r < n_rows:
                lf[rows[r]] = ms[r] + T.log2(ls[r])
        ls[at(0)] = _vec(T.float32(1)) / ls[at(0)]  # now 1 / sum
        for r in T.serial(R):
            if tile * R + r < n_rows:
                for c in T.serial(d):
                    of[rows[r], c] = _as(dtype, ot[c * R + r] * ls[r])

    return attend


def prefill_ragged(h_kv: int, h_q: int, d: int, dtype: str = "float32") -> tirx.PrimFunc:
    """Prompt tokens attending to themselves (causal), the stock `batch_prefill_ragged_kv`'s
    signature. K/V rows are [token, kv head]: key j of a sequence is row (kv start + j, hk)."""
    check_dtype(dtype)
    group = h_q // h_kv

    def block_at(where, p, kv):  # where = (first key token, kv head); K and V are two buffers
        return ((where[0] + p) * h_kv + where[1]) * d

    attend = _prefill_tile(d, h_kv, h_q, h_kv * d, False, block_at, dtype)

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
        q = T.match_buffer(var_q, (qo_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_off)
        k = T.match_buffer(var_k, (kv_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_off)
        T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=qr_off)
        T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=kr_off)
        output = T.match_buffer(var_output, (qo_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")
        assert rotary_mode == 0, "goinfer's attention kernels expect RoPE applied by the model"
        # the same memory as rows of d ((token, head) -> row), and K/V flat
        qf = T.decl_buffer((qo_len * h_q, d), dtype, data=q.data)
        kf = T.decl_buffer((kv_len * h_kv * d,), dtype, data=k.data)
        vf = T.decl_buffer((kv_len * h_kv * d,), dtype, data=v.data)
        of = T.decl_buffer((qo_len * h_q, d), dtype, data=output.data)
        lf = T.decl_buffer((qo_len * h_q,), "float32", data=lse.data)
        for b in T.serial(batch_size):
            n_q = T.Bind(q_indptr[b + 1] - q_indptr[b])
            n_kv = T.Bind(kv_indptr[b + 1] - kv_indptr[b])
            n_tiles = T.Bind((n_q * group + ROWS - 1) // ROWS)
            # a task per (tile of 16 query x head rows, kv head), 128 for Gemma's 512 tokens and
            # 448 for Qwen's; 512-token prompt: 21.3 -> 5.6 ms (Gemma), 33.1 -> 5.0 ms (Qwen)
            for task in T.parallel(n_tiles * h_kv):
                hk = T.Bind(task % h_kv)
                tile = T.Bind(_zigzag(task // h_kv, n_tiles))
                lo_b = T.alloc_buffer((ROWS,), "int32")  # each row's keys [lo, hi)
                hi_b = T.alloc_buffer((ROWS,), "int32")
                for r in T.serial(ROWS):  # causal: query qi sees keys up to its own position
                    qi = T.Bind((tile * ROWS + r) // group)
                    lo_b[r] = 0
                    hi_b[r] = T.if_then_else(causal > 0, T.min(n_kv - n_q + qi + 1, n_kv), n_kv)
                segs = T.meta_var(((0, n_kv, 0),))
                attend(qf, of, lf, q_indptr[b], hk, tile, n_q * group, sm_scale * LOG2E,
                       lo_b, hi_b, kf, vf, (kv_indptr[b], hk), segs)  # fmt: skip

    return attention_prefill_ragged


def decode_paged(h_kv: int, h_q: int, d: int, sliding: bool, dtype: str = "float32") -> tirx.PrimFunc:
    """One new token per sequence over its paged history, the stock `batch_decode_paged_kv`'s
    signature. With `sliding`, length_info is (3, batch): last page length, window offset, sink."""
    check_dtype(dtype)
    attend = _paged_attend(h_kv, h_q, d, sliding, dtype)

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
        q = T.match_buffer(q_handle, (batch, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_pages, 2, h_kv, PAGE_SIZE, d), dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (batch + 1,), "int32", elem_offset=ip_off)
        page_values = T.match_buffer(page_values_handle, (nnz_pages,), "int32", elem_offset=pv_off)
        info = T.match_buffer(var_length_info, _info_shape(sliding, batch), "int32", elem_offset=li_off)
        T.match_buffer(k_rope_pos_offset_handle, (batch,), "int32", elem_offset=kr_off)
        T.match_buffer(q_rope_position_handle, (batch,), "int32", elem_offset=qr_off)
        output = T.match_buffer(output_handle, (batch, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (batch, h_q), "float32")
        assert rotary_mode == 0, "goinfer's attention kernels expect RoPE applied by the model"
        qf = T.decl_buffer((batch * h_q, d), dtype, data=q.data)
        # pages (page, k|v, kv head, slot, d) seen as rows of d
        pf = T.decl_buffer((max_pages * 2 * h_kv * PAGE_SIZE, d), dtype, data=pages.data)
        of = T.decl_buffer((batch * h_q, d), dtype, data=output.data)
        lf = T.decl_buffer((batch * h_q,), "float32", data=lse.data)
        for task in T.parallel(batch * h_q):
            b = T.Bind(task // h_q)
            h = T.Bind(task % h_q)
            first = T.Bind(page_indptr[b])
            n_pages = T.Bind(page_indptr[b + 1] - first)
            n_keys = T.Bind(T.if_then_else(n_pages > 0, _kv_len(info, sliding, b, n_pages), 0))
            where = T.meta_var((page_values, first, info, b, h))
            attend(qf, pf, pf, of, lf, task, where, 0, n_keys, sm_scale * LOG2E)

    return attention_decode_paged


def prefill_paged(
    h_kv: int, h_q: int, d: int, sliding: bool, window: int, dtype: str = "float32"
) -> tirx.PrimFunc:
    """Prompt tokens attending to the paged history of their sequence, the stock
    `batch_prefill_paged_kv_cpu`'s signature (its causal mask, and for sliding layers its
    "cross" mask: query i of the chunk sees the last window - i - 1 history slots)."""
    check_dtype(dtype)
    group = h_q // h_kv
    window = window if sliding else 0

    def block_at(where, p, kv):  # where = (page table values, first page, kv head)
        values, first, hk = where
        page = values[first + p // PAGE_SIZE]
        return (((page * 2 + kv) * h_kv + hk) * PAGE_SIZE + p % PAGE_SIZE) * d

    attend = _prefill_tile(d, h_kv, h_q, d, True, block_at, dtype)

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
        q = T.match_buffer(var_q, (total, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch + 1,), "int32", elem_offset=qi_off)
        pages = T.match_buffer(var_pages, (max_pages, 2, h_kv, PAGE_SIZE, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch + 1,), "int32", elem_offset=ip_off)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=pv_off)
        info = T.match_buffer(var_length_info, _info_shape(sliding, batch), "int32", elem_offset=li_off)
        T.match_buffer(var_k_rope_pos_offset, (batch,), "int32", elem_offset=kr_off)
        T.match_buffer(var_q_rope_position, (total,), "int32", elem_offset=qr_off)
        output = T.match_buffer(var_output, (total, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total, h_q), "float32")
        assert rotary_mode == 0, "goinfer's attention kernels expect RoPE applied by the model"
        qf = T.decl_buffer((total * h_q, d), dtype, data=q.data)
        pf = T.decl_buffer((max_pages * 2 * h_kv * PAGE_SIZE * d,), dtype, data=pages.data)
        of = T.decl_buffer((total * h_q, d), dtype, data=output.data)
        lf = T.decl_buffer((total * h_q,), "float32", data=lse.data)
        for b in T.serial(batch):
            n_q = T.Bind(q_indptr[b + 1] - q_indptr[b])
            n_pages = T.Bind(page_indptr[b + 1] - page_indptr[b])
            n_kv = T.Bind(T.if_then_else(n_pages > 0, _kv_len(info, sliding, b, n_pages), 0))
            n_tiles = T.Bind((n_q * group + ROWS - 1) // ROWS)
            # as the ragged kernel, keys read from their pages; Gemma, 256 queries over 256 slots
            # of history: 9.1 -> 2.8 ms (sliding), 11.0 -> 2.9 ms
            for task in T.parallel(n_tiles * h_kv):
                hk = T.Bind(task % h_kv)
                tile = T.Bind(_zigzag(task // h_kv, n_tiles))
                lo_b = T.alloc_buffer((ROWS,), "int32")  # each row's keys [lo, hi)
                hi_b = T.alloc_buffer((ROWS,), "int32")
                for r in T.serial(ROWS):
                    lo_b[r] = _visible(causal, window, n_kv, n_q, (tile * ROWS + r) // group)[0]
                    hi_b[r] = _visible(causal, window, n_kv, n_q, (tile * ROWS + r) // group)[1]
                where = T.meta_var((page_values, page_indptr[b], hk))
                segs = T.meta_var(_segments(info, sliding, b, n_kv))
                attend(qf, of, lf, q_indptr[b], hk, tile, n_q * group, sm_scale * LOG2E,
                       lo_b, hi_b, pf, pf, where, segs)  # fmt: skip

    return attention_prefill_paged


def _visible(causal, window: int, n_kv, n_q, qi):
    """The run [lo, hi) of history slots query qi of an n_q-token chunk sees (the stock masks)."""
    if window > 0:  # sliding layers, causal: the last window - qi - 1 slots
        lo = T.if_then_else(causal > 0, T.max(n_kv - T.max(window - qi - 1, 0), 0), 0)
        return lo, n_kv
    return 0, T.if_then_else(causal > 0, T.min(n_kv - n_q + qi + 1, n_kv), n_kv)


def _segments(info, sliding: bool, b, n_kv):
    """The runs (first key, end, shift) of visible keys whose slots are key + shift: without a
    window, all of them at their own slots; with one, the sink at slots 0.., then the window."""
    if not sliding:
        return ((0, n_kv, 0),)
    sink = T.min(info[2, b], n_kv)
    return ((0, sink, 0), (sink, n_kv, info[1, b] - info[2, b]))


def _paged_attend(h_kv: int, h_q: int, d: int, sliding: bool, dtype: str):
    """The core, addressing keys in pages: where = (page table values, first page, length info,
    sequence, head)."""
    group = h_q // h_kv

    def slot(where, j, kv):
        values, first, info, b, h = where
        pos = _seq_pos(info, sliding, b, j)
        page = values[first + pos // PAGE_SIZE]
        return ((page * 2 + kv) * h_kv + h // group) * PAGE_SIZE + pos % PAGE_SIZE

    # a page holds all kv heads' keys, then their values: a value is h_kv * PAGE_SIZE rows on
    return _attend(d, lambda where, j: slot(where, j, 0), h_kv * PAGE_SIZE, not sliding, dtype)


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
    window, as the cache was built with; the dtype is the one the cache's stock kernels take."""
    dt = stock_dtype(mod, DECODE, 1)  # its pages
    mine = {
        RAGGED: lambda: prefill_ragged(h_kv, h_q, d, dt),
        PREFILL: lambda: prefill_paged(h_kv, h_q, d, sliding=False, window=window, dtype=dt),
        PREFILL_SLIDING: lambda: prefill_paged(h_kv, h_q, d, sliding=True, window=window, dtype=dt),
        DECODE: lambda: decode_paged(h_kv, h_q, d, sliding=False, dtype=dt),
        DECODE_SLIDING: lambda: decode_paged(h_kv, h_q, d, sliding=True, dtype=dt),
    }
    return swap_stock(mod, mine)


def stock_dtype(mod: tvm.IRModule, name: str, param: int) -> str:
    """The element type of parameter `param` of the stock kernel `name` in `mod`: the dtype the
    cache was built with, so ours take what its C++ side hands them."""
    func = next((f for gv, f in mod.functions_items() if gv.name_hint == name), None)
    if func is None:  # a TVM upgrade renamed it: fail the build rather than guess
        raise RuntimeError(f"TVM's paged KV cache no longer defines {name}")
    return tvm_api.param_dtype(func, param)


def swap_stock(mod: tvm.IRModule, mine: dict[str, Callable[[], tirx.PrimFunc]]) -> tvm.IRModule:
    """Each PrimFunc named in `mine` replaced by what its maker builds, under the stock name."""
    names = {gv.name_hint: gv for gv in mod.get_global_vars()}
    missing = [name for name in mine if name not in names]
    if missing:  # a TVM upgrade renamed them: fail the build rather than run the slow ones
        raise RuntimeError(f"TVM's paged KV cache no longer defines {', '.join(missing)}")
    for name, make in mine.items():
        mod[names[name]] = make().with_attr("global_symbol", name)
    return mod
