"""One request pipeline for every API: a Job (job.py) in, SSE or a folded JSON reply out.

    route -> rules -> messages -> prompt ids -> constraint -> plan -> run -> events

Every check comes before the job is queued, so a bad request is an error response and never half a
stream. The run crosses into the runtime once: prompt ids, sampling and the constraint go to
`Engine.generate`, token events come back, and the reply (stop strings, logprobs, tool calls,
confidence) is built here in serve/, on the model's worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

from aiohttp import web
from goinfer.runtime.grammar import Constraint
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.stream import StepEvent

from .confidence import recorded, with_confidence
from .config import SamplingDefaults
from .deltas import Delta, text_deltas
from .engine import Engine
from .errors import APIError, bad_request
from .job import Job
from .keys import CONFIG, REGISTRY
from .registry import ModelSlot
from .respond import respond
from .rules import Rules, rules_for
from .tools import prepare_messages
from .tools.stream import ToolDeltas

log = logging.getLogger("goinfer.serve")


@dataclass(frozen=True)
class Prompt:
    """A job made concrete for one model: its slot, rules, prompt ids and compiled constraint."""

    slot: ModelSlot
    rules: Rules
    ids: list[int]
    constraint: Constraint | None


@dataclass(frozen=True)
class Plan:
    """What the model's worker runs: checked against the context window, defaults filled in."""

    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    logprobs: bool
    top_logprobs: int
    rules: Rules = field(default_factory=Rules)
    constraint: Constraint | None = None  # stateful: one plan, one run

    def deltas(self, engine: Engine, cancel: threading.Event | None = None) -> Iterator[Delta]:
        """The one generation path: the engine's token events folded into client deltas."""
        confidence = self.rules.confidence
        events: Iterator[StepEvent] = engine.generate(
            self.prompt_ids,
            self.params,
            self.top_logprobs if self.logprobs else None,
            constraint=self.constraint,
            capture=confidence is not None,
            cancel=cancel,
        )
        events = logged(events, self.model)
        steps: list[StepEvent] = []
        if confidence is not None:
            events = recorded(events, steps)
        tools = self.rules.tools
        end_at = tools.reply_end if tools is not None else None
        out = text_deltas(events, len(self.prompt_ids), self.stops, engine.token_text, self.logprobs, end_at)
        if tools is not None:
            out = ToolDeltas(tools.fmt, tools.names)(out)
        if confidence is not None:
            out = with_confidence(out, steps, confidence, engine.token_text)
        return out


def logged(events: Iterator[StepEvent], model: str) -> Iterator[StepEvent]:
    """The engine's events, and one log line per generation (as llama-server prints): the prompt,
    how much of it was reused, the time to the first token (queue and prefill), the decode rate."""
    start = time.perf_counter()
    first, n, counts, finish = start, 0, {}, "closed early"  # a stop string, a call's end, a client gone
    try:
        for ev in events:
            if ev.token_id is None:
                finish = ev.finish_reason or finish
            else:
                n += 1
                if n == 1:
                    first, counts = time.perf_counter(), ev.timings
            yield ev
    except Exception as e:  # Cancelled, KVCacheFull, a failed forward: the reply says more
        finish = type(e).__name__
        raise
    finally:
        end = time.perf_counter()
        rate = (n - 1) / (end - first) if n > 1 and end > first else 0.0
        log.info(
            "%s: prompt %s tokens (%s reused), first token after %.2f s; %d generated at %.1f tok/s (%s)",
            model, counts.get("prompt_tokens", "?"), counts.get("cached_tokens", "?"), first - start, n, rate,
            finish,
        )  # fmt: skip


async def run(request: web.Request, job: Job) -> web.StreamResponse:
    """The whole pipeline: queue the plan on the model's worker; its events as SSE, or their fold."""
    prompt = await prepare(request, job)
    cfg = request.config_dict[CONFIG]
    plan = make_plan(job, prompt, cfg.sampling)
    work = prompt.slot.submit(partial(plan.deltas, prompt.slot.engine), cfg.poll_s, cfg.retry_after_s)
    return await respond(request, work, job.reply(plan), stream=job.stream, keepalive_s=cfg.keepalive_s)


async def prepare(request: web.Request, job: Job) -> Prompt:
    """Route, rules, messages, prompt ids and the compiled constraint (all a count of tokens needs)."""
    slot = request.config_dict[REGISTRY].route(job.model)
    engine = slot.engine
    rules = rules_for(engine, job)
    ids = await prompt_ids(slot, job, rules)
    constraint = await asyncio.to_thread(rules.constraint, engine) if rules.constrained else None
    return Prompt(slot, rules, ids, constraint)


async def prompt_ids(slot: ModelSlot, job: Job, rules: Rules) -> list[int]:
    engine = slot.engine
    if job.messages is not None:
        messages = prepare_messages(job.messages, rules.tools, engine.info.chat_template)
        return await _tokenized(slot, partial(engine.chat_ids, messages, **rules.template_vars()))
    if isinstance(job.prompt, str):
        return await _tokenized(slot, partial(engine.text_ids, job.prompt))
    ids = list(job.prompt or ())
    vocab = engine.info.vocab_size
    if vocab and max(ids) >= vocab:
        raise bad_request(f"prompt: token id {max(ids)} is outside the vocabulary (size {vocab})", "prompt")
    return ids


async def _tokenized(slot: ModelSlot, fn: Callable[[], list[int]]) -> list[int]:
    try:
        return await asyncio.to_thread(fn)  # tokenizer work stays off the event loop
    except ValueError as e:  # the chat template refused these messages (e.g. roles must alternate)
        raise APIError(
            422, f"model {slot.name!r}: {e}", param="messages", code="chat_template_error"
        ) from None


def make_plan(job: Job, prompt: Prompt, defaults: SamplingDefaults) -> Plan:
    """Check the prompt against the window, clamp the budget to it; fill the defaults."""
    s, name, n = job.sampling, prompt.slot.name, len(prompt.ids)
    window = prompt.slot.engine.info.context_window
    if n >= window:
        raise bad_request(
            f"the prompt is {n} tokens, over the context window of {window} tokens for model "
            f"{name!r} (prompt and completion must fit in {window})",
            param=job.prompt_field,
            code="context_length_exceeded",
        )
    # A budget past what the window leaves is clamped, as llama.cpp does: the reply ends with
    # finish_reason "length" at the window (agents ask for 32000 whatever the model).
    room = window - n
    default = room if s.default_max_tokens is None else min(s.default_max_tokens, room)
    params = SamplingParams(
        temperature=defaults.temperature if s.temperature is None else s.temperature,
        top_k=defaults.top_k if s.top_k is None else s.top_k,
        top_p=defaults.top_p if s.top_p is None else s.top_p,
        min_p=defaults.min_p if s.min_p is None else s.min_p,
        seed=s.seed,
        frequency_penalty=s.frequency_penalty or 0.0,
        presence_penalty=s.presence_penalty or 0.0,
        max_tokens=min(s.max_tokens, room) if s.max_tokens is not None else default,
    )
    rules, constraint = prompt.rules, prompt.constraint
    return Plan(name, prompt.ids, params, s.stops, s.logprobs, s.top_logprobs, rules, constraint)
