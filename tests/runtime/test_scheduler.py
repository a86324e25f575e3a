"""The multi-sequence cache and the scheduler on tiny models: reuse, batching, pages, cancel."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from goinfer.runtime import tvm_runtime as rt
from goinfer.runtime.decode import GenerationRequest
from goinfer.runtime.model import Model
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.scheduler import Cancelled, KVCacheFull, Scheduler, SchedulerConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, n)]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tiny_bundle) -> Model:
    return Model.load(tiny_bundle(request.param, "f32"), self_test=False)


def _feed(m: Model, kv, seq: int, ids: list[int]) -> np.ndarray:
    """Feed `ids` to `seq` in the bundle's prefill chunks; the last position's logits."""
    for s in range(0, len(ids), m.prefill_chunk):
        out = m.run(kv, [seq], [ids[s : s + m.prefill_chunk]])
    return out[-1]


def _cold(m: Model, ids: list[int]) -> np.ndarray:
    kv = m.create_cache(1, m.context_length)
    rt.add_sequence(kv, 0)
    return _feed(m, kv, 0, ids)


def test_batch_decode_rows_equal_single_rows(model: Model) -> None:
    """Four sequences' decode steps in one forward give the rows each gives alone, bit for bit."""
    m, vocab = model, model.spec.vocab_size
    b = min(4, m.prefill_chunk)  # a forward's tokens, decode ones too, fit the cache's chunk
    prompts = [_ids(vocab, n, seed) for seed, n in enumerate((5, 17, 33, 9)[:b])]
    nxt = [7, 8, 9, 10][:b]
    kv = m.create_cache(4, m.context_length * 4)
    for i, p in enumerate(prompts):
        rt.add_sequence(kv, i)
        _feed(m, kv, i, p)
    batched = m.run(kv, list(range(b)), [[t] for t in nxt])
    for i, p in enumerate(prompts):
        alone = m.create_cache(1, m.context_length)
        rt.add_sequence(alone, 0)
        _feed(m, alone, 0, p)
        np.testing.assert_array_equal(batched[i], m.run(alone, [0], [[nxt[i]]])[0])


def test_batch_prefill_gives_each_sequences_last_logits(model: Model) -> None:
    m, vocab = model, model.spec.vocab_size
    a, b = _ids(vocab, 1 + m.prefill_chunk // 3, 1), _ids(vocab, m.prefill_chunk // 2, 2)
    kv = m.create_cache(2, m.context_length * 2)
    rt.add_sequence(kv, 1)
    rt.add_sequence(kv, 2)
    rows = m.run(kv, [1, 2], [a, b])
    np.testing.assert_allclose(rows[0], _cold(m, a), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rows[1], _cold(m, b), rtol=1e-5, atol=1e-5)


def test_a_failed_forward_leaves_the_cache_as_it_was(model: Model) -> None:
    m = model
    kv = m.create_cache(1, m.context_length)
    rt.add_sequence(kv, 0)
    m.run(kv, [0], [[1, 2, 3]])
    free = rt.available_pages(kv)
    with pytest.raises(Exception):  # noqa: B017 - a token id past the vocabulary: the kernel refuses
        m.run(kv, [0], [[1] * (m.prefill_chunk + 1)])
    assert rt.available_pages(kv) == free
    np.testing.assert_array_equal(m.run(kv, [0], [[4]])[0], _pieces(m, [1, 2, 3], [4]))


def _pieces(m: Model, *pieces: list[int]) -> np.ndarray:
    """Logits after feeding `pieces` one forward each to a fresh sequence."""
    kv = m.create_cache(1, m.context_length)
    rt.add_sequence(kv, 0)
    for p in pieces:
        out = m.run(kv, [0], [p])
    return out[-1]


def _first_step(gen, prompt: list[int]) -> tuple:
    """The reply's first token and its top-5 log-probabilities: a function of the last logits."""
    request = GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=1), 5)
    ev = next(e for e in gen(request) if e.token_id is not None)
    return ev.token_id, ev.top_logprobs


