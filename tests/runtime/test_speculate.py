"""--spec ngram on tiny models: the output is plain decoding's, token for token, greedy and
sampled; drafts are made and taken where the sequence repeats itself, and the ones sampling did
not pick leave the cache."""

from __future__ import annotations

import numpy as np
import pytest
from goinfer.runtime.decode import GenerationRequest
from goinfer.runtime.model import Model
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.scheduler import Scheduler, SchedulerConfig
from goinfer.runtime.speculate import NgramDrafter


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tiny_bundle) -> Model:
    return Model.load(tiny_bundle(request.param, "f32"), self_test=False)


def _repetitive(vocab: int, seed: int) -> list[int]:
    """A prompt that repeats a phrase: what an edit that copies a file back looks like."""
    rng = np.random.default_rng(seed)
    phrase = [int(t) for t in rng.integers(1, vocab, 12)]
    return [int(t) for t in rng.integers(1, vocab, 5)] + phrase * 4 + phrase[:3]


def _tokens(sched: Scheduler, prompt: list[int], params: SamplingParams) -> list[int]:
    return [e.token_id for e in sched.generate(GenerationRequest(prompt, params)) if e.token_id is not None]


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40),
    SamplingParams(temperature=0.9, seed=7, max_tokens=40),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=40),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled", "top-p"])
def test_speculation_gives_plain_decodings_tokens(model: Model, params: SamplingParams) -> None:
    vocab = model.spec.vocab_size
    plain = Scheduler(model, SchedulerConfig(kv_sessions=0, prefill_chunk=16))
    spec = Scheduler(model, SchedulerConfig(kv_sessions=0, prefill_chunk=16, spec="ngram"))
    try:
        for seed in range(4):
            prompt = _repetitive(vocab, seed)
            assert _tokens(spec, prompt, params) == _tokens(plain, prompt, params), f"prompt {seed}"
    finally:
        plain.stop()
        spec.stop()


def test_drafts_are_made_and_rejected_ones_dropped(model: Model) -> None:
    """A repeated phrase gives drafts; whichever of them sampling takes, the sequence in the cache
    ends as exactly the prompt and the reply (no rejected draft left behind). That drafts are
    taken is shown on the real coders (tests/e2e/test_speculate_real.py)."""
    vocab = model.spec.vocab_size
    spec = Scheduler(model, SchedulerConfig(kv_sessions=2, prefill_chunk=16, spec="ngram"))
    drafters = []
    original = NgramDrafter.outcome

    def record(self, drafted: int, accepted: int) -> None:
        drafters.append((drafted, accepted))
        original(self, drafted, accepted)

    try:
        NgramDrafter.outcome = record
        prompt = _repetitive(vocab, 9)
        reply = _tokens(spec, prompt, SamplingParams(temperature=0.0, max_tokens=30))
        spec.sync()
        assert sum(d for d, _ in drafters) > 0, "the repeated phrase gave no draft"
        (seq,) = spec.pool.seqs.values()
        assert seq.tokens == prompt + reply[:-1]  # the last sampled token was never fed
    finally:
        NgramDrafter.outcome = original
        spec.stop()


def test_the_drafter_proposes_what_followed_the_latest_match() -> None:
    d = NgramDrafter([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8])
    assert d.propose(8) == []  # "3 7 8": no earlier "7 8"
    d.extend([1, 2, 3])  # "... 1 2 3" again: latest earlier match ends before 7
    assert d.propose(2) == [7, 8]
    d.outcome(2, 0)
    assert d.k == 1
    assert d.propose(8) == [7]
    d.outcome(1, 1)
    assert d.k == 3 and (d.drafted, d.accepted) == (3, 1)


@pytest.mark.parametrize("params", PARAMS[:2], ids=["greedy", "sampled"])
def test_generate_with_speculation_gives_its_tokens(model: Model, params: SamplingParams) -> None:
    """`goinfer generate --spec ngram`: Model.generate on its own sequence, the same rule."""

    def tokens(prompt: list[int], spec: str) -> list[int]:
        events = model.generate(GenerationRequest(prompt, params), spec=spec)
        return [e.token_id for e in events if e.token_id is not None]

    for seed in range(3):
        prompt = _repetitive(model.spec.vocab_size, seed)
        assert tokens(prompt, "ngram") == tokens(prompt, "off"), f"prompt {seed}"
