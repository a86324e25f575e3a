"""Our CPU attention kernels against numpy softmax attention, on the layouts the paged KV cache
hands them (a chunk's ragged K/V beside its history in shuffled pages, sliding windows), and
against themselves: a query's output is the same bits wherever its prefill chunk was cut, and a
decode step's is the prefill's.

The kernels run tiles of 16 (query, q head) rows per kv head; the GQA cases below (groups 1, 4, 7
at head_dim 64 and 256, 3 at 40) use lengths whose tiles end mid-query and mid-key-block, so the
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
    from goinfer.compiler.tvm import targets

    target = targets.make_target(targets.host_target(2))
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


SCALE = 1.0


def _history(rng, k_all, v_all, lens, window: int | None, dtype):
    """Pages holding each sequence's first lens[b] keys (k_all[b], v_all[b]: (n, hkv, d)), in
    shuffled pages, as TVM's cache hands them: without a window every page, with one (a sliding
    layer) the pages from the one holding the window's first key, and length info (3, batch):
    last page length, the window's first slot, sink 0. Slots past the end hold NaN."""
    hkv, d = k_all[0].shape[1:]
    first_page = [0 if not window or n <= window else (n - window) // PAGE for n in lens]
    n_pages = [(n + PAGE - 1) // PAGE - f for n, f in zip(lens, first_page, strict=True)]
    pages = np.full((sum(n_pages) + 2, 2, hkv, PAGE, d), np.nan, dtype)
    values = rng.permutation(len(pages))[: sum(n_pages)].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    for b, n in enumerate(lens):
        for i in range(n_pages[b]):
            lo = (first_page[b] + i) * PAGE
            hi = min(lo + PAGE, n)
            for kv, src in ((0, k_all[b]), (1, v_all[b])):
                pages[values[indptr[b] + i], kv, :, : hi - lo] = src[lo:hi].transpose(1, 0, 2)
    last = np.array([(n - 1) % PAGE + 1 if n else 0 for n in lens], np.int32)
    if not window:
        return pages, values, indptr, last
    offset = [(n - window) % PAGE if n > window else 0 for n in lens]
    return pages, values, indptr, np.stack([last, offset, np.zeros(len(lens))]).astype(np.int32)


def _prefill(fn_plain, fn, q, k, v, q_indptr, hist, pages, values, indptr, info):
    """One prefill forward as the runtime routes it: mode 0 (sequences without history, no pages)
    then mode 1 (those with some), into the same output."""
    out = _tensor(np.full(q.shape, np.nan, q.dtype))
    lse = _tensor(np.full(q.shape[:2], np.nan, np.float32))
    n = len(q)
    hist_t, zeros = _tensor(hist), _tensor(np.zeros(n, np.int32))
    common = (1, 0, 1.0, 1e4, SCALE / np.sqrt(q.shape[2]), _tensor(k), _tensor(v), _tensor(q_indptr), hist_t)
    one = _tensor(np.zeros(1, np.int32))
    none = _tensor(np.zeros((1, 2, k.shape[1], PAGE, k.shape[2]), k.dtype))
    fn_plain(_tensor(q), _tensor(q_indptr), none, one, one, one, hist_t, zeros, out, lse, *common, 0)
    if (hist > 0).any():
        fn(_tensor(q), _tensor(q_indptr), _tensor(pages), _tensor(indptr), _tensor(values), _tensor(info),
           hist_t, zeros, out, lse, *common, 1)  # fmt: skip
    return out.numpy(), lse.numpy()


def _decode(fn, q, pages, values, indptr, info, positions):
    out = _tensor(np.full(q.shape, np.nan, q.dtype))
    lse = _tensor(np.full(q.shape[:2], np.nan, np.float32))
    zeros, pos = _tensor(np.zeros(len(q), np.int32)), _tensor(np.asarray(positions, np.int32))
    fn(_tensor(q), _tensor(pages), _tensor(indptr), _tensor(values), _tensor(info), zeros, pos,
       out, lse, 0, 1.0, 1e4, SCALE / np.sqrt(q.shape[2]))  # fmt: skip
    return out.numpy(), lse.numpy()


def _kernels(compiled, hkv, hq, d, dtype, window):
    get, attention = compiled
    key = f"{hkv}-{hq}-{d}-{dtype}"
    plain = get(f"prefill{key}", lambda: attention.prefill(hkv, hq, d, False, 0, dtype))
    prefill = get(
        f"prefill{key}w{window}", lambda: attention.prefill(hkv, hq, d, bool(window), window, dtype)
    )
    decode = get(f"decode{key}w{window}", lambda: attention.decode(hkv, hq, d, bool(window), window, dtype))
    return plain, prefill, decode


def _sequence(rng, n, hkv, hq, d, dtype):
    return _normal(rng, (n, hq, d), dtype), _normal(rng, (n, hkv, d), dtype), _normal(rng, (n, hkv, d), dtype)


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize(("hkv", "hq", "d", "dtype"), GQA_DTYPES)
def test_prefill_attends_to_history_and_chunk(compiled, hkv, hq, d, dtype, window):
    """A batch of chunks, one without history and three with (one history a page exactly, one
    past the window), each query over its history and the chunk up to itself (and its window)."""
    plain, prefill, _ = _kernels(compiled, hkv, hq, d, dtype, window)
    rng = np.random.default_rng(3)
    hist, n_q = np.array([0, 45, 90, 16], np.int32), [37, 11, 23, 1]
    seqs = [_sequence(rng, h + n, hkv, hq, d, dtype) for h, n in zip(hist, n_q, strict=True)]
    pages, values, indptr, info = _history(
        rng, [s[1] for s in seqs], [s[2] for s in seqs], hist, window, dtype
    )
    q = np.concatenate([s[0][h:] for s, h in zip(seqs, hist, strict=True)])
    k = np.concatenate([s[1][h:] for s, h in zip(seqs, hist, strict=True)])
    v = np.concatenate([s[2][h:] for s, h in zip(seqs, hist, strict=True)])
    q_indptr = np.concatenate([[0], np.cumsum(n_q)]).astype(np.int32)
    out, lse = _prefill(plain, prefill, q, k, v, q_indptr, hist, pages, values, indptr, info)
    g = hq // hkv
    for b, (qs, ks, vs) in enumerate(seqs):
        for i in range(n_q[b]):
            pos, row = hist[b] + i, q_indptr[b] + i
            lo = max(0, pos - window + 1) if window else 0
            for h in range(hq):
                _check(out, lse, row, h, qs[pos, h], ks[lo : pos + 1, h // g], vs[lo : pos + 1, h // g])


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize(("hkv", "hq", "d", "dtype"), GQA_DTYPES)
def test_decode_reads_the_page_table(compiled, hkv, hq, d, dtype, window):
    _, _, decode = _kernels(compiled, hkv, hq, d, dtype, window)
    rng = np.random.default_rng(4)
    lens = [1, 33, 64, 90]  # the new token's K/V already in its pages, as TVM appends first
    seqs = [_sequence(rng, n, hkv, hq, d, dtype) for n in lens]
    pages, values, indptr, info = _history(
        rng, [s[1] for s in seqs], [s[2] for s in seqs], lens, window, dtype
    )
    q = np.stack([s[0][-1] for s in seqs])
    out, lse = _decode(decode, q, pages, values, indptr, info, [n - 1 for n in lens])
    g = hq // hkv
    for b, (_, ks, vs) in enumerate(seqs):
        lo = max(0, lens[b] - window) if window else 0
        for h in range(hq):
            _check(out, lse, b, h, q[b, h], ks[lo:, h // g], vs[lo:, h // g])


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize(("hkv", "hq", "d", "dtype"), GQA_DTYPES)
def test_a_query_is_the_same_bits_wherever_its_chunk_began(compiled, hkv, hq, d, dtype, window):
    """The reuse contract (runtime/kv_pool.py): a query's output depends on its keys only. Prefill
    one 150-token sequence from many cut points (page boundaries and not, none) on, in chunks of
    the runtime's kind (shorter than the window): every query after the latest cut, and a decode
    step at each of the last positions, gives the same bits."""
    plain, prefill, decode = _kernels(compiled, hkv, hq, d, dtype, window)
    rng = np.random.default_rng(5)
    n, chunk = 150, 32
    qs, ks, vs = _sequence(rng, n, hkv, hq, d, dtype)
    cuts = [0, 1, 15, 16, 17, 64, 97, 128, 131]
    results = []
    for cut in cuts:
        outs, lses = [], []
        for start in range(cut, n, chunk):
            end = min(start + chunk, n)
            pages, values, indptr, info = _history(rng, [ks], [vs], [start], window, dtype)
            q_indptr = np.array([0, end - start], np.int32)
            out, lse = _prefill(plain, prefill, qs[start:end], ks[start:end], vs[start:end], q_indptr,
                                np.array([start], np.int32), pages, values, indptr, info)  # fmt: skip
            outs.append(out)
            lses.append(lse)
        out, lse = np.concatenate(outs), np.concatenate(lses)
        results.append((out[max(cuts) - cut :], lse[max(cuts) - cut :]))
    for cut, (out, lse) in zip(cuts[1:], results[1:], strict=True):
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1]), f"cut at {cut}"
    # decode steps for the last few positions, batched with a longer unrelated sequence
    other = _sequence(rng, 170, hkv, hq, d, dtype)
    for pos in (n - 3, n - 2, n - 1):
        pages, values, indptr, info = _history(rng, [ks[: pos + 1], other[1]], [vs[: pos + 1], other[2]],
                                               [pos + 1, 170], window, dtype)  # fmt: skip
        out, lse = _decode(decode, np.stack([qs[pos], other[0][-1]]), pages, values, indptr, info, [pos, 169])
        row = pos - max(cuts)
        assert np.array_equal(out[0], results[0][0][row]), f"decode at {pos}"
        assert np.array_equal(lse[0], results[0][1][row]), f"decode at {pos}"


def _check(out, lse, row, h, q, k, v, atol=2e-5):
    """Row `row`, head h of a kernel's output (in q's dtype) and lse against numpy over keys
    k, v (n, d)."""
    ref, ref_lse = _reference(q, k, v)
    got = out[row, h].astype(np.float64)
    np.testing.assert_allclose(got, ref, **_out_tol(str(q.dtype), atol), err_msg=f"row {row} head {h}")
    assert lse[row, h] == pytest.approx(ref_lse, abs=atol), f"row {row} head {h}"


def test_kernels_refuse_other_dtypes(compiled):
    _get, attention = compiled
    with pytest.raises(ValueError, match="bfloat16"):
        attention.decode(HKV, HQ, D, False, 0, "bfloat16")