@pytest.mark.parametrize("how", ["extend", "diverge"])
def test_reuse_is_a_cold_run_bit_for_bit(model: Model, how: str) -> None:
    """A later prompt reuses what an earlier one computed (taken over, popped or forked) and gets
    the logits a cold run of it gets, to the bit; so does the earlier conversation continuing
    after another forked from it."""
    m, vocab = model, model.spec.vocab_size
    config = SchedulerConfig(kv_sessions=4, prefill_chunk=8)
    sched, cold = Scheduler(m, config), Scheduler(m, SchedulerConfig(kv_sessions=0, prefill_chunk=8))
    c = sched.chunk
    shared = _ids(vocab, 5 * c, 3)  # whole chunks
    first = shared + (_ids(vocab, 2 * c + 1, 4) if how == "diverge" else [])
    second = shared + _ids(vocab, c + 3, 5)
    try:
        assert _first_step(sched.generate, first) == _first_step(cold.generate, first)
        sched.sync()
        got = _first_step(sched.generate, second)
        sched.sync()
        assert got == _first_step(cold.generate, second)
        warm = max(sched.pool.seqs.values(), key=lambda s: s.last_used)
        assert warm.tokens[: len(second)] == second
        assert (
            list(sched.generate(GenerationRequest(second, SamplingParams(temperature=0.0, max_tokens=1))))[
                -1
            ].timings["cached_tokens"]
            == len(second) - 1
        )  # now all of it is warm but the last token, whose logits start the reply
        third = first + _ids(vocab, 2 * c, 6)  # the first conversation goes on
        assert _first_step(sched.generate, third) == _first_step(cold.generate, third)
    finally:
        sched.stop()
        cold.stop()


def test_a_next_turn_reuses_the_previous_reply_bit_for_bit(model: Model) -> None:
    """Turn 2 of a chat is turn 1's prompt, its reply and a new message: everything the first turn
    fed, decoded tokens too, is reused (any token, on the CPU), and the logits are a cold run's."""
    m, vocab = model, model.spec.vocab_size
    sched = Scheduler(m, SchedulerConfig(kv_sessions=4, prefill_chunk=8))
    cold = Scheduler(m, SchedulerConfig(kv_sessions=0, prefill_chunk=8))
    first = _ids(vocab, 29, 11)
    try:
        events = sched.generate(GenerationRequest(first, SamplingParams(temperature=0.0, max_tokens=6)))
        reply = [e.token_id for e in events if e.token_id is not None]
        sched.sync()
        second = first + reply + _ids(vocab, 5, 12)
        events = list(
            sched.generate(GenerationRequest(second, SamplingParams(temperature=0.0, max_tokens=1), 5))
        )
        # all it fed: the reply's last token was sampled, never fed
        assert events[-1].timings["cached_tokens"] == len(first) + len(reply) - 1
        (warm,) = [e for e in events if e.token_id is not None]
        assert (warm.token_id, warm.top_logprobs) == _first_step(cold.generate, second)
    finally:
        sched.stop()
        cold.stop()


