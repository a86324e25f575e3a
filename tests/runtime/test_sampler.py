"""The sampler: seeded Gumbel-max draws, filters with ties by ascending id, and OpenAI's penalties."""

from __future__ import annotations

import numpy as np
import pytest
from goinfer.runtime import sampler as S
from goinfer.runtime.sampler import Sampler, SamplingParams

LOGITS = np.log(np.array([0.4, 0.3, 0.2, 0.1]))


def _run(params: SamplingParams, steps: list[np.ndarray]) -> list[int]:
    s = Sampler(params)
    return [s(z) for z in steps]


def test_a_seed_reproduces_exactly_and_draws_are_counter_based() -> None:
    rng = np.random.default_rng(0)
    steps = [rng.normal(size=500) for _ in range(40)]
    for extra in ({}, {"top_k": 50}, {"top_p": 0.9}, {"min_p": 0.01}):
        p = SamplingParams(temperature=1.0, seed=1234, **extra)
        a = _run(p, steps)
        assert a == _run(p, steps)
        assert a != _run(SamplingParams(temperature=1.0, seed=1235, **extra), steps)
        # Draw i depends on (seed, i) only, not on the draws before it.
        assert [S.sample(z, p, 1234, i) for i, z in enumerate(steps)] == a


def test_plain_temperature_is_gumbel_max_with_the_softmax_distribution() -> None:
    p = SamplingParams(temperature=0.7, seed=9)
    n = 8000
    counts = np.bincount([S.sample(LOGITS, p, 9, i) for i in range(n)], minlength=4)
    want = S.softmax(LOGITS / 0.7)
    sigma = np.sqrt(want * (1 - want) / n)
    assert np.all(np.abs(counts / n - want) < 5 * sigma), (counts / n, want)
    # The draw is exactly argmax(logits / T + noise) with the keyed noise.
    for i in range(20):
        assert S.sample(LOGITS, p, 9, i) == int(np.argmax(LOGITS / 0.7 + S.gumbel_noise(9, i, 4)))


def test_ties_resolve_by_ascending_token_id() -> None:
    flat = np.zeros(6)
    assert S.greedy(flat) == 0
    assert S.greedy(np.array([0.0, 2.0, 1.0, 2.0])) == 1
    probs = S.softmax(np.array([1.0, 3.0, 1.0, 3.0, 1.0]))
    assert S.ranked(probs).tolist() == [1, 3, 0, 2, 4]
    assert S.top_ranked(probs, 3).tolist() == [1, 3, 0]  # of the tied 0, 2, 4 the lowest id survives
    assert S.survivors(probs, top_k=4, top_p=1.0, min_p=0.0).tolist() == [1, 3, 0, 2]
    # The cumulative draw walks ties in ascending id: u in the first half picks 1, the second half 3.
    top2 = S.survivors(probs, top_k=2, top_p=1.0, min_p=0.0)
    assert S.filtered_choice(probs, top2, 0.49) == 1
    assert S.filtered_choice(probs, top2, 0.51) == 3


def test_bounded_selection_agrees_with_a_full_sort() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        probs = S.softmax(rng.normal(scale=3, size=5000).round(1))  # rounding makes ties
        order = S.ranked(probs)
        for m in (1, 7, 64, 5000):
            assert S.top_ranked(probs, m).tolist() == order[:m].tolist()
        cum = np.cumsum(probs[order])
        nucleus = order[: int(np.searchsorted(cum, 0.9)) + 1]
        assert S.survivors(probs, 0, 0.9, 0.0).tolist() == nucleus.tolist()
        assert S.survivors(probs, 10, 0.9, 0.0).tolist() == nucleus[:10].tolist()


def _survivors(**kw) -> list[int]:
    args = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, **kw}
    return sorted(S.survivors(S.softmax(LOGITS), **args).tolist())


def test_filters_alone() -> None:
    assert _survivors(top_k=2) == [0, 1]
    assert _survivors(top_p=0.7) == [0, 1]  # 0.4 + 0.3 reaches 0.7
    assert _survivors(top_p=0.71) == [0, 1, 2]
    assert _survivors(top_p=0.0) == [0]  # the top token always survives
    assert _survivors(min_p=0.5) == [0, 1, 2]  # p >= 0.5 * 0.4
    assert _survivors(min_p=0.8) == [0]


def test_top_k_with_top_p_takes_the_nucleus_over_the_full_distribution() -> None:
    # Over the full distribution the 0.5 nucleus is {0, 1}; intersected with the top 2 it stays {0, 1}.
    # (Renormalizing the top 2 first, as HF does, would give [0.57, 0.43] and a nucleus of {0} alone.)
    assert _survivors(top_k=2, top_p=0.5) == [0, 1]
    assert _survivors(top_k=1, top_p=0.9) == [0]
    assert _survivors(top_k=3, top_p=0.5, min_p=0.7) == [0, 1]


