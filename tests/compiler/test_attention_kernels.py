"""Our CPU attention kernels against numpy softmax attention, on the layouts the paged KV cache
hands them (ragged prompt K/V, shuffled pages, sliding windows with a sink).

The prefill kernels run tiles of 16 (query, q head) rows per kv head; the GQA cases below (groups
1, 4, 7 at head_dim 64 and 256) use lengths whose tiles end mid-query and mid-key-block, so the
per-row causal limits, the edge blocks and the rows past the last query are all exercised.

Every kernel runs in both KV cache dtypes. In float16, q, K/V and the output are half: the inputs
are rounded to float16 once and numpy attends over those same values, in float64; the kernel widens
them and computes in float32, so only its output's rounding to float16 is allowed on top."""

from __future__ import annotations

import numpy as np
import pytest

HKV, HQ, D, PAGE = 2, 6, 32, 16
# (kv heads, q heads, head_dim): GQA groups 1, 4 (Gemma-3's shape), 7 (Qwen2.5-0.5B's), and 3
# with a head_dim that is no multiple of the kernels' 16 lanes
GQA = [(2, 2, 64), (1, 4, 256), (2, 14, 64), (1, 3, 40)]
DTYPES = ["float32", "float16"]
# float16 on two shapes, whose rows widen 16 lanes (Qwen's) and 8 lanes (d 40) at a time: the
# others would add only compile time to the fast tier
GQA_DTYPES = [(*shape, "float32") for shape in GQA] + [(2, 14, 64, "float16"), (1, 3, 40, "float16")]


@pytest.fixture(scope="module")
def compiled():
    import tvm
    from goinfer.compiler.kernels import attention
    from goinfer.compiler.lower import tvm_api

    target = tvm_api.make_target(tvm_api.host_target(2))
    cache = {}

    def get(name: str, make):
        if name not in cache:
            mod = tvm.IRModule({"main": make().with_attr("global_symbol", "main")})
            cache[name] = tvm.compile(mod, target=target)["main"]
        return cache[name]

    return get, attention


def _tensor(a):
    import tvm

    return tvm.runtime.tensor(np.ascontiguousarray(a))


def _normal(rng, shape, dtype="float32"):
    """Standard normal values in `dtype`: what the kernel reads, and numpy attends over."""
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _out_tol(dtype: str, atol: float) -> dict[str, float]:
    """The output's tolerance: float32's, plus float16's rounding of the stored output."""
    return {"atol": atol, "rtol": 2.0**-11 if dtype == "float16" else 0.0}


