"""OpenAI's Responses API: POST /v1/responses and GET /v1/responses/{id}.

`input` (a string, or message / function_call / function_call_output items) and `instructions`
become the same chat messages the chat route renders; `tools`, `tool_choice` and `text.format` the
same constraints; so a response is a Job that runs through the same pipeline. `store` (the
default) keeps the response and its conversation in an in-memory ring of `--responses-store`
entries (256), oldest dropped first: `previous_response_id` continues from one of them (its
instructions are not carried over, as in OpenAI's API), and an id no longer held is a 404.

A thinking model's reasoning is a `reasoning` output item (its text a `reasoning_text` part) before
the message; `reasoning: {"effort": "none"}` turns thinking off (other efforts change nothing), and
reasoning items sent back in `input` are rendered as the model's template renders replayed
reasoning, with the assistant turn that follows them.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from threading import Lock
from typing import Annotated, Any

from aiohttp import web
from pydantic import Field

from . import pipeline
from .errors import APIError, bad_request, openai_envelope, unsupported
from .events import Chunk, Delta, NamedEvents
from .keys import RESPONSES
from .middleware import Body, read_request, text_body
from .pipeline import RESPONSES_TEXT, Job, Reply, Sampling, ThinkingAsk, text_of

routes = web.RouteTableDef()


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": "none"} turns thinking off
    goinfer_confidence: bool = False


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, instructions excluded, the reply included


class ResponseStore:
    """The last `capacity` stored responses, by id."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = Lock()  # written from the model's worker thread, read from the loop

    def put(self, item: Stored) -> None:
        with self._lock:
            self._items[item.response["id"]] = item
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            return self._items.get(rid)


# -- request -> chat messages ----------------------------------------------------------------------
def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: calls become an assistant turn's tool_calls, outputs tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    thought: list[str] = []  # reasoning items, for the assistant turn that follows them
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"input.{i}.role: {role!r} is not a valid role", param=f"input.{i}.role")
            text = text_of(item.get("content"), f"input.{i}.content", RESPONSES_TEXT)
            out.append({"role": "system" if role == "developer" else role, "content": text})
            if role == "assistant" and thought:
                out[-1]["reasoning_content"] = "\n".join(thought)
            thought = []
        elif kind == "function_call":
            fn = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
            call = {"id": str(item.get("call_id", "")), "type": "function", "function": fn}
            if out and out[-1]["role"] == "assistant" and not thought:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thought:
                    out[-1]["reasoning_content"] = "\n".join(thought)
            thought = []
        elif kind == "function_call_output":
            output = item.get("output", "")
            content = text_of(output, f"input.{i}.output", RESPONSES_TEXT)
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": content})
        elif kind == "reasoning":
            thought += [t] if (t := _reasoning_text(item, i)) else []
        else:
            raise unsupported(f"input.{i}: input items of type {kind!r} are not supported", f"input.{i}.type")
    return out


def _reasoning_text(item: dict[str, Any], i: int) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary's (encrypted content,
    another server's, cannot be read here)."""
    parts = item.get("content") or item.get("summary") or []
    readable = isinstance(parts, list) and all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
    )
    if not readable:
        where = f"input.{i}.content"
        raise bad_request(f"{where}: a reasoning item's parts each need a text", param=where)
    return "\n".join(p["text"] for p in parts)


def chat_tools(req: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """Responses' flat function tools and tool_choice -> the chat form the tools module reads."""
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise unsupported(
                    f"tools.{i}: only function tools are supported, not {t.get('type')!r}", f"tools.{i}"
                )
            fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools, choice


def chat_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format -> the chat route's response_format."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", param="text.format")
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        spec = {"name": fmt.get("name", "reply"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


# -- routes ----------------------------------------------------------------------------------------
@routes.post("/v1/responses")
@text_body
async def create(request: web.Request) -> web.StreamResponse:
    req = await read_request(request, ResponsesRequest)
    return await pipeline.run(request, job(req, request.config_dict[RESPONSES]))


def job(req: ResponsesRequest, store: ResponseStore) -> Job:
    if req.goinfer_confidence:
        raise bad_request("goinfer_confidence is not offered on /v1/responses", param="goinfer_confidence")
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prior = store.get(req.previous_response_id)
        if prior is None:
            raise APIError(
                404,
                f"previous_response_id {req.previous_response_id!r} is not stored here (the server "
                f"keeps the last {store.capacity} stored responses, in memory)",
                param="previous_response_id",
                code="response_not_found",
            )
        history = prior.conversation
    tools, choice = chat_tools(req)
    conversation = history + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []

    def keep(response: dict[str, Any], reply: list[dict[str, Any]]) -> None:
        if req.store:
            store.put(Stored(response, conversation + reply))

    def reply(r: Reply) -> ResponseEvents:
        tool_plan = r.tools
        echo = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": tool_plan.parallel if tool_plan else bool(req.parallel_tool_calls),
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": r.params.temperature,
            "top_p": r.params.top_p,
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}},
        }
        return ResponseEvents(r.model, r.prompt_tokens, echo, keep)

    sampling = Sampling(
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, max_tokens=req.max_output_tokens
    )
    return Job(
        model=req.model,
        sampling=sampling,
        reply=reply,
        messages=system + conversation,
        prompt_field="input",
        stream=req.stream,
        response_format=chat_format(req.text),
        schema_param="text.format.schema",
        tool_schema_param="tools.{i}.parameters",
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls,
        thinking=ThinkingAsk(enable=False)
        if (req.reasoning or {}).get("effort") == "none"
        else ThinkingAsk(),
    )


