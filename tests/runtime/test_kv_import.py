"""Any sequence's KV out of a paged cache and into another cache that holds other sequences
(tvm_runtime.export_sequence / import_sequence), on the tiny models: a step on the imported
sequence is bit for bit a step on the one exported, and the cache's other sequences keep theirs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from goinfer.runtime import tvm_runtime as rt
from goinfer.runtime.model import Model

CASES = [
    ("llama", "float32"),
    ("llama", "float16"),
    ("qwen2", "float32"),
    ("qwen2", "float16"),
    ("gemma3", "float32"),
    ("gemma3", "float16"),
    ("mistral", "float32"),  # a window over every layer: the cache names one kind more (graph.py)
    ("phi3", "float32"),
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{d}" for f, d in CASES])
def model(request, tiny_bundle) -> Model:
    family, kv_dtype = request.param
    return Model.load(tiny_bundle(family, "f32", kv_dtype=kv_dtype), self_test=False)


@pytest.fixture(scope="module")
def llama(tiny_bundle) -> Model:
    return Model.load(tiny_bundle("llama", "f32"), self_test=False)


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, n)]


def _feed(m: Model, kv, seq: int, ids: list[int]) -> np.ndarray | None:
    """`ids` appended to `seq` in the bundle's prefill chunks; the last position's logits."""
    out = None
    for s in range(0, len(ids), m.prefill_chunk):
        out = m.run(kv, [seq], [ids[s : s + m.prefill_chunk]])
    return None if out is None else out[-1]


class Cold:
    """A sequence alone in its own cache, fed from the start: what every other must match."""

    def __init__(self, m: Model, ids: list[int]) -> None:
        self.m, self.kv = m, m.create_cache(1, 512)
        rt.add_sequence(self.kv, 0)
        _feed(m, self.kv, 0, ids)

    def step(self, ids: list[int]) -> np.ndarray:
        return _feed(self.m, self.kv, 0, ids)


def _cache(m: Model, seqs: dict[int, list[int]]):
    kv = m.create_cache(4, 1024)
    for seq, ids in seqs.items():
        rt.add_sequence(kv, seq)
        _feed(m, kv, seq, ids)
    return kv


def _absent(kv, seq: int) -> bool:
    try:
        rt.add_sequence(kv, seq)
    except Exception:
        return False
    rt.remove_sequence(kv, seq)
    return True


# 45: the imported sequence ends mid-page and its next steps cross into a new page
@pytest.mark.parametrize("length", [45, 64])
def test_a_sequence_moves_into_a_cache_holding_others(model: Model, length: int) -> None:
    m, vocab = model, model.spec.vocab_size
    ids = _ids(vocab, length, 1)
    others = {10: _ids(vocab, 25, 2), 11: _ids(vocab, 17, 3)}
    beside = {1: _ids(vocab, 20, 4), 2: _ids(vocab, 33, 5)}
    src = _cache(m, {**beside, 3: ids})
    free = rt.available_pages(src)
    meta, groups = rt.export_sequence(src, 3)
    assert rt.available_pages(src) == free  # the source cache is as it was
    pages = -(-length // 16)
    shape = (1, pages, 2, m.spec.num_kv_heads, 16, m.spec.head_dim)
    assert [g.shape for g in groups] == [shape] * m.spec.num_layers
    assert all(g.dtype == np.dtype(m.manifest.kv_cache.dtype) for g in groups)
    assert json.loads(meta)["seq_length"] == length

    dst = _cache(m, others)
    free = rt.available_pages(dst)
    rt.import_sequence(dst, 12, meta, groups)
    assert rt.available_pages(dst) == free - pages
    for a, b in zip(groups, rt.export_sequence(dst, 12)[1], strict=True):  # out again: the same bytes
        assert a.tobytes() == b.tobytes()

    cold = Cold(m, ids)
    for step in ([7], [8], [9], [4, 5, 6][: m.prefill_chunk]):  # decode steps, then a chunk
        want = cold.step(step)
        np.testing.assert_array_equal(_feed(m, dst, 12, step), want)
        np.testing.assert_array_equal(_feed(m, src, 3, step), want)  # the exported one, untouched
    for kv, seqs in ((dst, others), (src, beside)):
        for seq, prefix in seqs.items():
            np.testing.assert_array_equal(_feed(m, kv, seq, [7]), Cold(m, prefix).step([7]))

    # the same tokens alone in a cache, their pages elsewhere: the same bytes (a last page's rest zero)
    _, alone = rt.export_sequence(_cache(m, {5: ids}), 5)
    for a, b in zip(groups, alone, strict=True):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 100])
def test_any_length(llama: Model, length: int) -> None:
    m, vocab = llama, llama.spec.vocab_size
    ids = _ids(vocab, length, 6)
    src = _cache(m, {0: _ids(vocab, 9, 7), 4: ids})
    meta, groups = rt.export_sequence(src, 4)
    dst = _cache(m, {1: _ids(vocab, 30, 8)})
    rt.import_sequence(dst, 2, meta, groups)
    want = Cold(m, ids).step([3]) if ids else _feed(m, _cache(m, {0: []}), 0, [3])
    np.testing.assert_array_equal(_feed(m, dst, 2, [3]), want)


def test_tvm_checkpoints_of_sequence_0_import_anywhere(llama: Model) -> None:
    """Files saved with export_sequence0 (TVM's checkpoint) come back into any sequence, and
    export_sequence writes the very bytes TVM's checkpoint does."""
    m, vocab = llama, llama.spec.vocab_size
    ids = _ids(vocab, 50, 9)
    src = _cache(m, {0: ids})
    tvm_meta, tvm_groups = rt.export_sequence0(src)
    meta, groups = rt.export_sequence(src, 0)
    for a, b in zip(tvm_groups, groups, strict=True):
        assert a.tobytes() == b.tobytes()
    theirs, ours = json.loads(tvm_meta), json.loads(meta)
    shared = set(theirs) & set(ours)  # TVM's names more of the cache (capacity, RoPE), we the layer kinds
    assert {"layout_hash", "seq_length", "logical_pages", "groups", "dtype", "page_size"} <= shared
    assert {k: theirs[k] for k in shared} == {k: ours[k] for k in shared}
    dst = _cache(m, {3: _ids(vocab, 20, 10), 4: _ids(vocab, 40, 11)})
    rt.import_sequence(dst, 7, tvm_meta, tvm_groups)
    np.testing.assert_array_equal(_feed(m, dst, 7, [5]), Cold(m, ids).step([5]))


def test_gemma3_needs_our_export(tiny_bundle) -> None:
    """TVM checkpoints no cache with sliding-window layers; export_sequence does (the exactness
    is test_a_sequence_moves_into_a_cache_holding_others)."""
    m = Model.load(tiny_bundle("gemma3", "f32"), self_test=False)
    kv = _cache(m, {0: _ids(m.spec.vocab_size, 20, 12)})
    with pytest.raises(Exception, match="full-context MHA"):
        rt.export_sequence0(kv)
    meta, groups = rt.export_sequence(kv, 0)
    d = json.loads(meta)
    assert d["layout_hash"] is None  # TVM hashes no sliding layout either: the layer kinds tell
    assert d["attn_kinds"] == ["mha_sliding"] * 5 + ["mha"]
    swapped = json.dumps({**d, "attn_kinds": ["mha"] + ["mha_sliding"] * 5})
    with pytest.raises(ValueError, match="attn_kinds"):
        rt.import_sequence(kv, 1, swapped, groups)
    assert _absent(kv, 1)


def test_a_gemma3_sequence_sharing_pages_with_a_fork_is_refused(tiny_bundle) -> None:
    """With sliding-window layers the export finds a sequence's pages by popping and reserving it
    again, which a sequence sharing blocks with a fork does not survive: it says so."""
    m = Model.load(tiny_bundle("gemma3", "f32"), self_test=False)
    kv = _cache(m, {1: _ids(m.spec.vocab_size, 40, 13)})
    rt.fork_sequence(kv, 1, 2, 40)
    with pytest.raises(RuntimeError, match="shares KV pages with a fork"):
        rt.export_sequence(kv, 2)


def _refused(m: Model, meta: str, groups: list, match: str) -> None:
    vocab = m.spec.vocab_size
    prefix = _ids(vocab, 30, 14)
    dst = _cache(m, {1: prefix})
    free = rt.available_pages(dst)
    with pytest.raises(ValueError, match=match):
        rt.import_sequence(dst, 2, meta, groups)
    assert rt.available_pages(dst) == free and _absent(dst, 2)
    np.testing.assert_array_equal(_feed(m, dst, 1, [7]), Cold(m, prefix).step([7]))


def test_an_export_of_another_layout_is_refused_and_the_cache_unchanged(llama: Model, tiny_bundle) -> None:
    m, vocab = llama, llama.spec.vocab_size
    meta, groups = rt.export_sequence(_cache(m, {0: _ids(vocab, 40, 15)}), 0)
    d = json.loads(meta)

    _refused(m, meta, [g.astype(np.float16) for g in groups], "not this cache's layout")
    _refused(m, meta, [g[:, :2] for g in groups], "not this cache's layout")  # a page short
    _refused(m, json.dumps({**d, "seq_length": 60}), groups, "not this cache's layout")
    _refused(m, json.dumps({**d, "groups": d["groups"][:1]}), groups[:1], "layers")
    _refused(m, json.dumps({**d, "layout_hash": "0" * 16}), groups, "layout_hash")
    _refused(m, json.dumps({**d, "seq_length": -16}), groups, "seq_length")
    _refused(m, json.dumps({k: v for k, v in d.items() if k != "groups"}), groups, "malformed")

    f16 = Model.load(tiny_bundle("llama", "f32", kv_dtype="float16"), self_test=False)
    meta16, groups16 = rt.export_sequence(_cache(f16, {0: _ids(vocab, 40, 15)}), 0)
    _refused(m, meta16, groups16, "layout_hash")
    gemma = Model.load(tiny_bundle("gemma3", "f32"), self_test=False)
    other = _cache(gemma, {0: _ids(gemma.spec.vocab_size, 40, 15)})
    _refused(m, *rt.export_sequence(other, 0), "layout_hash")


def test_an_import_short_of_pages_or_onto_a_live_id_is_refused(llama: Model) -> None:
    m, vocab = llama, llama.spec.vocab_size
    meta, groups = rt.export_sequence(_cache(m, {0: _ids(vocab, 100, 16)}), 0)
    kv = m.create_cache(2, 64)  # 64 tokens: room for 5 pages
    rt.add_sequence(kv, 1)
    free = rt.available_pages(kv)
    with pytest.raises(ValueError, match="free pages"):
        rt.import_sequence(kv, 2, meta, groups)
    assert rt.available_pages(kv) == free and _absent(kv, 2)
    with pytest.raises(Exception, match="already in the KV cache"):
        rt.import_sequence(kv, 1, *rt.export_sequence(_cache(m, {0: [1, 2]}), 0))
    assert rt.available_pages(kv) == free
    _feed(m, kv, 1, _ids(vocab, free * 16, 17))  # not one page left
    with pytest.raises(ValueError, match="no free page"):
        rt.import_sequence(kv, 2, *rt.export_sequence(_cache(m, {0: [1, 2]}), 0))
    assert rt.available_pages(kv) == 0 and _absent(kv, 2)


def test_a_large_import_copies_on_threads(llama: Model, monkeypatch) -> None:
    m, vocab = llama, llama.spec.vocab_size
    monkeypatch.setattr(rt, "THREADS", 2)
    monkeypatch.setattr(rt, "_PARALLEL_COPY_BYTES", 0)
    ids = _ids(vocab, 150, 18)
    meta, groups = rt.export_sequence(_cache(m, {0: ids}), 0)
    dst = _cache(m, {1: _ids(vocab, 40, 19)})
    rt.import_sequence(dst, 2, meta, groups)
    np.testing.assert_array_equal(_feed(m, dst, 2, [3]), Cold(m, ids).step([3]))
