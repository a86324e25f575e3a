"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens, as an aiohttp sub-app.

A request becomes the same Job the OpenAI routes make (chat messages, tools, sampling) and runs
through the same pipeline; only the edges differ: the request shape, the named-event stream
(message_start, content_block_*, message_delta, message_stop, ping; no [DONE]) and the error
envelope, which the sub-app's own error middleware answers in.

`thinking` drives a thinking model (serve/thinking.py): enabled (with its budget_tokens) or
disabled; its reasoning comes back as a `thinking` content block before the answer's, and thinking
blocks a client sends back on an assistant turn are rendered as the model's template renders
replayed reasoning. Fields that do not apply here are accepted and ignored: cache_control (prefix
reuse is automatic), context_management, metadata, output_config.effort, the `anthropic-beta`
header and `?beta=true`. Structured output
(`output_config.format`, or the older `output_format`) takes the response_format grammar path,
strict: a schema it cannot enforce is a 400 naming the keyword.

`messages` holds user and assistant turns, as upstream; a system message there is a 400 unless the
request opts in with the `mid-conversation-system-*` beta, as Claude Code does. It is then folded
into a user turn, ahead of its text, so every chat template can render it and the user's words
stay last before the reply: the turn it follows, else the next one, or the system prompt when it
comes first.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Annotated, Any

from aiohttp import web
from pydantic import Field

from . import pipeline
from .errors import APIError, bad_request
from .events import Chunk, Delta, NamedEvents
from .middleware import Body, guards, read_request, text_body
from .pipeline import Job, Sampling, ThinkingAsk, refused, text_of
from .thinking import AFTER_RESULTS

