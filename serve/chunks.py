"""Event builders: deltas -> one API's events, their SSE framing, and the fold into one JSON reply.

This module holds the base and OpenAI's chunks; messages.py and responses.py build their own. A
non-streaming reply is never built any other way: it is `fold(events)` over the very events a
stream would have sent, so the two cannot drift apart.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from .deltas import Delta, TokenLogprob, ToolCallDelta, Usage
from .errors import APIError, openai_envelope

Chunk = dict[str, Any]


def _usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", "surrogatepass"))


class EventBuilder(ABC):
    """Deltas -> the events of one reply, how they are framed as server-sent events (OpenAI's
    `data:` lines ending in `[DONE]` by default; the Anthropic and Responses builders name their
    events instead), and the whole reply they fold into."""

    keepalive = b": keep-alive\n\n"
    sse_end: bytes | None = b"data: [DONE]\n\n"

    def sse(self, chunk: Chunk) -> bytes:
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"

    def sse_error(self, err: APIError) -> bytes:
        return b"data: " + json.dumps(openai_envelope(err)).encode() + b"\n\n"

    def start(self) -> list[Chunk]:
        return []

    @abstractmethod
    def step(self, d: Delta) -> list[Chunk]: ...

    @abstractmethod
    def fold(self, events: list[Chunk]) -> dict[str, Any]:
        """The non-streaming reply, from the events a stream would have sent."""


class NamedEvents(EventBuilder):
    """The framing of the Anthropic and Responses streams: `event: <type>` then the data, and no
    end marker."""

    sse_end = None

    def sse(self, chunk: Chunk) -> bytes:
        head = f"event: {chunk['type']}\ndata: ".encode()
        return head + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"


class ChunkBuilder(EventBuilder):
    """OpenAI's chunks for one reply (one id, one `created`); subclasses shape the choices."""

    prefix = ""
    object = ""

    def __init__(self, model: str, include_usage: bool, logprobs: bool = False):
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model, self.include_usage, self.logprobs = model, include_usage, logprobs

    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> Chunk:
        c: Chunk = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        c["choices"] = choices
        if self.include_usage:
            c["usage"] = _usage(usage) if usage is not None else None
        return c

    def step(self, d: Delta) -> list[Chunk]:
        out = []
        if d.text or d.logprobs or d.tool_calls:
            out.append(self._chunk([self._choice(d, None)]))
        if d.finish_reason is not None:
            out.append(self._chunk([self._choice(Delta(""), d.finish_reason)]))
            if d.confidence is not None:  # goinfer's own event, after the finish chunk
                out.append({"id": self.id, "goinfer_confidence": d.confidence})
            if self.include_usage and d.usage is not None:
                out.append(self._chunk([], d.usage))  # OpenAI's last chunk: no choices, the usage
        return out

    @abstractmethod
    def _choice(self, d: Delta, finish: str | None) -> dict[str, Any]: ...


class ChatChunks(ChunkBuilder):
    prefix, object = "chatcmpl", "chat.completion.chunk"

    def start(self) -> list[Chunk]:
        return [self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])]  # fmt: skip

    def fold(self, events: list[Chunk]) -> dict[str, Any]:
        return fold_chat(events, self.logprobs)

    def _choice(self, d: Delta, finish: str | None) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if finish is None and (d.text or not d.tool_calls):
            delta["content"] = d.text
        if d.tool_calls:
            delta["tool_calls"] = [_tool_call(t) for t in d.tool_calls]
        lp = {"content": [_chat_logprob(e) for e in d.logprobs], "refusal": None} if d.logprobs else None
        return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}


def _tool_call(t: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's streamed call piece: the first names the call, the rest carry argument text."""
    if t.id is None:
        return {"index": t.index, "function": {"arguments": t.arguments}}
    fn = {"name": t.name, "arguments": t.arguments}
    return {"index": t.index, "id": t.id, "type": "function", "function": fn}


def _chat_logprob(e: TokenLogprob) -> dict[str, Any]:
    top = [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in e.top]
    return {"token": e.token, "logprob": e.logprob, "bytes": _bytes(e.token), "top_logprobs": top}


class CompletionChunks(ChunkBuilder):
    prefix, object = "cmpl", "text_completion"

    def __init__(self, model: str, include_usage: bool, logprobs: bool = False):
        super().__init__(model, include_usage, logprobs)
        self.offset = 0  # text_offset of the next token, within the completion

    def fold(self, events: list[Chunk]) -> dict[str, Any]:
        return fold_completion(events, self.logprobs)

    def _choice(self, d: Delta, finish: str | None) -> dict[str, Any]:
        lp = None
        if d.logprobs:
            offsets = []
            for e in d.logprobs:
                offsets.append(self.offset)
                self.offset += len(e.token)
            lp = {
                "tokens": [e.token for e in d.logprobs],
                "token_logprobs": [e.logprob for e in d.logprobs],
                "top_logprobs": [dict(e.top) for e in d.logprobs],
                "text_offset": offsets,
            }
        return {"index": 0, "text": d.text, "logprobs": lp, "finish_reason": finish}


def fold_chat(chunks: Iterable[Chunk], logprobs: bool) -> dict[str, Any]:
    """A chat.completion object from its stream."""
    head: Chunk | None = None
    role, content, finish, usage, confidence = "assistant", [], None, None, None
    lps: list[dict[str, Any]] = []
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks:
        head = head or c
        usage = c.get("usage") or usage
        confidence = c.get("goinfer_confidence", confidence)
        for ch in c.get("choices", ()):
            role = ch["delta"].get("role", role)
            content.append(ch["delta"].get("content") or "")
            for t in ch["delta"].get("tool_calls", ()):
                call = calls.setdefault(t["index"], {"id": None, "type": "function", "function": {}})
                call["id"] = t.get("id") or call["id"]
                fn = call["function"]
                fn["name"] = t["function"].get("name") or fn.get("name")
                fn["arguments"] = fn.get("arguments", "") + t["function"].get("arguments", "")
            lps += (ch.get("logprobs") or {}).get("content") or []
            finish = ch["finish_reason"] or finish
    assert head is not None, "a stream always has its first chunk"
    text = "".join(content)
    message: dict[str, Any] = {"role": role, "content": text if text or not calls else None, "refusal": None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    choice = {
        "index": 0,
        "message": message,
        "logprobs": {"content": lps, "refusal": None} if logprobs else None,
        "finish_reason": finish,
    }
    return _reply(head, "chat.completion", choice, usage, confidence)


def fold_completion(chunks: Iterable[Chunk], logprobs: bool) -> dict[str, Any]:
    """A text_completion object from its stream."""
    head: Chunk | None = None
    text, finish, usage, confidence = [], None, None, None
    lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        head = head or c
        usage = c.get("usage") or usage
        confidence = c.get("goinfer_confidence", confidence)
        for ch in c.get("choices", ()):
            text.append(ch["text"])
            for k, v in (ch.get("logprobs") or {}).items():
                lp[k] += v
            finish = ch["finish_reason"] or finish
    assert head is not None, "a stream always has its first chunk"
    choice = {
        "index": 0,
        "text": "".join(text),
        "logprobs": lp if logprobs else None,
        "finish_reason": finish,
    }
    return _reply(head, "text_completion", choice, usage, confidence)


def _reply(head: Chunk, obj: str, choice: dict[str, Any], usage: Any, confidence: Any) -> dict[str, Any]:
    reply = {
        "id": head["id"],
        "object": obj,
        "created": head["created"],
        "model": head["model"],
        "choices": [choice],
        "usage": usage,
    }
    if confidence is not None:
        reply["goinfer_confidence"] = confidence
    return reply
