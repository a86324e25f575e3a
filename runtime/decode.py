"""The decode loop, over any source of logits: sampling, grammar masks, logprobs, captured choices.

`Model.generate` and the server's scheduler run it over the compiled model; tests run the very
same loop over fake logits.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import numpy as np

from .detokenizer import Detokenizer
from .grammar import Constraint
from .sampler import Sampler, SamplingParams, log_softmax
from .stream import StepChoice, StepEvent


def sample_tokens(
    logits: np.ndarray,
    step: Callable[[int], np.ndarray],
    budget: int,
    params: SamplingParams,
    stop_ids: frozenset[int],
    text_of: Callable[[int], str],
    logprobs: int | None = None,
    constraint: Constraint | None = None,
    capture: bool = False,
) -> Iterator[StepEvent]:
    """The decode loop over any logits source (`step(token)` gives the next logits): one event per
    token, then a final event with finish_reason and timings["completion_tokens"].

    `logprobs` k >= 0 puts each token's log-probability on its event, with the k most likely
    alternatives; None skips them (a full-vocabulary log-softmax per token: ~1.9 ms on Qwen's
    152k vocabulary). `constraint` masks each step to what a grammar allows and ends the reply
    when the grammar is complete; `capture` records each masked step's choice (StepChoice)."""
    sampler = Sampler(params)
    n, finish = 0, "length"
    while n < budget:
        mask = None
        if constraint is not None:
            if constraint.finished:
                finish = "stop"
                break
            mask = constraint.allowed()
            if mask is not None:
                logits = np.where(mask, logits, np.float32(-np.inf))
        tok = sampler(logits)
        if tok in stop_ids:
            finish = "stop"
            break
        if constraint is not None:
            constraint.advance(tok)
        n += 1
        choice = step_choice(logits, mask, tok) if capture and mask is not None else None
        if logprobs is None:
            yield StepEvent(tok, text_of(tok), choice=choice)
        else:
            lsm = log_softmax(logits)
            top = _top(lsm, logprobs)
            yield StepEvent(tok, text_of(tok), float(lsm[tok]), top_logprobs=top, choice=choice)
        if n < budget:
            logits = step(tok)
    yield StepEvent(None, "", None, finish, {"completion_tokens": n})


def generate_events(
    detok: Detokenizer,
    prompt_ids: list[int],
    prefill: Callable[[], tuple[np.ndarray, int]],
    step: Callable[[int], np.ndarray],
    budget: int,
    params: SamplingParams,
    stop_ids: frozenset[int],
    logprobs: int | None = None,
    constraint: Constraint | None = None,
    capture: bool = False,
) -> Iterator[StepEvent]:
    """A whole generation over any model driver: `prefill()` feeds the prompt and gives the last
    position's logits and how many prompt tokens the cache already held (reused, not computed);
    `step(token)` feeds one token. Token events, then a final one whose timings carry the counts
    (prompt, cached and completion tokens) and the prefill and decode rates."""
    t0 = time.perf_counter()
    logits, cached = prefill()
    t_prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    first = True
    for ev in sample_tokens(
        logits, step, budget, params, stop_ids, detok.push, logprobs, constraint, capture
    ):
        if ev.token_id is not None:
            if first:  # the prompt's counts now: a stop string may end the reply before the end event
                counts = {"prompt_tokens": len(prompt_ids), "cached_tokens": cached}
                ev, first = dataclasses.replace(ev, timings=counts), False
            yield ev
            continue
        t_decode, n = time.perf_counter() - t1, ev.timings["completion_tokens"]
        computed = len(prompt_ids) - cached
        timings = {
            "prompt_tokens": len(prompt_ids),
            "cached_tokens": cached,
            "completion_tokens": n,
            "prefill_s": t_prefill,
            "decode_s": t_decode,
            "prefill_tok_s": computed / t_prefill if t_prefill > 0 else 0.0,
            "decode_tok_s": (n - 1) / t_decode if n > 1 and t_decode > 0 else 0.0,
        }
        yield StepEvent(None, detok.flush(), None, ev.finish_reason, timings)


# Where at most this many tokens are legal, a captured step keeps each one's probability (enum,
# boolean and digit positions); inside a free string only the chosen token's.
CHOICE_OPTIONS = 256


def step_choice(masked_logits: np.ndarray, mask: np.ndarray, token: int) -> StepChoice:
    """The chosen token's probability among the legal ones, at temperature 1 (what the model
    believes, whatever the request samples with)."""
    legal = np.flatnonzero(mask)
    z = masked_logits[legal].astype(np.float64)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    chosen = float(p[np.searchsorted(legal, token)])
    if legal.size > CHOICE_OPTIONS:
        return StepChoice(int(legal.size), chosen)
    order = np.argsort(-p, kind="stable")
    return StepChoice(int(legal.size), chosen, tuple((int(legal[i]), float(p[i])) for i in order))


def _top(lsm: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely tokens, best first, ties by ascending id."""
    k = min(k, int(np.isfinite(lsm).sum()))  # a grammar's masked-out tokens are no alternative
    if k <= 0:
        return ()
    cand = np.argpartition(-lsm, k - 1)[:k]
    cand = cand[np.lexsort((cand, -lsm[cand]))]
    return tuple((int(t), float(lsm[t])) for t in cand)
