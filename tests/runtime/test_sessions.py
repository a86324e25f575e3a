"""--session-dir: warm sessions survive a restart, exactly; a torn, foreign or crafted file is
refused with one log line and moved aside, never loaded, never a crash."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from goinfer.runtime import session_store as store
from goinfer.runtime.decode import GenerationRequest
from goinfer.runtime.model import Model
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.scheduler import Scheduler, SchedulerConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, n)]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tiny_bundle) -> Model:
    return Model.load(tiny_bundle(request.param, "f32"), self_test=False)


def _tokens(events) -> tuple[list[int], int]:
    events = list(events)
    return [e.token_id for e in events if e.token_id is not None], events[-1].timings["cached_tokens"]


def test_sessions_survive_a_restart(model: Model, tmp_path, caplog) -> None:
    m, vocab = model, model.spec.vocab_size
    config = SchedulerConfig(kv_sessions=4, session_dir=str(tmp_path), prefill_chunk=8)
    cold = Scheduler(m, SchedulerConfig(kv_sessions=0, prefill_chunk=8))
    turns = [_ids(vocab, 30, 1), _ids(vocab, 20, 2)]  # two conversations
    first = Scheduler(m, config)
    replies = [_tokens(first.generate(GenerationRequest(t, GREEDY)))[0] for t in turns]
    first.sync()
    for f in store.listing(tmp_path, m.bundle.header_sha256):  # after each request: the ids
        assert store.load(f, m.bundle.header_sha256).kv_metadata is None
    first.stop()
    files = store.listing(tmp_path, m.bundle.header_sha256)
    assert len(files) == 2
    saved = [store.load(f, m.bundle.header_sha256) for f in files]
    assert all(s.kv_metadata is not None for s in saved)  # at shutdown: the KV too (Gemma's as well)

    with caplog.at_level(logging.INFO, logger="goinfer.runtime"):
        again = Scheduler(m, config)  # a restart: both conversations warm again, before any request
    (line,) = [r.getMessage() for r in caplog.records if "restored" in r.getMessage()]
    assert "(2 by KV import, 0 fed again" in line, line  # every session, by its KV: no forward
    assert not [r for r in caplog.records if "refused" in r.getMessage()]
    try:
        warm = {len(s.tokens): s.exact for s in again.pool.seqs.values()}
        assert sorted(warm) == sorted(len(t) + len(r) - 1 for t, r in zip(turns, replies, strict=True))
        for t, r in zip(turns, replies, strict=True):
            follow = [*t, *r, *_ids(vocab, 5, 3)]
            got, cached = _tokens(again.generate(GenerationRequest(follow, GREEDY)))
            assert cached == warm[len(t) + len(r) - 1] > 0
            assert got == _tokens(cold.generate(GenerationRequest(follow, GREEDY)))[0]
    finally:
        again.stop()
        cold.stop()


@pytest.mark.parametrize(
    "damage",
    ["truncated", "flipped byte", "foreign bundle", "not ours"],
)
def test_a_damaged_session_file_is_refused_never_loaded(model: Model, tmp_path, caplog, damage: str) -> None:
    m = model
    config = SchedulerConfig(kv_sessions=4, session_dir=str(tmp_path))
    s = Scheduler(m, config)
    list(s.generate(GenerationRequest(_ids(m.spec.vocab_size, 25, 4), GREEDY)))
    s.stop()
    (path,) = store.listing(tmp_path, m.bundle.header_sha256)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flipped byte":
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "foreign bundle":
        saved = store.load(path, m.bundle.header_sha256)
        other = store.save(tmp_path, "f" * 64, saved)
        path.unlink()
        other.rename(path)  # another bundle's session, under this bundle's folder
    else:
        path.write_bytes(b"hello, world" * 10)
    with caplog.at_level(logging.WARNING, logger="goinfer.runtime"):
        restarted = Scheduler(m, config)
    try:
        assert restarted.pool.seqs == {}
        assert any("refused" in r.message for r in caplog.records)
    finally:
        restarted.stop()


def _crafted(m: Model, tmp_path, **change) -> None:
    """A session file with a valid checksum whose contents lie: what a bug, or a hand, could write."""
    config = SchedulerConfig(kv_sessions=4, session_dir=str(tmp_path), prefill_chunk=8)
    s = Scheduler(m, config)
    list(s.generate(GenerationRequest(_ids(m.spec.vocab_size, 40, 4), GREEDY)))
    s.stop()  # saved with its KV where TVM exports it
    (path,) = store.listing(tmp_path, m.bundle.header_sha256)
    saved = store.load(path, m.bundle.header_sha256)
    fields = {f: getattr(saved, f) for f in saved.__dataclass_fields__}
    if "meta" in change:
        meta = json.loads(saved.kv_metadata)
        meta.update(change.pop("meta"))
        fields["kv_metadata"] = json.dumps(meta)
    fields.update(change)
    store.save(tmp_path, m.bundle.header_sha256, store.SavedSession(**fields))


CRAFTED = {  # any family
    "ids past the vocabulary": lambda m: {"tokens": [1, 2, 3] + [10**8] * 200 + [-5] * 10},  # issue 33
    "a negative id": lambda m: {"tokens": [5] * 39 + [-5]},
    "empty": lambda m: {"tokens": [], "kv_metadata": None, "kv_groups": (), "exact": 0},
    "the whole window": lambda m: {"tokens": [5] * m.context_length, "kv_metadata": None, "kv_groups": ()},
}
KV_CRAFTED = {  # a session saved with its KV (llama: TVM exports its cache)
    "exact past its tokens": {"exact": 400},
    "exact mid-chunk": {"exact": 13, "chunk": 8},  # whole chunks of 8 claimed (a GPU cache's)
    "KV of another length": {"meta": {"seq_length": 16}},
    "KV pages of another size": {"meta": {"page_size": 8}},
    "KV of another dtype": {"meta": {"dtype": "float16"}},
    "KV metadata not JSON": {"kv_metadata": "{not json"},
    "KV groups missing": {"kv_groups": ()},
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_session_is_refused_and_moved_aside(model: Model, tmp_path, caplog, case: str) -> None:
    _crafted(model, tmp_path, **CRAFTED[case](model))
    _refused_at_start(model, tmp_path, caplog)


@pytest.mark.parametrize("case", sorted(KV_CRAFTED))
def test_a_crafted_kv_checkpoint_is_refused_and_moved_aside(tiny_bundle, tmp_path, caplog, case: str) -> None:
    m = Model.load(tiny_bundle("llama", "f32"), self_test=False)
    _crafted(m, tmp_path, **dict(KV_CRAFTED[case]))
    assert store.load(
        store.listing(tmp_path, m.bundle.header_sha256)[0], m.bundle.header_sha256
    ).kv_groups or (case == "KV groups missing")
    _refused_at_start(m, tmp_path, caplog)


def _refused_at_start(m: Model, tmp_path, caplog) -> None:
    config = SchedulerConfig(kv_sessions=4, session_dir=str(tmp_path), prefill_chunk=8)
    with caplog.at_level(logging.WARNING, logger="goinfer.runtime"):
        restarted = Scheduler(m, config)
    try:
        assert restarted.pool.seqs == {}, "a refused session never reaches the cache"
        (line,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert "moved aside" in line
        assert store.listing(tmp_path, m.bundle.header_sha256) == []
        assert len(list(store.folder(tmp_path, m.bundle.header_sha256).glob("*.refused"))) == 1
        # and the model still serves
        events = list(restarted.generate(GenerationRequest(_ids(m.spec.vocab_size, 12, 9), GREEDY)))
        assert events[-1].finish_reason in ("stop", "length")
    finally:
        restarted.stop()


def test_sessions_survive_two_restarts(model: Model, tmp_path) -> None:
    """Every session imported at one start is on disk again after the next stop (exporting through
    TVM's sequence-0 checkpoint once deleted the imported session's file)."""
    m, vocab = model, model.spec.vocab_size
    config = SchedulerConfig(kv_sessions=4, session_dir=str(tmp_path), prefill_chunk=8)
    s = Scheduler(m, config)
    for seed in (11, 12, 13):
        list(s.generate(GenerationRequest(_ids(vocab, 20, seed), GREEDY)))
    s.stop()
    for _ in range(2):
        s = Scheduler(m, config)
        assert len(s.pool.seqs) == 3
        s.stop()
        assert len(store.listing(tmp_path, m.bundle.header_sha256)) == 3


def test_a_save_killed_midway_leaves_the_last_good_file(model: Model, tmp_path) -> None:
    """kill -9 during a save: the temporary file is half written; the session's last good file
    is what loads, and the leftover is cleared."""
    m = model
    config = SchedulerConfig(kv_sessions=4, session_dir=str(tmp_path), prefill_chunk=8)
    s = Scheduler(m, config)
    list(s.generate(GenerationRequest(_ids(m.spec.vocab_size, 30, 6), GREEDY)))
    s.stop()
    (path,) = store.listing(tmp_path, m.bundle.header_sha256)
    torn = path.with_name(f".{path.name}.tmp")
    torn.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    restarted = Scheduler(m, config)
    try:
        assert len(restarted.pool.seqs) == 1 and not torn.exists()
    finally:
        restarted.stop()


def test_a_session_saved_under_another_chunk_is_restored_exact(tiny_bundle, tmp_path) -> None:
    """--prefill-chunk changed across a restart: on the CPU a token computes the same in any chunk
    (granule 1), so all of it is still exact. A file whose exact tokens count in whole chunks (a
    GPU cache's granule) counts as exact from nothing here."""
    m = Model.load(tiny_bundle("llama", "f32"), self_test=False)
    old = SchedulerConfig(kv_sessions=4, session_dir=str(tmp_path), prefill_chunk=8)
    s = Scheduler(m, old)
    list(s.generate(GenerationRequest(_ids(m.spec.vocab_size, 40, 7), GREEDY)))
    s.stop()
    restarted = Scheduler(m, SchedulerConfig(kv_sessions=4, session_dir=str(tmp_path), prefill_chunk=16))
    try:
        (seq,) = restarted.pool.seqs.values()
        assert seq.exact == len(seq.tokens) > 40
    finally:
        restarted.stop()
    (path,) = store.listing(tmp_path, m.bundle.header_sha256)
    saved = store.load(path, m.bundle.header_sha256)
    fields = {f: getattr(saved, f) for f in saved.__dataclass_fields__}
    store.save(tmp_path, m.bundle.header_sha256, store.SavedSession(**{**fields, "exact": 32, "chunk": 16}))
    restarted = Scheduler(m, SchedulerConfig(kv_sessions=4, session_dir=str(tmp_path), prefill_chunk=16))
    try:
        (seq,) = restarted.pool.seqs.values()
        assert seq.exact == 0 and len(seq.tokens) > 40
    finally:
        restarted.stop()
