"""Our CPU attention kernels against numpy softmax attention, on the layouts the paged KV cache
hands them (ragged prompt K/V, shuffled pages, sliding windows with a sink)."""

from __future__ import annotations

import numpy as np
import pytest

HKV, HQ, D, PAGE = 2, 6, 32, 16


@pytest.fixture(scope="module")
def compiled():
    import tvm
    from goinfer.compiler.lower import attention, tvm_api

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


def _reference(q, k, v):
    """Softmax attention of q (d,) over k, v (n, d); lse in log2 units, as the cache keeps it."""
    s = k @ q / np.sqrt(q.shape[0])
    p = np.exp(s - s.max())
    return p @ v / p.sum(), (s.max() + np.log(p.sum())) / np.log(2)


def _paged(rng, lens):
    """Pages in shuffled order holding sequences of the given lengths, and their (k, v) views."""
    n_pages = [(n + PAGE - 1) // PAGE for n in lens]
    pages = rng.standard_normal((sum(n_pages) + 2, 2, HKV, PAGE, D)).astype(np.float32)
    values = rng.permutation(len(pages))[: sum(n_pages)].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * PAGE for n, p in zip(lens, n_pages, strict=True)], np.int32)
    kv = []
    for b, n in enumerate(lens):
        held = pages[values[indptr[b] : indptr[b + 1]]]  # (pages, 2, hkv, slot, d)
        k, v = (held[:, i].transpose(1, 0, 2, 3).reshape(HKV, -1, D)[:, :n] for i in (0, 1))
        kv.append((k, v))
    return pages, values, indptr, last, kv


def test_ragged_prefill_is_causal_attention(compiled):
    get, attention = compiled
    fn = get("ragged", lambda: attention.prefill_ragged(HKV, HQ, D))
    rng = np.random.default_rng(0)
    lens = [37, 5]  # two prompts in one batch
    n = sum(lens)
    q, k, v = (rng.standard_normal((n, h, D)).astype(np.float32) for h in (HQ, HKV, HKV))
    indptr = np.array([0, lens[0], n], np.int32)
    out, lse = _tensor(np.zeros((n, HQ, D), np.float32)), _tensor(np.zeros((n, HQ), np.float32))
    fn(_tensor(q), _tensor(indptr), _tensor(k), _tensor(v), _tensor(indptr),
       _tensor(np.zeros(n, np.int32)), _tensor(np.zeros(2, np.int32)), out, lse,
       1, 0, 1.0, 1e4, 1 / np.sqrt(D))  # fmt: skip
    for b in range(2):
        for i in range(indptr[b], indptr[b + 1]):
            for h in range(HQ):
                keys = slice(indptr[b], i + 1)
                ref, ref_lse = _reference(q[i, h], k[keys, h // 3], v[keys, h // 3])
                np.testing.assert_allclose(out.numpy()[i, h], ref, atol=1e-5)
                assert lse.numpy()[i, h] == pytest.approx(ref_lse, abs=1e-5)


@pytest.mark.parametrize("sliding", [False, True])
def test_paged_decode_reads_the_page_table(compiled, sliding):
    get, attention = compiled
    fn = get(f"decode{sliding}", lambda: attention.decode_paged(HKV, HQ, D, sliding))
    rng = np.random.default_rng(1)
    lens = [21, 70]
    pages, values, indptr, last, kv = _paged(rng, lens)
    # sliding: sequence 1 keeps a sink of 3 slots, then slots 40.. (the window moved on)
    info = np.stack([last, [0, 40], [0, 3]]).astype(np.int32) if sliding else last
    q = rng.standard_normal((2, HQ, D)).astype(np.float32)
    out, lse = _tensor(np.zeros((2, HQ, D), np.float32)), _tensor(np.zeros((2, HQ), np.float32))
    zeros = _tensor(np.zeros(2, np.int32))
    fn(_tensor(q), _tensor(pages), _tensor(indptr), _tensor(values), _tensor(info), zeros, zeros,
       out, lse, 0, 1.0, 1e4, 1 / np.sqrt(D))  # fmt: skip
    for b, n in enumerate(lens):
        visible = list(range(3)) + list(range(40, n)) if sliding and b == 1 else list(range(n))
        k, v = kv[b]
        for h in range(HQ):
            ref, ref_lse = _reference(q[b, h], k[h // 3, visible], v[h // 3, visible])
            np.testing.assert_allclose(out.numpy()[b, h], ref, atol=1e-5)
            assert lse.numpy()[b, h] == pytest.approx(ref_lse, abs=1e-5)


@pytest.mark.parametrize(("sliding", "causal"), [(False, 0), (False, 1), (True, 1)])
def test_paged_prefill_masks_like_the_stock_kernel(compiled, sliding, causal):
    get, attention = compiled
    window = 24
    fn = get(f"prefill{sliding}", lambda: attention.prefill_paged(HKV, HQ, D, sliding, window))
    rng = np.random.default_rng(2)
    lens, n_q = [37, 50], [4, 7]
    pages, values, indptr, last, kv = _paged(rng, lens)
    info = np.stack([last, [0, 0], [0, 0]]).astype(np.int32) if sliding else last
    q_indptr = np.array([0, n_q[0], sum(n_q)], np.int32)
    q = rng.standard_normal((sum(n_q), HQ, D)).astype(np.float32)
    out = _tensor(np.zeros((sum(n_q), HQ, D), np.float32))
    lse = _tensor(np.zeros((sum(n_q), HQ), np.float32))
    fn(_tensor(q), _tensor(q_indptr), _tensor(pages), _tensor(indptr), _tensor(values), _tensor(info),
       _tensor(np.zeros(2, np.int32)), _tensor(np.zeros(sum(n_q), np.int32)), out, lse,
       causal, 0, 1.0, 1e4, 1 / np.sqrt(D))  # fmt: skip
    for b, n in enumerate(lens):
        k, v = kv[b]
        for i in range(n_q[b]):
            if sliding:  # the chunk's query i sees the last window - i - 1 history slots
                lo, hi = max(n - max(window - i - 1, 0), 0), n
            else:
                lo, hi = 0, (min(n - n_q[b] + i + 1, n) if causal else n)
            row = q_indptr[b] + i
            for h in range(HQ):
                ref, ref_lse = _reference(q[row, h], k[h // 3, lo:hi], v[h // 3, lo:hi])
                np.testing.assert_allclose(out.numpy()[row, h], ref, atol=1e-5)
                assert lse.numpy()[row, h] == pytest.approx(ref_lse, abs=1e-5)
