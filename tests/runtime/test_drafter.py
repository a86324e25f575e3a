"""--drafter on tiny models: a small model's drafts change how fast, never which tokens (greedy,
sampled, with --spec ngram or without, through the scheduler and `goinfer generate`); its cache
follows the target's through rejections and prefix reuse; a drafter with another vocabulary is
refused; and sampled tokens follow the target's own distribution where drafts were verified.

The drafter is the target's checkpoint built int8: the same tokenizer, nearly the same guesses.
P_MIN is 0 here so it drafts at every step (tiny random models are never sure of anything)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from click.testing import CliRunner
from goinfer.cli.main import main
from goinfer.runtime import draft_model
from goinfer.runtime.decode import GenerationRequest
from goinfer.runtime.draft_model import DraftModel, ModelDrafter
from goinfer.runtime.model import Model
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.scheduler import Scheduler, SchedulerConfig
from test_speculate import _tokens  # a generation's token ids through a scheduler


@pytest.fixture(scope="module")
def target(tiny_bundle) -> Model:
    return Model.load(tiny_bundle("llama", "f32"), self_test=False)


@pytest.fixture(scope="module")
def drafter_path(tiny_bundle) -> str:
    return str(tiny_bundle("llama", "int8"))


@pytest.fixture(autouse=True)
def always_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(draft_model, "P_MIN", 0.0)


@pytest.fixture
def rounds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every drafter round's (drafted, accepted)."""
    seen: list[tuple[int, int]] = []
    original = ModelDrafter.outcome

    def record(self, drafted: int, accepted: int) -> None:
        seen.append((drafted, accepted))
        original(self, drafted, accepted)

    monkeypatch.setattr(ModelDrafter, "outcome", record)
    return seen


def _prompt(vocab: int, seed: int, n: int = 40) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, n)]


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=30),
    SamplingParams(temperature=0.9, seed=7, max_tokens=30),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=30),
]


@pytest.mark.parametrize("spec", ["off", "ngram"])
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled", "top-p"])
def test_drafted_output_is_plain_decodings(target, drafter_path, rounds, params, spec) -> None:
    plain = Scheduler(target, SchedulerConfig(kv_sessions=0, prefill_chunk=16))
    drafted = Scheduler(
        target, SchedulerConfig(kv_sessions=2, prefill_chunk=16, spec=spec, drafter=drafter_path)
    )
    try:
        for seed in range(3):  # 40-token prompts: the drafter takes them in 16-token chunks
            prompt = _prompt(target.spec.vocab_size, seed)
            assert _tokens(drafted, prompt, params) == _tokens(plain, prompt, params), f"prompt {seed}"
    finally:
        plain.stop()
        drafted.stop()
    assert sum(a for _, a in rounds) > 0, "no draft was accepted"
    if params.temperature > 0:
        assert any(a < d for d, a in rounds), "no draft was rejected: the rejection path did not run"


def test_the_drafters_cache_follows_rejections_and_reuses_prefixes(
    target, drafter_path, rounds, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed: list[int] = []
    original = ModelDrafter._run

    def count(self, tokens):
        fed.append(len(tokens))
        return original(self, tokens)

    monkeypatch.setattr(ModelDrafter, "_run", count)
    sched = Scheduler(target, SchedulerConfig(kv_sessions=2, prefill_chunk=16, drafter=drafter_path))
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=25)
    try:
        prompt = _prompt(target.spec.vocab_size, 5, 50)
        reply = _tokens(sched, prompt, params)
        sched.sync()
        assert any(a < d for d, a in rounds), "no rejection to follow"
        (seq,) = [q for q in sched.draft.pool.seqs.values()]
        certain = prompt + reply[:-1]
        same = next((i for i, (a, b) in enumerate(zip(seq.tokens, certain, strict=False)) if a != b), None)
        held = len(seq.tokens) if same is None else same
        # all it holds is what was certain, but for the last round's drafts
        assert held >= len(prompt) and len(seq.tokens) - held <= draft_model.MAX_DRAFT
        # the next turn: the conversation so far and a little more. The drafter's cache lends it
        fed.clear()
        _tokens(sched, [*certain, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4))
        assert sum(fed) < len(certain) // 2, f"the drafter fed {sum(fed)} of {len(certain)} tokens again"
    finally:
        sched.stop()


