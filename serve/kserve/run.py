"""One KServe request through the pipeline a /v1/completions request takes: route, rules, prompt
ids, plan, then the model slot's queue (429 when full) and its scheduler. No web.Request here, so
gRPC and REST share it; what differs is only how the deltas are sent."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial

from aiohttp import web

from .. import pipeline
from ..errors import APIError, bad_request
from ..events import Delta, Usage
from ..keys import CONFIG, REGISTRY
from ..metrics import METRICS
from ..registry import ModelSlot
from . import llm

VERSION = "1"  # every model here has the one version


def slot_for(app: web.Application, name: str, version: str = "") -> ModelSlot:
    """The decoder a request names: 404 for an unknown name or version, 400 for an encoder."""
    if not name:
        raise bad_request("model_name is required", "model_name")
    slot = app[REGISTRY].route(name)
    if version not in ("", VERSION):
        raise APIError(404, f"model {name!r} has no version {version!r} (versions: [{VERSION!r}])")
    return slot


def ready(app: web.Application) -> bool:
    """Ready for new work: a decoder served and no halt (a balancer then sends requests elsewhere)."""
    registry = app[REGISTRY]
    try:
        registry.check_halt()
    except APIError:
        return False
    return bool(registry.slots)


@dataclass
class Outcome:
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None


async def deltas(app: web.Application, model: str, version: str, req: llm.LLMRequest) -> AsyncIterator[Delta]:
    """The run's deltas; leaving early cancels it (the slot's Generation sees to that)."""
    arrived = time.perf_counter()
    slot = slot_for(app, model, version)
    cfg = app[CONFIG]
    job = llm.job(slot.name, req)
    rules = pipeline.rules_for(slot.engine, job)
    ids = await pipeline.prompt_ids(slot, job, rules)
    plan = pipeline.make_plan(job, slot, rules, ids, (), cfg.sampling)
    metrics = app.get(METRICS)  # counted in /metrics as the OpenAI routes' requests are
    watch = metrics.watch(slot.name, arrived) if metrics is not None else None
    run = slot.submit(partial(plan.deltas, slot.engine, watch=watch), cfg.poll_s, cfg.retry_after_s)
    async with aclosing(run.ticks()) as ticks:
        async for d in ticks:
            if d is not None:
                yield d


async def collect(app: web.Application, model: str, version: str, req: llm.LLMRequest) -> Outcome:
    """The whole reply, with the prompt before it unless exclude_input_in_output (vLLM's rule)."""
    out = Outcome()
    parts = [] if req.exclude_input else [req.prompt]
    async with aclosing(deltas(app, model, version, req)) as ds:
        async for d in ds:
            parts.append(d.text)
            out.finish_reason = d.finish_reason or out.finish_reason
            out.usage = d.usage or out.usage
    out.text = "".join(parts)
    return out