def _run_alone(m: Model, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return [e.token_id for e in m.generate(GenerationRequest(prompt, params)) if e.token_id is not None]


def test_concurrent_generations_each_get_what_they_get_alone(model: Model) -> None:
    m, vocab = model, model.spec.vocab_size
    prompts = [_ids(vocab, n, 10 + n) for n in (6, 30, 11, 50, 3)]
    params = [GREEDY, SamplingParams(temperature=0.9, seed=7, max_tokens=12)] * 3
    alone = [_run_alone(m, p, params[i]) for i, p in enumerate(prompts)]
    sched = Scheduler(m, SchedulerConfig(max_concurrent=4, kv_sessions=0, prefill_chunk=8))
    out: dict[int, list[int]] = {}

    def run(i: int) -> None:
        out[i] = [
            e.token_id
            for e in sched.generate(GenerationRequest(prompts[i], params[i]))
            if e.token_id is not None
        ]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        sched.sync()
        assert [out[i] for i in range(len(prompts))] == alone
        assert sched.pool.seqs == {}  # kv_sessions 0: nothing kept
    finally:
        sched.stop()


@contextlib.contextmanager
def client_leaves_at(m: Model, forward: int) -> Iterator[tuple[threading.Event, list[int]]]:
    """A cancel flag that is set as `m` runs its `forward`-th forward (the client leaves then),
    and the count of forwards run."""
    cancel, calls = threading.Event(), [0]
    real_run = m.run

    def counting_run(*a, **k):
        calls[0] += 1
        if calls[0] == forward:
            cancel.set()
        return real_run(*a, **k)

    m.run = counting_run  # type: ignore[method-assign]
    try:
        yield cancel, calls
    finally:
        del m.run


def test_cancel_mid_prefill_frees_the_sequence(model: Model) -> None:
    m = model
    sched = Scheduler(m, SchedulerConfig(prefill_chunk=4, kv_sessions=0))
    try:
        with client_leaves_at(m, 2) as (cancel, calls), pytest.raises(Cancelled):
            list(sched.generate(GenerationRequest(_ids(m.spec.vocab_size, 40, 1), GREEDY), cancel=cancel))
        assert calls == [2]  # the other 8 chunks never ran
        sched.sync()
        assert sched.pool.seqs == {}
    finally:
        sched.stop()


def test_a_retry_after_a_cancelled_prefill_resumes_where_it_stopped(model: Model) -> None:
    """A client that times out mid-prefill and sends the request again (Claude Code's watchdog
    does, after 5 minutes) starts from the chunks already computed, and gets a cold run's reply."""
    m = model
    sched = Scheduler(m, SchedulerConfig(prefill_chunk=4, kv_sessions=4))
    cold = Scheduler(m, SchedulerConfig(prefill_chunk=4, kv_sessions=0))
    prompt = _ids(m.spec.vocab_size, 40, 1)
    try:
        with client_leaves_at(m, 3) as (cancel, _), pytest.raises(Cancelled):
            list(sched.generate(GenerationRequest(prompt, GREEDY), cancel=cancel))
        events = list(sched.generate(GenerationRequest(prompt, GREEDY)))
        assert events[0].timings["cached_tokens"] == 3 * sched.chunk  # the three chunks computed
        assert [e.token_id for e in events] == [
            e.token_id for e in cold.generate(GenerationRequest(prompt, GREEDY))
        ]
    finally:
        sched.stop()
        cold.stop()


def test_a_prompt_the_cache_cannot_hold_is_refused(model: Model) -> None:
    m = model
    sched = Scheduler(m, SchedulerConfig(kv_tokens=32, kv_sessions=0))
    try:
        with pytest.raises(KVCacheFull, match="no room"):
            list(sched.generate(GenerationRequest(_ids(m.spec.vocab_size, 60, 2), GREEDY)))
    finally:
        sched.stop()


def test_constraints_logprobs_and_seeds_stay_per_generation(model: Model) -> None:
    """Concurrent generations, one grammar-constrained, one with logprobs, one seeded: each gets
    exactly what it gets alone."""
    from goinfer.runtime.grammar import GrammarConstraint, compile_lark

    m, vocab = model, model.spec.vocab_size
    grammar = m.grammar.start()
    pattern = compile_lark("start: /[0-9]{3,6}/")

    def digits() -> GrammarConstraint:
        return GrammarConstraint(grammar.matcher(pattern), vocab)

    runs = [
        (_ids(vocab, 9, 21), GREEDY, None, digits),
        (_ids(vocab, 14, 22), GREEDY, 3, None),
        (_ids(vocab, 5, 23), SamplingParams(temperature=1.0, seed=5, max_tokens=12), None, None),
    ]

    def go(gen, prompt, params, logprobs, make):
        events = list(gen(GenerationRequest(prompt, params, logprobs, make() if make else None)))
        return [(e.token_id, e.logprob, e.top_logprobs) for e in events if e.token_id is not None]

    alone = [go(m.generate, *r) for r in runs]
    sched = Scheduler(m, SchedulerConfig(max_concurrent=3, kv_sessions=0))
    out: dict[int, list] = {}
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, go(sched.generate, *runs[i])))
        for i in range(3)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [out[i] for i in range(3)] == alone
        assert all(m.decode([t]).isdigit() for t, _lp, _top in alone[0])
    finally:
        sched.stop()


