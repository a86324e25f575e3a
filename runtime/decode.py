"""A generation: a GenerationRequest in, StepEvents out, and the decode loop between them.

`GenerationRequest` is the one value a generation crosses into the runtime with (serve/, the CLI
and tests build it); `StepEvent` is what comes back, one per token, then one with the finish
reason. Everything a client sees (stop strings, logprobs, tool calls, per-field confidence) is
built from those in serve/. The loop (`generate_events`) runs over any source of logits:
`Model.generate` and the server's scheduler run it over the compiled model, tests over fake
logits; it samples, applies grammar masks, records logprobs and captured choices, detokenizes,
and decides the reply's token budget.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .grammar import Constraint
from .sampler import Sampler, SamplingParams, log_softmax
from .thinking import ReasoningBudget

if TYPE_CHECKING:
    from tokenizers import Tokenizer


# -- what crosses the boundary ------------------------------------------------------------------
@dataclass(frozen=True)
class GenerationRequest:
    """A prompt and how to continue it.

    `logprobs` None: no log-probabilities; k: each token's and its k most likely alternatives.
    `constraint` masks every step (stateful: one request, one run); `capture` records each masked
    step's choice (per-field confidence). `reasoning` closes a thinking block in time
    (runtime/thinking.py); a grammar applies to the answer after the block."""

    prompt_ids: Sequence[int]
    sampling: SamplingParams
    logprobs: int | None = None
    constraint: Constraint | None = None
    capture: bool = False
    reasoning: ReasoningBudget | None = None

    def budget(self, window: int) -> int:
        """Tokens the reply may have: what was asked (None: all that is left), clamped to what
        `window` leaves after the prompt, as llama.cpp clamps (the reply then ends with "length")."""
        room = window - len(self.prompt_ids)
        asked = self.sampling.max_tokens
        return room if asked is None else max(0, min(asked, room))


@dataclass(frozen=True)
class StepChoice:
    """What a grammar left open at one step, for per-field confidence: the chosen token's
    probability among the legal tokens (temperature 1), how many were legal, and, where few were,
    each legal token's probability."""

    legal: int
    prob: float
    options: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepEvent:
    """One generated token, or the end of the stream (token_id None, finish_reason set)."""

    token_id: int | None
    text: str
    logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length"
    timings: dict[str, float] = field(default_factory=dict)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the most likely alternatives, best first
    choice: StepChoice | None = None  # set when a grammar masked this step and capture was asked


# -- the loop ---------------------------------------------------------------------------------
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
    prompt_ids: Sequence[int] = (),
    reasoning: ReasoningBudget | None = None,
) -> Iterator[StepEvent]:
    """The decode loop over any logits source (`step(token)` gives the next logits): one event per
    token, then a final event with finish_reason and timings["completion_tokens"].

    `logprobs` k >= 0 puts each token's log-probability on its event, with the k most likely
    alternatives; None skips them (a full-vocabulary log-softmax per token: ~1.9 ms on Qwen's
    152k vocabulary). `constraint` masks each step to what a grammar allows and ends the reply
    when the grammar is complete; `capture` records each masked step's choice (StepChoice).
    `prompt_ids` are what repetition_penalty counts as seen before the first token. logit_bias and
    the penalties act inside the sampler, on the masked logits (a bias never lifts a forbidden
    token); logprobs are the model's, before them.

    `reasoning` follows the reply in and out of its thinking blocks: a grammar waits while the model
    thinks (it constrains the answer), and once a block has used its budget the next token is
    forced to be its closing one (every other masked out, as a grammar masks)."""
    sampler = Sampler(params, prompt_ids)
    block = reasoning.tracker(budget) if reasoning is not None else None
    n, finish = 0, "length"
    while n < budget:
        mask = None
        thinking = block is not None and block.inside
        if constraint is not None and not thinking:
            if constraint.finished:
                finish = "stop"
                break
            mask = constraint.allowed()
            if mask is not None:
                logits = np.where(mask, logits, np.float32(-np.inf))
        if block is not None and block.forced(n):
            assert reasoning is not None
            logits = only(logits, reasoning.close_id)
        tok = sampler(logits)
        if tok in stop_ids:
            finish = "stop"
            break
        if block is not None:
            opened = tok == reasoning.open_id and not thinking
            block.push(tok)
            thinking = thinking or opened  # the block's own delimiters are not the answer's either
        if constraint is not None and not thinking:
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


def only(logits: np.ndarray, token: int) -> np.ndarray:
    """`logits` with every token but `token` masked out: the sampler can choose nothing else."""
    out = np.full_like(logits, -np.inf)
    out[token] = logits[token] if np.isfinite(logits[token]) else 0.0
    return out


def generate_events(
    request: GenerationRequest,
    detok: Detokenizer,
    prefill: Callable[[], tuple[np.ndarray, int]],
    step: Callable[[int], np.ndarray],
    window: int,
    stop_ids: frozenset[int],
) -> Iterator[StepEvent]:
    """A whole generation over any model driver: `prefill()` feeds the prompt and gives the last
    position's logits and how many prompt tokens the cache already held (reused, not computed);
    `step(token)` feeds one token; the reply gets what `window` leaves (`request.budget`). Token
    events, then a final one whose timings carry the counts (prompt, cached and completion tokens)
    and the prefill and decode rates."""
    prompt_ids = request.prompt_ids
    t0 = time.perf_counter()
    logits, cached = prefill()
    t_prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    first = True
    r = request
    budget = r.budget(window)
    for ev in sample_tokens(
        logits,
        step,
        budget,
        r.sampling,
        stop_ids,
        detok.push,
        r.logprobs,
        r.constraint,
        r.capture,
        prompt_ids,
        r.reasoning,
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


class Detokenizer:
    """Incremental detokenization that never emits half a UTF-8 character: decoding token by
    token breaks multi-byte characters and SentencePiece spacing, so the suffix since the last
    emitted point is decoded whole, and only text that is final (not ending in U+FFFD, an
    incomplete byte sequence later tokens will finish) goes out."""

    def __init__(self, tokenizer: Tokenizer, prefix_ids: list[int] | None = None):
        self.tok = tokenizer
        # A little context before the new tokens keeps leading-space rules right.
        self.ids: list[int] = list(prefix_ids[-4:]) if prefix_ids else []
        self.start = len(self.ids)
        self.emitted = self._decode(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False) if ids else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the newly final text (maybe empty)."""
        self.ids.append(token_id)
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        self._compact()
        return new

    def flush(self) -> str:
        text = self._decode(self.ids)
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new

    def _compact(self) -> None:
        # Keep the window short so each push stays O(1) on long generations.
        if len(self.ids) > 16:
            self.ids = self.ids[-4:]
            self.emitted = self._decode(self.ids)
