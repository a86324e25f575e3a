"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models, and /health.

A generation request goes: read the body (capped) -> validate -> route to a model -> tokenize off
the loop -> plan (limits checked) -> queue on the model's worker -> one chunk stream -> SSE or fold.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from aiohttp import web

from . import plan as planning
from .chunks import ChatChunks, CompletionChunks, fold_chat, fold_completion
from .errors import APIError, bad_request
from .keys import CAPS, CONFIG, REGISTRY, STARTED
from .registry import ModelSlot
from .respond import respond
from .schemas import ChatRequest, CompletionRequest, parse
from .tools import prepare_messages

routes = web.RouteTableDef()


async def read_body(request: web.Request, cap: int) -> bytes:
    """The body, refusing past `cap` bytes (Content-Length was checked before; this covers chunked)."""
    parts, size = [], 0
    while chunk := await request.content.read(64 * 1024):
        size += len(chunk)
        if size > cap:
            raise APIError(
                413, f"request body is over the {cap}-byte cap for {request.path}", code="body_too_large"
            )
        parts.append(chunk)
    return b"".join(parts)


async def prompt_ids(slot: ModelSlot, fn, arg: Any) -> list[int]:
    try:
        return await asyncio.to_thread(fn, arg)
    except ValueError as e:  # the chat template refused these messages (e.g. roles must alternate)
        raise APIError(
            422, f"model {slot.name!r}: {e}", param="messages", code="chat_template_error"
        ) from None


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    req: ChatRequest = parse(ChatRequest, await read_body(request, app[CAPS].text))
    planning.refuse_unsupported(req)
    slot = app[REGISTRY].route(req.model)
    rules = planning.rules(
        slot.engine,
        req.response_format,
        req.goinfer_confidence,
        req.tools,
        req.tool_choice,
        req.parallel_tool_calls,
    )
    messages = prepare_messages(
        planning.chat_messages(list(req.messages)), rules.tools, slot.engine.info.chat_template
    )
    ids = await prompt_ids(slot, partial(slot.engine.chat_ids, **rules.template_vars()), messages)
    job = planning.make_plan(
        planning.openai_sampling(req), ids, slot.name, slot.engine.info.context_window, rules
    )
    builder = ChatChunks(slot.name, include_usage=req.include_usage or not req.stream)
    return await run_plan(request, slot, job, builder, req.stream, partial(fold_chat, logprobs=job.logprobs))


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    req: CompletionRequest = parse(CompletionRequest, await read_body(request, app[CAPS].text))
    planning.refuse_unsupported(req)
    slot = app[REGISTRY].route(req.model)
    rules = planning.rules(slot.engine, req.response_format, req.goinfer_confidence)
    prompt = planning.completion_prompt(req)
    if isinstance(prompt, str):
        ids = await prompt_ids(slot, slot.engine.text_ids, prompt)
    else:
        vocab = slot.engine.info.vocab_size
        if vocab and max(prompt) >= vocab:
            raise bad_request(
                f"prompt: token id {max(prompt)} is outside the vocabulary (size {vocab})", "prompt"
            )
        ids = list(prompt)
    sampling, window = planning.openai_sampling(req), slot.engine.info.context_window
    job = planning.make_plan(sampling, ids, slot.name, window, rules, prompt_field="prompt")
    builder = CompletionChunks(slot.name, include_usage=req.include_usage or not req.stream)
    return await run_plan(
        request, slot, job, builder, req.stream, partial(fold_completion, logprobs=job.logprobs)
    )


async def run_plan(
    request, slot: ModelSlot, job: planning.Plan, builder, stream: bool, fold
) -> web.StreamResponse:
    """Queue the plan on the model's worker; send its events as SSE, or their fold as one reply."""
    cfg = request.app[CONFIG]
    run = slot.submit(partial(job.deltas, slot.engine), cfg.poll_s, cfg.retry_after_s)
    return await respond(request, run, builder, stream=stream, keepalive_s=cfg.keepalive_s, fold=fold)


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    app = request.app
    data = [model_entry(slot, app[STARTED]) for slot in app[REGISTRY].slots.values()]
    return web.json_response({"object": "list", "data": data})


def model_entry(slot: ModelSlot, created: int) -> dict[str, Any]:
    info = slot.engine.info
    return {
        "id": slot.name,
        "object": "model",
        "created": created,
        "owned_by": "goinfer",
        "context_window": info.context_window,
        "decode_path": info.decode_path,
        "prefill_path": info.prefill_path,
        "quant": info.quant,
        "vision": info.vision,
    }


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    reg = request.app[REGISTRY]
    models = {name: {"running_or_queued": s.admitted} for name, s in reg.slots.items()}
    return web.json_response({"status": "ok", "models": models, "loading": sorted(reg.loading)})
