"""OpenAI's n on tiny models (Scheduler.generate_choices): the prompt is prefilled once, each other
choice starts from a copy of its KV, and every choice is token for token the reply its own request
gets alone on a cold scheduler: greedy, seeded (choice i with seed + i), and through a sliding-window
model (gemma3). Where the cache has no room for a copy, a choice waits for a sibling to end and
takes over its warm sequence, with the same result."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
from goinfer.runtime.decode import GenerationRequest
from goinfer.runtime.model import Model
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.scheduler import Cancelled, Scheduler, SchedulerConfig


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tiny_bundle) -> Model:
    return Model.load(tiny_bundle(request.param, "f32"), self_test=False)


def _prompt(vocab: int, n: int = 37, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, n)]


def _tokens(events) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def _choices(sched: Scheduler, requests: list[GenerationRequest]) -> list[list[int]]:
    """Each choice iterated on a thread of its own, as the server does."""
    streams = sched.generate_choices(requests)
    out: list[list[int]] = [[] for _ in streams]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = _tokens(streams[i])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return out


def _counted(
    model: Model, sched: Scheduler, requests: list[GenerationRequest]
) -> tuple[list[list[int]], int]:
    """The choices' tokens, and how many tokens went through the model's forwards; stops `sched`."""
    fed: list[int] = []
    run = model.run

    def counting(kv, seq_ids, feeds, **kw):
        fed.append(sum(len(f) for f in feeds))
        return run(kv, seq_ids, feeds, **kw)

    model.run = counting  # type: ignore[method-assign]
    try:
        return _choices(sched, requests), sum(fed)
    finally:
        del model.run
        sched.stop()


def _alone(model: Model, request: GenerationRequest) -> list[int]:
    cold = Scheduler(model, SchedulerConfig(kv_sessions=0, prefill_chunk=16))
    try:
        return _tokens(cold.generate(request))
    finally:
        cold.stop()


def _seeded(params: SamplingParams, n: int) -> list[SamplingParams]:
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.9, seed=11, max_tokens=24)],
    ids=["greedy", "seeded"],
)
def test_each_choice_is_the_reply_its_request_gets_alone(model: Model, params: SamplingParams) -> None:
    prompt = _prompt(model.spec.vocab_size)
    n = 3
    each = _seeded(params, n) if params.seed is not None else [params] * n
    requests = [GenerationRequest(prompt, p) for p in each]
    sched = Scheduler(model, SchedulerConfig(kv_sessions=4, prefill_chunk=16, max_concurrent=4))
    got, fed = _counted(model, sched, requests)
    assert got == [_alone(model, r) for r in requests]
    if params.seed is not None:
        assert len({tuple(t) for t in got}) > 1, "seeds + i gave the same reply thrice"
    # the prompt was fed once; then each token a choice fed back (not its last when cut by the budget)
    decoded = sum(len(t) - (len(t) == params.max_tokens) for t in got)
    assert fed == len(prompt) + decoded, (fed, len(prompt), decoded)


def test_a_choice_without_room_for_a_copy_waits_and_takes_over_a_siblings_sequence(model: Model) -> None:
    """No room for the copy: the choice waits for the first to end, then takes over its warm
    sequence (every prompt token but the last reused), and its reply is still its own alone."""
    prompt = _prompt(model.spec.vocab_size, 40, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    requests = [GenerationRequest(prompt, params)] * 2
    sched = Scheduler(model, SchedulerConfig(kv_sessions=2, prefill_chunk=16, max_concurrent=2))
    forks: list[object] = []
    sched.pool.fork = lambda seq: forks.append(seq)  # type: ignore[method-assign]  (no room: None)
    got, fed = _counted(model, sched, requests)
    assert forks, "the second choice never asked for a copy"
    assert got == [_alone(model, requests[0])] * 2
    decoded = sum(len(t) - (len(t) == params.max_tokens) for t in got)
    assert fed == len(prompt) + 1 + decoded  # the second fed only the prompt's last token again


def test_cancelling_before_the_prompt_ends_every_choice(model: Model) -> None:
    prompt = _prompt(model.spec.vocab_size, 30, seed=5)
    cancel = threading.Event()
    cancel.set()
    sched = Scheduler(model, SchedulerConfig(kv_sessions=0, prefill_chunk=16, max_concurrent=3))
    try:
        request = GenerationRequest(prompt, SamplingParams(max_tokens=4))
        streams = sched.generate_choices([request] * 3, cancel)
        results: list[str] = []

        def run(stream) -> None:
            try:
                list(stream)
                results.append("ran")
            except Cancelled:
                results.append("cancelled")

        threads = [threading.Thread(target=run, args=(s,)) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert results == ["cancelled"] * 3
        sched.sync()
        assert not any(q.busy for q in sched.pool.seqs.values())
    finally:
        sched.stop()
