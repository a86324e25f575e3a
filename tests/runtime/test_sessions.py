"""--session-dir: warm sessions survive a restart, exactly; a torn or foreign file is refused."""

from __future__ import annotations

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


def test_sessions_survive_a_restart(model: Model, tmp_path) -> None:
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
    exportable = not any(m.spec.sliding_layers)  # at shutdown: the KV too, where TVM exports it
    assert all((s.kv_metadata is not None) == exportable for s in saved)

    again = Scheduler(m, config)  # a restart: both conversations warm again, before any request
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
