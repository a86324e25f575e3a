"""One batch line through the very pipeline a live request takes, at batch priority.

A line's body is read by its route's own schema and Job maker (routes.py, messages.py), then goes
through pipeline.py's steps (rules, prompt ids, constraint, plan) and the model's slot, and its
reply is folded by the route's own event builder: the body is the one the route would return.

Priority without touching the scheduler: a batch line is handed to the slot only while a worker
is free beyond `reserve` (kept for interactive requests), so an interactive request is never
queued behind batch work; and when one does wait (every worker busy), the youngest batch line is
preempted (cancelled, and run again later with the same body and seed, so it draws the same
reply). Interactive requests are admitted first; batch work goes on in whatever room is left.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from . import messages, pipeline, routes
from .batch_format import CHAT, COMPLETIONS, MESSAGES
from .config import ServeConfig
from .errors import APIError, Envelope, openai_envelope
from .events import chunk_stream
from .middleware import Body, parse
from .registry import Generation, ModelSlot, Registry

GATE_POLL_S = 0.02  # how often a waiting line looks for a free worker


@dataclass(frozen=True)
class Outcome:
    status: int  # the HTTP status the route would have answered
    body: dict[str, Any]  # its body: the reply, or the API's error envelope
    tokens: int = 0  # completion tokens (progress lines)


@dataclass
class Gate:
    """How many of a slot's workers batch lines may take: `limit` lines at once at most, and never
    the last `reserve` free workers."""

    limit: int
    reserve: int = 1
    running: dict[ModelSlot, list[Generation]] = field(default_factory=dict)
    preempted: set[Generation] = field(default_factory=set)

    def room(self, slot: ModelSlot) -> bool:
        mine = sum(len(v) for v in self.running.values())
        free = slot.max_concurrent - slot.admitted
        keep = min(self.reserve, slot.max_concurrent - 1)  # a one-worker slot still runs batches
        return mine < self.limit and free > keep

    async def wait(self, slot: ModelSlot) -> None:
        while not self.room(slot):
            await asyncio.sleep(GATE_POLL_S)

    def start(self, slot: ModelSlot, run: Generation) -> None:
        self.running.setdefault(slot, []).append(run)

    def end(self, slot: ModelSlot, run: Generation) -> bool:
        """Forget the run; True when it was preempted (its reply is not whole: run it again)."""
        self.running[slot].remove(run)
        if run in self.preempted:
            self.preempted.discard(run)
            return True
        return False

    def preempt_for_waiting(self, slot: ModelSlot) -> None:
        """Someone waits for a worker that batch lines hold: free one, the youngest."""
        runs = [r for r in self.running.get(slot, ()) if r not in self.preempted]
        if runs and slot.admitted > slot.max_concurrent:
            self.preempted.add(runs[-1])
            runs[-1].cancelled.set()


_SCHEMAS: dict[str, tuple[type[Body], Callable[[Any], pipeline.Job]]] = {
    CHAT: (routes.ChatRequest, routes.chat_job),
    COMPLETIONS: (routes.CompletionRequest, routes.completion_job),
    MESSAGES: (messages.MessagesRequest, messages.job),
}


def envelope_for(url: str) -> Envelope:
    return messages.anthropic_envelope if url == MESSAGES else openai_envelope


async def answer(
    registry: Registry, config: ServeConfig, url: str, body: dict[str, Any], gate: Gate
) -> Outcome:
    """The line's reply as its route would give it: (status, body)."""
    try:
        schema, make_job = _SCHEMAS[url]
        job = make_job(parse(schema, json.dumps(body).encode()))
        slot = registry.route(job.model)
        rules = pipeline.rules_for(slot.engine, job)
        ids = await pipeline.prompt_ids(slot, job, rules, config.thinking)
        masks = await pipeline.choice_masks(rules, slot.engine, job.sampling.n)
        plan = pipeline.make_plan(job, slot, rules, ids, masks, config.sampling, config.thinking)
        while True:
            reply = await _run(slot, plan, job, config, gate)
            if reply is not None:
                return Outcome(200, reply, _tokens(reply))
    except APIError as e:
        return Outcome(e.status, envelope_for(url)(e))


async def _run(
    slot: ModelSlot, plan: pipeline.Plan, job: pipeline.Job, config: ServeConfig, gate: Gate
) -> dict[str, Any] | None:
    """One try on a worker; None when it was preempted."""
    await gate.wait(slot)
    run = slot.submit(partial(plan.deltas, slot.engine), config.poll_s, config.retry_after_s)
    gate.start(slot, run)
    builder = job.reply(plan.reply())
    chunks = []
    try:
        async with aclosing(chunk_stream(run, builder)) as stream:  # a cancelled task stops the run
            async for c in stream:
                if c is not None:
                    chunks.append(c)
                gate.preempt_for_waiting(slot)
    finally:
        preempted = gate.end(slot, run)
    return None if preempted else builder.fold(chunks)


def _tokens(reply: dict[str, Any]) -> int:
    usage = reply.get("usage") or {}
    return int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0)