def test_filtered_draws_only_pick_survivors_in_proportion() -> None:
    p = SamplingParams(temperature=1.0, top_k=2, seed=3)
    n = 4000
    counts = np.bincount([S.sample(LOGITS, p, 3, i) for i in range(n)], minlength=4)
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / n - 0.4 / 0.7) < 0.04


def test_penalties_follow_openai() -> None:
    counts = np.array([0.0, 1.0, 3.0])
    z = S.apply_penalties(np.zeros(3), counts, frequency=0.5, presence=0.25)
    assert z.tolist() == [0.0, -0.75, -1.75]
    # Greedy on flat logits with a presence penalty never repeats a token while a fresh one is left.
    s = Sampler(SamplingParams(temperature=0, presence_penalty=1.0))
    assert [s(np.zeros(4)) for _ in range(4)] == [0, 1, 2, 3]
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=-1.0))  # negative: encourages repeats
    assert [s(np.zeros(4)) for _ in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("seed", [0, 7, -1, 2**70])
def test_temperature_zero_is_greedy_for_any_seed(seed: int) -> None:
    assert Sampler(SamplingParams(temperature=0, seed=seed))(LOGITS) == 0
    assert isinstance(Sampler(SamplingParams(temperature=1.0, seed=seed))(LOGITS), int)


# -- logit_bias and repetition_penalty (issue 37 part 3) -----------------------------------------
def test_logit_bias_plus_100_is_picked_and_minus_100_never() -> None:
    rng = np.random.default_rng(1)
    steps = [rng.normal(size=300).astype(np.float32) for _ in range(30)]
    top = [int(np.argmax(z)) for z in steps]
    assert _run(SamplingParams(temperature=0, logit_bias=((7, 100.0),)), steps) == [7] * 30
    banned = _run(SamplingParams(temperature=0, logit_bias=tuple((t, -100.0) for t in set(top))), steps)
    assert not set(banned) & set(top)
    for extra in ({}, {"top_k": 5}, {"top_p": 0.9}):
        drawn = _run(SamplingParams(temperature=1.5, seed=3, logit_bias=((top[0], -100.0),), **extra), steps)
        assert top[0] not in drawn
    # A bias adds to the logit: the same as sampling the shifted row.
    z = steps[0].astype(np.float64)
    z[5] += 2.5
    assert np.array_equal(S.apply_logit_bias(steps[0], ((5, 2.5),)), z)


def test_a_bias_never_lifts_a_masked_token() -> None:
    z = np.where(np.arange(10) < 5, np.float32(0.0), np.float32(-np.inf))  # a grammar allows 0..4
    assert Sampler(SamplingParams(temperature=0, logit_bias=((8, 100.0),)))(z) < 5
    assert _run(SamplingParams(temperature=1.0, seed=1, logit_bias=((8, 100.0),)), [z] * 50).count(8) == 0


def test_repetition_penalty_is_vllms_rule_over_prompt_and_output() -> None:
    z = np.array([2.0, -1.0, 1.9, 0.5], dtype=np.float32)
    seen = np.array([True, True, False, False])
    assert np.allclose(S.apply_repetition_penalty(z, seen, 2.0), [1.0, -2.0, 1.9, 0.5])
    # Token 0 is in the prompt: penalized before any output.
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=1.5), prompt_ids=[0])(z) == 2
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=1.5))(z) == 0
    # Output counts too, once per token however often it came: 2/3 > 1.9/3 > 0.5 after both are seen.
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=3.0))
    assert [s(z) for _ in range(4)] == [0, 2, 0, 0]


def test_without_the_new_fields_the_tokens_are_exactly_the_old_ones() -> None:
    rng = np.random.default_rng(2)
    steps = [rng.normal(size=400).astype(np.float32) for _ in range(40)]
    for extra in ({}, {"top_k": 20}, {"top_p": 0.8, "frequency_penalty": 0.5}, {"temperature": 0}):
        p = SamplingParams(**{"temperature": 0.9, "seed": 11, **extra})
        old = []
        counts = np.zeros(400)
        for i, z in enumerate(steps):  # the loop as it was: penalties, then the draw
            t = S.sample(S.apply_penalties(z, counts, p.frequency_penalty, p.presence_penalty), p, 11, i)
            counts[t] += 1
            old.append(t)
        assert _run(p, steps) == old
        assert (
            _run(SamplingParams(**{**p.__dict__, "repetition_penalty": 1.0, "logit_bias": ()}), steps) == old
        )