def _reference(q, k, v):
    """Softmax attention of q (d,) over k, v (n, d) in float64; lse in log2 units, as the cache
    keeps it."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = k @ q / np.sqrt(q.shape[0])
    p = np.exp(s - s.max())
    return p @ v / p.sum(), (s.max() + np.log(p.sum())) / np.log(2)


def _paged(rng, lens, hkv=HKV, d=D, dtype="float32"):
    """Pages in shuffled order holding sequences of the given lengths, and their (k, v) views.
    Slots past a sequence's length hold NaN, as no kernel may let them into a result."""
    n_pages = [(n + PAGE - 1) // PAGE for n in lens]
    pages = _normal(rng, (sum(n_pages) + 2, 2, hkv, PAGE, d), dtype)
    values = rng.permutation(len(pages))[: sum(n_pages)].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * PAGE for n, p in zip(lens, n_pages, strict=True)], np.int32)
    kv = []
    for b, n in enumerate(lens):
        pages[values[indptr[b + 1] - 1], :, :, last[b] :] = np.nan
        held = pages[values[indptr[b] : indptr[b + 1]]]  # (pages, 2, hkv, slot, d)
        k, v = (held[:, i].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n] for i in (0, 1))
        kv.append((k, v))
    return pages, values, indptr, last, kv


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_prefill_is_causal_attention(compiled, dtype):
    get, attention = compiled
    fn = get(f"ragged{dtype}", lambda: attention.prefill_ragged(HKV, HQ, D, dtype))
    rng = np.random.default_rng(0)
    lens = [37, 5]  # two prompts in one batch
    n = sum(lens)
    q, k, v = (_normal(rng, (n, h, D), dtype) for h in (HQ, HKV, HKV))
    indptr = np.array([0, lens[0], n], np.int32)
    out, lse = _tensor(np.zeros((n, HQ, D), dtype)), _tensor(np.zeros((n, HQ), np.float32))
    fn(_tensor(q), _tensor(indptr), _tensor(k), _tensor(v), _tensor(indptr),
       _tensor(np.zeros(n, np.int32)), _tensor(np.zeros(2, np.int32)), out, lse,
       1, 0, 1.0, 1e4, 1 / np.sqrt(D))  # fmt: skip
    for b in range(2):
        for i in range(indptr[b], indptr[b + 1]):
            for h in range(HQ):
                keys = slice(indptr[b], i + 1)
                _check(out.numpy(), lse.numpy(), i, h, q[i, h], k[keys, h // 3], v[keys, h // 3], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sliding", [False, True])
def test_paged_decode_reads_the_page_table(compiled, sliding, dtype):
    get, attention = compiled
    fn = get(f"decode{sliding}{dtype}", lambda: attention.decode_paged(HKV, HQ, D, sliding, dtype))
    rng = np.random.default_rng(1)
    lens = [21, 70]
    pages, values, indptr, last, kv = _paged(rng, lens, dtype=dtype)
    # sliding: sequence 1 keeps a sink of 3 slots, then slots 40.. (the window moved on)
    info = np.stack([last, [0, 40], [0, 3]]).astype(np.int32) if sliding else last
    q = _normal(rng, (2, HQ, D), dtype)
    out, lse = _tensor(np.zeros((2, HQ, D), dtype)), _tensor(np.zeros((2, HQ), np.float32))
    zeros = _tensor(np.zeros(2, np.int32))
    fn(_tensor(q), _tensor(pages), _tensor(indptr), _tensor(values), _tensor(info), zeros, zeros,
       out, lse, 0, 1.0, 1e4, 1 / np.sqrt(D))  # fmt: skip
    for b, n in enumerate(lens):
        visible = list(range(3)) + list(range(40, n)) if sliding and b == 1 else list(range(n))
        k, v = kv[b]
        for h in range(HQ):
            _check(out.numpy(), lse.numpy(), b, h, q[b, h], k[h // 3, visible], v[h // 3, visible], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sliding", "causal"), [(False, 0), (False, 1), (True, 1)])
def test_paged_prefill_masks_like_the_stock_kernel(compiled, sliding, causal, dtype):
    get, attention = compiled
    window = 24
    fn = get(f"prefill{sliding}{dtype}", lambda: attention.prefill_paged(HKV, HQ, D, sliding, window, dtype))
    rng = np.random.default_rng(2)
    lens, n_q = [37, 50], [4, 7]
    pages, values, indptr, last, kv = _paged(rng, lens, dtype=dtype)
    info = np.stack([last, [0, 0], [0, 0]]).astype(np.int32) if sliding else last
    q_indptr = np.array([0, n_q[0], sum(n_q)], np.int32)
    q = _normal(rng, (sum(n_q), HQ, D), dtype)
    out, lse = _paged_prefill(fn, q, q_indptr, pages, values, indptr, info, causal, D)
    for b, n in enumerate(lens):
        k, v = kv[b]
        for i in range(n_q[b]):
            if sliding:  # the chunk's query i sees the last window - i - 1 history slots
                lo, hi = max(n - max(window - i - 1, 0), 0), n
            else:
                lo, hi = 0, (min(n - n_q[b] + i + 1, n) if causal else n)
            row = q_indptr[b] + i
            for h in range(HQ):
                _check(out, lse, row, h, q[row, h], k[h // 3, lo:hi], v[h // 3, lo:hi], 1e-5)


def _check(out, lse, row, h, q, k, v, atol=2e-5):
    """Row `row`, head h of a kernel's output (in q's dtype) and lse against numpy over keys
    k, v (n, d)."""
    ref, ref_lse = _reference(q, k, v)
    got = out[row, h].astype(np.float64)
    np.testing.assert_allclose(got, ref, **_out_tol(str(q.dtype), atol), err_msg=f"row {row} head {h}")
    assert lse[row, h] == pytest.approx(ref_lse, abs=atol), f"row {row} head {h}"


def _ragged(fn, rng, lens, hkv, hq, d, causal=1, n_kv=None, dtype="float32"):
    """Run a ragged prefill over prompts of `lens` query tokens (and n_kv keys, default the same)."""
    n_kv = n_kv or lens
    q = _normal(rng, (sum(lens), hq, d), dtype)
    k, v = (_normal(rng, (sum(n_kv), hkv, d), dtype) for _ in range(2))
    q_indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(n_kv)]).astype(np.int32)
    out = _tensor(np.zeros((sum(lens), hq, d), dtype))
    lse = _tensor(np.zeros((sum(lens), hq), np.float32))
    fn(_tensor(q), _tensor(q_indptr), _tensor(k), _tensor(v), _tensor(kv_indptr),
       _tensor(np.zeros(sum(lens), np.int32)), _tensor(np.zeros(len(lens), np.int32)), out, lse,
       causal, 0, 1.0, 1e4, 1 / np.sqrt(d))  # fmt: skip
    return q, k, v, q_indptr, kv_indptr, out.numpy(), lse.numpy()


def _paged_prefill(fn, q, q_indptr, pages, values, indptr, info, causal, d):
    n = len(q)
    out, lse = _tensor(np.zeros(q.shape, q.dtype)), _tensor(np.zeros(q.shape[:2], np.float32))
    fn(_tensor(q), _tensor(q_indptr), _tensor(pages), _tensor(indptr), _tensor(values), _tensor(info),
       _tensor(np.zeros(len(q_indptr) - 1, np.int32)), _tensor(np.zeros(n, np.int32)), out, lse,
       causal, 0, 1.0, 1e4, 1 / np.sqrt(d))  # fmt: skip
    return out.numpy(), lse.numpy()


@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize(("hkv", "hq", "d", "dtype"), GQA_DTYPES)
def test_ragged_prefill_gqa(compiled, hkv, hq, d, causal, dtype):
    get, attention = compiled
    fn = get(f"ragged{hkv}-{hq}-{d}{dtype}", lambda: attention.prefill_ragged(hkv, hq, d, dtype))
    rng = np.random.default_rng(3)
    lens = [37, 1, 21]  # a one-token prompt too; no tile or key block divides these
    q, k, v, q_indptr, kv_indptr, out, lse = _ragged(fn, rng, lens, hkv, hq, d, causal, dtype=dtype)
    g = hq // hkv
    for b, n in enumerate(lens):
        for i in range(n):
            row = q_indptr[b] + i
            keys = slice(kv_indptr[b], kv_indptr[b] + (i + 1 if causal else n))
            for h in range(hq):
                _check(out, lse, row, h, q[row, h], k[keys, h // g], v[keys, h // g])


@pytest.mark.parametrize(("hkv", "hq", "d", "dtype"), GQA_DTYPES)
def test_ragged_prefill_more_keys_than_queries(compiled, hkv, hq, d, dtype):
    """Causal with n_kv > n_q: query i sees keys up to n_kv - n_q + i (the stock mask)."""
    get, attention = compiled
    fn = get(f"ragged{hkv}-{hq}-{d}{dtype}", lambda: attention.prefill_ragged(hkv, hq, d, dtype))
    rng = np.random.default_rng(4)
    q, k, v, _, _, out, lse = _ragged(fn, rng, [9], hkv, hq, d, 1, n_kv=[50], dtype=dtype)
    g = hq // hkv
    for i in range(9):
        for h in range(hq):
            _check(out, lse, i, h, q[i, h], k[: 50 - 9 + i + 1, h // g], v[: 50 - 9 + i + 1, h // g])


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize(("hkv", "hq", "d", "dtype"), GQA_DTYPES)
def test_paged_prefill_gqa(compiled, hkv, hq, d, sliding, dtype):
    """History in pages, causal (for sliding layers: the window mask, with a sink and a window
    that slid to a slot inside a page) and not."""
    get, attention = compiled
    window = 40
    fn = get(
        f"prefill{sliding}{hkv}-{hq}-{d}{dtype}",
        lambda: attention.prefill_paged(hkv, hq, d, sliding, window, dtype),
    )
    rng = np.random.default_rng(5)
    lens, n_q = [45, 90, 19], [11, 23, 1]
    pages, values, indptr, last, kv = _paged(rng, lens, hkv, d, dtype)
    # sliding: sequence 1 keeps a sink of 3 slots, then slots 37.. (the window moved on)
    offset, sink = [0, 37, 0], [0, 3, 0]
    info = np.stack([last, offset, sink]).astype(np.int32) if sliding else last
    if sliding:  # the slots that slid out: never read
        for pos in range(sink[1], offset[1]):
            pages[values[indptr[1] + pos // PAGE], :, :, pos % PAGE] = np.nan
    q_indptr = np.concatenate([[0], np.cumsum(n_q)]).astype(np.int32)
    q = _normal(rng, (sum(n_q), hq, d), dtype)
    g = hq // hkv
    for causal in (0, 1):
        out, lse = _paged_prefill(fn, q, q_indptr, pages, values, indptr, info, causal, d)
        for b, n in enumerate(lens):
            slots = np.r_[0 : sink[b], offset[b] : n] if sliding else np.arange(n)
            k, v = kv[b][0][:, slots], kv[b][1][:, slots]
            n_kv = len(slots)
            for i in range(n_q[b]):
                if not causal:
                    lo, hi = 0, n_kv
                elif sliding:  # the chunk's query i sees the last window - i - 1 of them
                    lo, hi = max(n_kv - max(window - i - 1, 0), 0), n_kv
                else:
                    lo, hi = 0, min(n_kv - n_q[b] + i + 1, n_kv)
                row = q_indptr[b] + i
                for h in range(hq):
                    _check(out, lse, row, h, q[row, h], k[h // g, lo:hi], v[h // g, lo:hi])


@pytest.mark.parametrize(("hkv", "hq", "d", "dtype"), GQA_DTYPES)
def test_chunked_prefill_merges_to_causal_attention(compiled, hkv, hq, d, dtype):
    """A later chunk as the cache runs it: the paged kernel over the history (causal=0), the
    ragged one over the chunk (causal), merged by lse, is causal attention over both."""
    get, attention = compiled
    ragged = get(f"ragged{hkv}-{hq}-{d}{dtype}", lambda: attention.prefill_ragged(hkv, hq, d, dtype))
    paged = get(
        f"prefillFalse{hkv}-{hq}-{d}{dtype}", lambda: attention.prefill_paged(hkv, hq, d, False, 40, dtype)
    )
    rng = np.random.default_rng(6)
    hist, lens = [35, 16], [29, 18]
    pages, values, indptr, last, kv = _paged(rng, hist, hkv, d, dtype)
    q, k, v, q_indptr, kv_indptr, out_c, lse_c = _ragged(ragged, rng, lens, hkv, hq, d, dtype=dtype)
    out_h, lse_h = _paged_prefill(paged, q, q_indptr, pages, values, indptr, last, 0, d)
    # the merge, in float32 as the cache's merge kernel computes it; in float16 each part was
    # rounded once, by up to 2^-11 of itself, and the merge weighs them: allow 2^-11 of the larger
    out_h, out_c = out_h.astype(np.float32), out_c.astype(np.float32)
    rounding = np.maximum(abs(out_h), abs(out_c)).max(-1) * (2.0**-11 if dtype == "float16" else 0.0)
    w_h, w_c = np.exp2(lse_h - np.maximum(lse_h, lse_c)), np.exp2(lse_c - np.maximum(lse_h, lse_c))
    out = (out_h * w_h[..., None] + out_c * w_c[..., None]) / (w_h + w_c)[..., None]
    lse = np.maximum(lse_h, lse_c) + np.log2(w_h + w_c)
    g = hq // hkv
    for b, n in enumerate(lens):
        for i in range(n):
            row = q_indptr[b] + i
            for h in range(hq):
                keys = np.concatenate([kv[b][0][h // g], k[kv_indptr[b] : kv_indptr[b] + i + 1, h // g]])
                vals = np.concatenate([kv[b][1][h // g], v[kv_indptr[b] : kv_indptr[b] + i + 1, h // g]])
                _check(out, lse, row, h, q[row, h], keys, vals, 2e-5 + float(rounding[row, h]))


@pytest.mark.parametrize(("hkv", "hq", "d", "dtype"), GQA_DTYPES)
def test_paged_decode_gqa(compiled, hkv, hq, d, dtype):
    get, attention = compiled
    fn = get(f"decodeFalse{hkv}-{hq}-{d}{dtype}", lambda: attention.decode_paged(hkv, hq, d, False, dtype))
    rng = np.random.default_rng(7)
    lens = [1, 33, 64]
    pages, values, indptr, last, kv = _paged(rng, lens, hkv, d, dtype)
    q = _normal(rng, (len(lens), hq, d), dtype)
    out = _tensor(np.zeros((len(lens), hq, d), dtype))
    lse = _tensor(np.zeros((len(lens), hq), np.float32))
    zeros = _tensor(np.zeros(len(lens), np.int32))
    fn(_tensor(q), _tensor(pages), _tensor(indptr), _tensor(values), _tensor(last), zeros, zeros,
       out, lse, 0, 1.0, 1e4, 1 / np.sqrt(d))  # fmt: skip
    g = hq // hkv
    for b in range(len(lens)):
        for h in range(hq):
            _check(out.numpy(), lse.numpy(), b, h, q[b, h], kv[b][0][h // g], kv[b][1][h // g])


def test_kernels_refuse_other_dtypes(compiled):
    _get, attention = compiled
    with pytest.raises(ValueError, match="bfloat16"):
        attention.decode_paged(HKV, HQ, D, False, "bfloat16")