def test_longest_prefix_reuse_takes_the_whole_shared_prefix(model: Model) -> None:
    """--prefix-reuse longest: everything shared but the last token is reused, mid-chunk too, and
    the reply's logits are a cold run's to float rounding."""
    m, vocab = model, model.spec.vocab_size
    sched = Scheduler(m, SchedulerConfig(kv_sessions=4, prefill_chunk=8, prefix_reuse="longest"))
    cold = Scheduler(m, SchedulerConfig(kv_sessions=0, prefill_chunk=8))
    first = _ids(vocab, 21, 7)
    second = first + _ids(vocab, 5, 8)
    try:
        list(sched.generate(GenerationRequest(first, SamplingParams(temperature=0.0, max_tokens=1))))
        events = list(
            sched.generate(GenerationRequest(second, SamplingParams(temperature=0.0, max_tokens=1), 5))
        )
        assert events[-1].timings["cached_tokens"] == len(first)  # not rounded to a chunk
        (warm,) = [e for e in events if e.token_id is not None]
        tok, top = _first_step(cold.generate, second)
        assert warm.token_id == tok
        np.testing.assert_allclose([lp for _t, lp in warm.top_logprobs], [lp for _t, lp in top], atol=1e-4)
    finally:
        sched.stop()
        cold.stop()


def test_a_decode_step_short_of_pages_preempts_the_youngest(model: Model, caplog) -> None:
    """Two generations that cannot both fit: the younger is preempted at the step that runs out of
    pages and recomputed from its tokens as a prompt; both finish in full. (Gemma's 3-token chunks
    once deadlocked here: the elder, preempted in turn while the younger was half fed again,
    waited on pages the younger held, and the younger on the elder.)"""
    m, page = model, model.manifest.kv_cache.page_size
    # room for about one sequence's whole run: each prompt fits, both together do not finish
    sched = Scheduler(m, SchedulerConfig(max_concurrent=2, kv_sessions=0, kv_tokens=3 * page, batch="off"))
    params = SamplingParams(temperature=0.0, max_tokens=2 * page)
    prompts = [_ids(m.spec.vocab_size, page // 2, 30 + i) for i in range(2)]
    out: dict[int, list] = {}
    started = threading.Barrier(2)

    def run(i: int) -> None:
        started.wait()
        out[i] = list(sched.generate(GenerationRequest(prompts[i], params)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    try:
        with caplog.at_level("INFO", logger="goinfer.runtime"):
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert any("preempting" in r.getMessage() for r in caplog.records)
        assert sorted(out) == [0, 1], (
            "both generations finish (a preempted one waited for pages, never forever)"
        )
        for events in out.values():
            assert events[-1].finish_reason in ("stop", "length")
            n = sum(e.token_id is not None for e in events)
            assert n == 2 * page or events[-1].finish_reason == "stop"
    finally:
        sched.stop()


def test_the_batching_probe_measures_then_frees_its_sequences(model: Model) -> None:
    """--cpu-batch auto: two sequences' steps are timed alone and batched; the pool is left empty
    and the choice follows the measurement. A scheduler of one generation never probes."""
    from goinfer.runtime.scheduler import BATCH_GAIN

    auto = Scheduler(model, SchedulerConfig(max_concurrent=2, kv_sessions=0, batch="auto"))
    try:
        assert auto.probe is not None and all(t > 0 for t in auto.probe)
        assert auto.batch == (auto.probe[1] <= BATCH_GAIN * auto.probe[0])
        assert auto.pool.seqs == {}
        events = list(auto.generate(GenerationRequest(_ids(model.spec.vocab_size, 10, 40), GREEDY)))
        assert events[-1].finish_reason in ("stop", "length")
    finally:
        auto.stop()
    for config in (SchedulerConfig(max_concurrent=1, batch="auto"), SchedulerConfig(batch="on")):
        s = Scheduler(model, config)
        try:
            assert s.probe is None and s.batch == (config.batch == "on")
        finally:
            s.stop()