@pytest.mark.parametrize("params", PARAMS[:2], ids=["greedy", "sampled"])
def test_generate_with_a_drafter_gives_plain_decodings_tokens(target, drafter_path, params) -> None:
    """`goinfer generate --drafter`: Model.generate on its own sequence, the same rule."""
    small = Model.load(drafter_path, self_test=False)
    draft = DraftModel(small, target, target.context_length, 1, 0, target.chunk)

    def tokens(prompt: list[int], drafter) -> list[int]:
        events = target.generate(GenerationRequest(prompt, params), drafter=drafter)
        return [e.token_id for e in events if e.token_id is not None]

    for seed in range(2):
        prompt = _prompt(target.spec.vocab_size, seed, 150)  # chunks to catch up on
        assert tokens(prompt, draft) == tokens(prompt, None), f"prompt {seed}"
    assert not draft.pool.seqs or all(not q.busy for q in draft.pool.seqs.values())


def test_a_drafter_with_another_vocabulary_is_refused(target, tiny_bundle, tmp_path) -> None:
    other = str(tiny_bundle("gemma3", "f32"))
    with pytest.raises(ValueError, match="vocabulary") as e:
        Scheduler(target, SchedulerConfig(drafter=other))
    assert "\n" not in str(e.value)
    result = CliRunner().invoke(
        main,
        ["generate", str(target.bundle.path), "hi", "--drafter", other, "--max-tokens", "2", "--no-selftest"],
    )
    assert result.exit_code == 2, (result.output, result.exception)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("goinfer: error: --drafter ") and "vocabulary" in line, line


def test_sampled_tokens_follow_the_targets_distribution_where_drafts_were_verified(
    target, drafter_path, rounds, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative sampling with a greedy drafter accepts a draft with probability p(draft) and
    otherwise resamples from the rest of p (runtime/speculate.py). Over many seeds, each second
    token (sampled where the drafter's first draft was verified) is checked against the target's
    exact softmax after the prompt and the first token: the randomized probability integral
    transform of a draw from the right distribution is uniform (Kolmogorov-Smirnov, alpha 0.001),
    and drafts are accepted as often as their target probability says (a z-test, 4 sigma)."""
    temperature, n = 1.5, 600  # flat enough that drafts are often rejected
    monkeypatch.setattr(target, "stop_ids", frozenset())  # every draw counts, a stop token's too
    prompt = _prompt(target.spec.vocab_size, 21, 12)
    sched = Scheduler(target, SchedulerConfig(kv_sessions=0, prefill_chunk=16, drafter=drafter_path))
    small = Model.load(drafter_path, self_test=False)
    exact: dict[int, np.ndarray] = {}
    draft_of: dict[int, int] = {}
    pits, accepted, expected, variance = [], 0, 0.0, 0.0
    rng = np.random.default_rng(0)
    try:
        for seed in range(n):
            params = SamplingParams(temperature=temperature, seed=seed, max_tokens=2)
            first, second = _tokens(sched, prompt, params)
            if first not in exact:
                logits = target.prefill([*prompt, first]).astype(np.float64) / temperature
                p = np.exp(logits - logits.max())
                exact[first] = p / p.sum()
                draft_of[first] = int(np.argmax(small.prefill([*prompt, first])))  # its greedy draft
            p, d = exact[first], draft_of[first]
            cdf = np.cumsum(p)
            pits.append(cdf[second] - p[second] + rng.random() * p[second])
            accepted += second == d
            expected += p[d]
            variance += p[d] * (1 - p[d])
    finally:
        sched.stop()
    assert len(rounds) >= n, "a round was not drafted"
    u = np.sort(np.asarray(pits))
    ks = max(np.max(np.arange(1, n + 1) / n - u), np.max(u - np.arange(n) / n))
    assert ks < 1.95 / math.sqrt(n), f"KS statistic {ks:.3f}: the sampled tokens are not the target's"
    assert abs(accepted - expected) < 4 * math.sqrt(variance) + 1, (accepted, expected)
    assert 0 < accepted < n, "every draft accepted or none: the rule was not exercised"