PREFIX = "/v1/messages"
routes = web.RouteTableDef()

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_envelope(err: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def app() -> web.Application:
    """The sub-app, mounted at PREFIX: its own error middleware speaks Anthropic's envelope."""
    sub = web.Application(middlewares=guards(anthropic_envelope))
    sub.add_routes(routes)
    return sub


class MessagesRequest(Body):
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
    thinking: dict[str, Any] | None = None  # enabled (budget_tokens) | disabled | adaptive
    output_config: dict[str, Any] | None = None  # its format is honoured, its effort ignored
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's spelling of the format
    goinfer_confidence: bool = False


# -- request -> chat messages ----------------------------------------------------------------------
SYSTEM_TURNS_BETA = "mid-conversation-system"  # anthropic-beta: mid-conversation-system-2026-04-07


def chat_messages(req: MessagesRequest, system_turns: bool = False) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it (OpenAI-shaped dicts)."""
    system = [text_of(req.system, "system")]
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # system text met after an assistant turn, for the next user turn
    for i, m in enumerate(req.messages):
        role = m.get("role")
        if role not in ("user", "assistant", "system") or (role == "system" and not system_turns):
            raise bad_request(
                f"messages.{i}.role: {role!r} is not a valid role: messages alternate 'user' and 'assistant' "
                "(the system prompt is the top-level 'system' field; a system message inside messages "
                f"needs the anthropic-beta header {SYSTEM_TURNS_BETA}-2026-04-07)",
                param=f"messages.{i}.role",
            )
        content = m.get("content")
        if role == "system":
            text = text_of(content, f"messages.{i}.content")
            if out and out[-1]["role"] == "user":
                out[-1]["content"] = _joined(text, out[-1]["content"])
            elif not out:
                system.append(text)
            else:
                pending.append(text)
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(
                f"messages.{i}.content must be a string or a list of blocks", f"messages.{i}.content"
            )
        turn = _turn(role, blocks, i)
        if pending and turn[-1]["role"] == "user":
            turn[-1]["content"] = _joined(*pending, turn[-1]["content"])
            pending.clear()
        out.extend(turn)
    if pending:
        out.append({"role": "user", "content": _joined(*pending)})
    if not any(m["role"] in ("user", "assistant", "tool") for m in out):
        raise bad_request("messages: at least one user message is needed", param="messages")
    prompt = _joined(*system)
    return [{"role": "system", "content": prompt}, *out] if prompt else out


def _joined(*texts: str) -> str:
    return "\n\n".join(t for t in texts if t)


def _turn(role: str, blocks: list[Any], i: int) -> list[dict[str, Any]]:
    """One Anthropic message -> chat messages: tool results become tool messages (first, as they
    answer the previous turn's calls), tool_use blocks the assistant's tool_calls."""
    texts, calls, results, thoughts = [], [], [], []
    for j, b in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            args = json.dumps(b.get("input") or {}, ensure_ascii=False)
            fn = {"name": b.get("name"), "arguments": args}
            calls.append({"id": str(b.get("id", "")), "type": "function", "function": fn})
        elif kind == "tool_result" and role == "user":
            text = text_of(b.get("content"), f"{where}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")), "content": text})
        elif kind == "thinking" and role == "assistant" and isinstance(b.get("thinking"), str):
            thoughts.append(b["thinking"])  # replayed reasoning: the template decides what to render
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by another server: nothing here can read it
        else:
            raise refused(where, kind, f"not accepted for role {role!r}")
    out = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if results:  # text beside tool results: a thinking model reads it with them (serve/thinking.py)
            msg[AFTER_RESULTS] = True
        if thoughts:
            msg["reasoning_content"] = "\n".join(thoughts)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


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


def job(req: MessagesRequest, beta: str = "", need_max_tokens: bool = True) -> Job:
    """The request as a Job; `beta` is its anthropic-beta header."""
    if need_max_tokens and req.max_tokens is None:
        raise bad_request("max_tokens: Field required", param="max_tokens")
    if req.goinfer_confidence:
        raise bad_request("goinfer_confidence is not offered on /v1/messages", param="goinfer_confidence")
    tools, choice, parallel = openai_tools(req)
    fmt = (req.output_config or {}).get("format") or req.output_format
    sampling = Sampling(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        max_tokens=req.max_tokens,
        stops=tuple(req.stop_sequences or ()),
    )
    return Job(
        model=req.model,
        sampling=sampling,
        reply=lambda r: MessageEvents(r.model, r.prompt_tokens),
        messages=chat_messages(req, SYSTEM_TURNS_BETA in beta),
        stream=req.stream,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=response_format(fmt),
        schema_param="output_format.schema" if fmt is req.output_format else "output_config.format.schema",
        tool_schema_param="tools.{i}.input_schema",
        thinking=thinking_ask(req.thinking),
    )


def thinking_ask(thinking: dict[str, Any] | None) -> ThinkingAsk:
    """`thinking`: enabled (with its budget_tokens) turns a thinking model's thinking on, disabled
    off; adaptive (or none) leaves it to the server (serve/thinking.py)."""
    kind = (thinking or {}).get("type")
    if thinking is None or kind == "adaptive":
        return ThinkingAsk()
    if kind == "disabled":
        return ThinkingAsk(enable=False)
    if kind != "enabled":
        raise bad_request(
            f"thinking.type {kind!r} is not one of 'enabled', 'disabled', 'adaptive'", param="thinking.type"
        )
    budget = thinking.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        where = "thinking.budget_tokens"
        raise bad_request(f"{where} must be a whole number of tokens, not {budget!r}", param=where)
    return ThinkingAsk(enable=True, budget=budget)


def response_format(fmt: Any) -> dict[str, Any] | None:
    """Anthropic's structured-output format -> the chat route's response_format, strict (Anthropic
    guarantees the schema, and refuses one it cannot)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise bad_request(
            f"output_config.format.type {kind!r} is not 'json_schema'", "output_config.format.type"
        )
    return {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": fmt.get("schema"), "strict": True},
    }


@routes.post("")
@text_body
async def create(request: web.Request) -> web.StreamResponse:
    req = await read_request(request, MessagesRequest)
    return await pipeline.run(request, job(req, request.headers.get("anthropic-beta", "")))


@routes.post("/count_tokens")
@text_body
async def count_tokens(request: web.Request) -> web.Response:
    req = await read_request(request, MessagesRequest)
    beta = request.headers.get("anthropic-beta", "")
    _slot, _rules, ids = await pipeline.prepare(request, job(req, beta, need_max_tokens=False))
    return web.json_response({"input_tokens": len(ids)})


# -- the stream ------------------------------------------------------------------------------------
class MessageEvents(NamedEvents):
    """Deltas -> Anthropic's named events. A thinking model's reasoning, text and each tool call
    are content blocks in order; prose before a call is its own text block. A thinking block's
    signature is empty: nothing here signs (a client that sends it back has it ignored)."""

    keepalive = b'event: ping\ndata: {"type": "ping"}\n\n'

    def __init__(self, model: str, input_tokens: int):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model, self.input_tokens = model, input_tokens
        self.index = -1
        self.open: str | None = None  # the kind of the open content block

    def sse_error(self, err: APIError) -> bytes:
        return self.sse(anthropic_envelope(err))

    def fold(self, events: list[Chunk]) -> dict[str, Any]:
        return fold_message(events)

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
        if d.reasoning:
            if self.open != "thinking":
                out += self._begin({"type": "thinking", "thinking": "", "signature": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": d.reasoning}})  # fmt: skip
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
            if d.usage is not None:  # cumulative, as Anthropic's are: input_tokens counts the uncached ones
                cached = d.usage.cached_tokens
                usage |= {"input_tokens": d.usage.prompt_tokens - cached, "cache_read_input_tokens": cached}
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
            elif delta["type"] == "thinking_delta":
                blocks[e["index"]]["thinking"] += delta["thinking"]
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
