"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens.

A request is turned into the same chat messages, tools and sampling the OpenAI route uses, and
runs the same plan; only the edges differ: the request shape, the named-event stream
(message_start, content_block_*, message_delta, message_stop, ping; no [DONE]) and the error
envelope (see errors.py). thinking, cache_control and metadata are accepted and ignored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from functools import partial
from typing import Annotated, Any

from aiohttp import web
from pydantic import Field

from . import plan as planning
from .chunks import Chunk, NamedEvents
from .deltas import Delta
from .errors import APIError, bad_request
from .keys import CAPS, REGISTRY
from .routes import prompt_ids, read_body, run_plan
from .schemas import _Body, parse
from .tools import prepare_messages

routes = web.RouteTableDef()

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesRequest(_Body):
    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # required by create, not by count_tokens
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # accepted, ignored
    thinking: dict[str, Any] | None = None  # accepted, ignored: no model here thinks
    goinfer_confidence: bool = False


# -- request -> chat messages ----------------------------------------------------------------------
def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it (OpenAI-shaped dicts)."""
    out: list[dict[str, Any]] = []
    system = _system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(
                f"messages.{i}.role: {role!r} is not a valid role: messages alternate 'user' and 'assistant' "
                "(the system prompt is the top-level 'system' field)",
                param=f"messages.{i}.role",
            )
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(
                f"messages.{i}.content must be a string or a list of blocks", f"messages.{i}.content"
            )
        out.extend(_turn(role, blocks, i))
    return out


def _system_text(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for j, b in enumerate(system):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"system.{j}: only text blocks are accepted in system", param=f"system.{j}")
        texts.append(b["text"])
    return "\n".join(texts)


def _turn(role: str, blocks: list[Any], i: int) -> list[dict[str, Any]]:
    """One Anthropic message -> chat messages: tool results become tool messages (first, as they
    answer the previous turn's calls), tool_use blocks the assistant's tool_calls."""
    texts, calls, results = [], [], []
    for j, b in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "image":
            raise bad_request(
                f"{where}: image content needs a vision model (vision: false here)", f"{where}.type"
            )
        elif kind == "tool_use" and role == "assistant":
            args = json.dumps(b.get("input") or {}, ensure_ascii=False)
            fn = {"name": b.get("name"), "arguments": args}
            calls.append({"id": str(b.get("id", "")), "type": "function", "function": fn})
        elif kind == "tool_result" and role == "user":
            text = _result_text(b.get("content"), where)
            if b.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")), "content": text})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # replayed reasoning: no model here thinks, so there is nothing to render
        else:
            raise bad_request(
                f"{where}: unsupported content block type {kind!r} for role {role!r}", f"{where}.type"
            )
    out = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for b in content:
        if not isinstance(b, dict) or b.get("type") != "text":
            raise bad_request(f"{where}.content: only text blocks are supported in a tool_result", where)
        parts.append(b.get("text", ""))
    return "\n".join(parts)


def openai_tools(req: MessagesRequest) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """(tools, tool_choice, parallel_tool_calls) in the OpenAI form the tools module reads."""
    tools = None
    if req.tools:
        tools = []
        for t in req.tools:
            fn = {
                "name": t.get("name"),
                "description": t.get("description", ""),
                "parameters": t.get("input_schema"),
            }
            tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    tc = req.tool_choice or {"type": "auto"}
    kind = tc.get("type")
    choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        choice = {"type": "function", "function": {"name": tc.get("name")}}
    elif choice is None:
        raise bad_request(
            f"tool_choice.type {kind!r} is not one of 'auto', 'any', 'tool', 'none'", "tool_choice"
        )
    parallel = None if "disable_parallel_tool_use" not in tc else not tc["disable_parallel_tool_use"]
    return tools, choice, parallel


async def _prepare(request: web.Request, need_max_tokens: bool):
    app = request.app
    req: MessagesRequest = parse(MessagesRequest, await read_body(request, app[CAPS].text))
    if need_max_tokens and req.max_tokens is None:
        raise bad_request("max_tokens: Field required", param="max_tokens")
    if req.goinfer_confidence:
        raise bad_request("goinfer_confidence is not offered on /v1/messages", param="goinfer_confidence")
    slot = app[REGISTRY].route(req.model)
    tools, choice, parallel = openai_tools(req)
    rules = planning.rules(slot.engine, None, False, tools, choice, parallel)
    messages = prepare_messages(chat_messages(req), rules.tools, slot.engine.info.chat_template)
    ids = await prompt_ids(slot, partial(slot.engine.chat_ids, **rules.template_vars()), messages)
    return req, slot, rules, ids


@routes.post("/v1/messages")
async def create(request: web.Request) -> web.StreamResponse:
    req, slot, rules, ids = await _prepare(request, need_max_tokens=True)
    sampling = planning.Sampling(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        max_tokens=req.max_tokens,
        stops=tuple(req.stop_sequences or ()),
    )
    job = planning.make_plan(sampling, ids, slot.name, slot.engine.info.context_window, rules)
    return await run_plan(request, slot, job, MessageEvents(slot.name, len(ids)), req.stream, fold_message)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    _req, _slot, _rules, ids = await _prepare(request, need_max_tokens=False)
    return web.json_response({"input_tokens": len(ids)})


# -- the stream ------------------------------------------------------------------------------------
class MessageEvents(NamedEvents):
    """Deltas -> Anthropic's named events. Text and each tool call are content blocks in order;
    prose before a call is its own text block."""

    keepalive = b'event: ping\ndata: {"type": "ping"}\n\n'

    def __init__(self, model: str, input_tokens: int):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model, self.input_tokens = model, input_tokens
        self.index = -1
        self.open: str | None = None  # the kind of the open content block

    def sse_error(self, err: APIError) -> bytes:
        return self.sse(err.body(anthropic=True))

    def start(self) -> list[Chunk]:
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _close(self) -> list[Chunk]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _begin(self, block: dict[str, Any]) -> list[Chunk]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return [*out, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def step(self, d: Delta) -> list[Chunk]:
        out: list[Chunk] = []
        if d.text:
            if self.open != "text":
                out += self._begin({"type": "text", "text": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": d.text}})  # fmt: skip
        for t in d.tool_calls:
            if t.id is not None:
                block = {
                    "type": "tool_use",
                    "id": "toolu_" + t.id.removeprefix("call_"),
                    "name": t.name,
                    "input": {},
                }
                out += self._begin(block)
            if t.arguments:
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "input_json_delta", "partial_json": t.arguments}})  # fmt: skip
        if d.finish_reason is not None:
            out += self._close()
            reason = STOP_REASONS.get(d.finish_reason, "end_turn")
            if d.stop_sequence is not None:
                reason = "stop_sequence"
            usage = {"output_tokens": d.usage.completion_tokens if d.usage else 0}
            delta = {"stop_reason": reason, "stop_sequence": d.stop_sequence}
            out += [{"type": "message_delta", "delta": delta, "usage": usage}, {"type": "message_stop"}]
        return out


def fold_message(events: Iterable[Chunk]) -> dict[str, Any]:
    """The whole message from its events (the non-streaming reply)."""
    message: dict[str, Any] = {}
    blocks: list[dict[str, Any]] = []
    partial_json: dict[int, str] = {}
    for e in events:
        kind = e["type"]
        if kind == "message_start":
            message = dict(e["message"])
        elif kind == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif kind == "content_block_delta":
            delta = e["delta"]
            if delta["type"] == "text_delta":
                blocks[e["index"]]["text"] += delta["text"]
            else:
                partial_json[e["index"]] = partial_json.get(e["index"], "") + delta["partial_json"]
        elif kind == "message_delta":
            message.update(e["delta"])
            message["usage"] = {**message["usage"], **e["usage"]}
    for i, text in partial_json.items():
        try:
            blocks[i]["input"] = json.loads(text)
        except ValueError:
            blocks[i]["input"] = {}  # cut by max_tokens mid-arguments
    message["content"] = blocks
    return message