@routes.get("/v1/responses/{response_id}")
async def retrieve(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    item = request.config_dict[RESPONSES].get(rid)
    if item is None:
        raise APIError(404, f"no stored response {rid!r}", param="response_id", code="response_not_found")
    return web.json_response(item.response)


# -- the stream ------------------------------------------------------------------------------------
def _hex() -> str:
    return uuid.uuid4().hex[:24]


class ResponseEvents(NamedEvents):
    """Deltas -> the Responses stream: lifecycle events around output items (a message with one
    output_text part; one function_call item per call), each with a sequence number."""

    def __init__(
        self,
        model: str,
        input_tokens: int,
        echo: dict[str, Any],
        keep: Callable[[dict[str, Any], list[dict[str, Any]]], None],
    ):
        self.id, self.created = f"resp_{_hex()}", int(time.time())
        self.model, self.input_tokens, self.echo, self.keep = model, input_tokens, echo, keep
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items
        self.open: dict[str, Any] | None = None  # the item being written

    def sse_error(self, err: APIError) -> bytes:
        body = openai_envelope(err)["error"]
        return self.sse(
            {"type": "error", "code": body["code"], "message": body["message"], "param": body["param"]}
        )

    def fold(self, events: list[Chunk]) -> dict[str, Any]:
        return fold_response(events)

    def _event(self, kind: str, **fields: Any) -> Chunk:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def response(self, status: str, usage: dict[str, Any] | None = None, reason: str | None = None) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": list(self.items),
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": reason} if reason else None,
            **self.echo,
        }

    def start(self) -> list[Chunk]:
        r = self.response("in_progress")
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _index(self) -> int:
        return len(self.items)

    def _close(self) -> list[Chunk]:
        item, self.open = self.open, None
        if item is None:
            return []
        i, out = self._index(), []
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": i, "content_index": 0}
            out += [self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", **where, part=part)]  # fmt: skip
        elif item["type"] == "reasoning":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": i, "content_index": 0}
            out += [self._event("response.reasoning_text.done", **where, text=part["text"]),
                    self._event("response.content_part.done", **where, part=part)]  # fmt: skip
        else:
            where = {"item_id": item["id"], "output_index": i}
            out.append(
                self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])
            )
        self.items.append(item)
        return [*out, self._event("response.output_item.done", output_index=i, item=item)]

    def _begin(self, item: dict[str, Any]) -> list[Chunk]:
        out = self._close()
        self.open = item
        shown = {**item, "status": "in_progress"}
        if item["type"] in ("message", "reasoning"):
            shown["content"] = []
        out.append(self._event("response.output_item.added", output_index=self._index(), item=shown))
        if item["type"] in ("message", "reasoning"):
            part = {**item["content"][0]}
            where = {"item_id": item["id"], "output_index": self._index(), "content_index": 0}
            out.append(self._event("response.content_part.added", **where, part=part))
        return out

    def step(self, d: Delta) -> list[Chunk]:
        out: list[Chunk] = []
        if d.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                part = {"type": "reasoning_text", "text": ""}
                out += self._begin(
                    {"type": "reasoning", "id": f"rs_{_hex()}", "summary": [], "content": [part]}
                )
            assert self.open is not None
            self.open["content"][0]["text"] += d.reasoning
            where = {"item_id": self.open["id"], "output_index": self._index(), "content_index": 0}
            out.append(self._event("response.reasoning_text.delta", **where, delta=d.reasoning))
        if d.text:
            if self.open is None or self.open["type"] != "message":
                part = {"type": "output_text", "text": "", "annotations": []}
                out += self._begin({"type": "message", "id": f"msg_{_hex()}", "status": "in_progress",
                                    "role": "assistant", "content": [part]})  # fmt: skip
            assert self.open is not None
            self.open["content"][0]["text"] += d.text
            where = {"item_id": self.open["id"], "output_index": self._index(), "content_index": 0}
            out.append(self._event("response.output_text.delta", **where, delta=d.text, logprobs=[]))
        for t in d.tool_calls:
            if t.id is not None:
                item = {"type": "function_call", "id": f"fc_{_hex()}", "call_id": t.id, "name": t.name}
                out += self._begin({**item, "arguments": "", "status": "in_progress"})
            if t.arguments and self.open is not None:
                self.open["arguments"] += t.arguments
                where = {"item_id": self.open["id"], "output_index": self._index()}
                out.append(self._event("response.function_call_arguments.delta", **where, delta=t.arguments))
        if d.finish_reason is None:
            return out
        out += self._close()
        used = d.usage.completion_tokens if d.usage else 0
        usage = {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {
                "cached_tokens": d.usage.cached_tokens if d.usage else 0,
                "cache_write_tokens": 0,
            },
            "output_tokens": used,
            "output_tokens_details": {"reasoning_tokens": (d.usage.reasoning_tokens or 0) if d.usage else 0},
            "total_tokens": self.input_tokens + used,
        }
        cut = d.finish_reason == "length"
        final = self.response(
            "incomplete" if cut else "completed", usage, "max_output_tokens" if cut else None
        )
        self.keep(final, _as_chat(self.items))
        return [*out, self._event("response.incomplete" if cut else "response.completed", response=final)]


def _as_chat(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reply as chat messages, for a conversation continued by previous_response_id."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    thought = "".join(i["content"][0]["text"] for i in items if i["type"] == "reasoning")
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in items
        if i["type"] == "function_call"
    ]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if thought:
        msg["reasoning_content"] = thought
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def fold_response(events: Iterable[Chunk]) -> dict[str, Any]:
    """The non-streaming reply: the final response object the stream ends with."""
    final = None
    for e in events:
        if e["type"] in ("response.completed", "response.incomplete"):
            final = e["response"]
    assert final is not None, "a finished stream ends with its response"
    return final
