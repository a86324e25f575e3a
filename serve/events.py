"""A reply, from the runtime's token events to what the client reads.

    token events -> deltas -> one API's events -> server-sent events, or one folded JSON reply

1. `text_deltas` turns StepEvents into what every API shares: stop strings matched on the text
   across token boundaries and never emitted (text that could still start one is held back until
   it cannot); each token's logprob entry with the delta that releases its text; the finish reason
   and exact usage on the last delta. It only reads events, so a fake token source (tests) goes
   through the same path.
2. Event builders turn deltas into one API's events and frame them: this module holds the base
   and OpenAI's chunks (messages.py and responses.py build their own). A non-streaming reply is
   never built any other way: it is `fold(events)` over the very events a stream would have sent.
3. `respond` sends either. While nothing is ready (queued, or a long prefill) a stream sends
   `: keep-alive` comments so idle timeouts in clients and proxies do not fire. A client that goes
   away cancels its run: on a failed write while streaming, or at the next poll while a whole reply
   is being collected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from goinfer.runtime.decode import StepEvent
from goinfer.runtime.thinking import ReasoningSplit

from .errors import APIError, openai_envelope

if TYPE_CHECKING:
    from .registry import Generation


# -- 1. token events -> deltas ----------------------------------------------------------------
@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV was reused, not computed (prefix caching)
    reasoning_tokens: int | None = None  # of the completion, the thinking block's; None: no split

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call: its first piece names it (id, name), later ones add arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # set on the last delta only
    usage: Usage | None = None  # set on the last delta only
    tool_calls: tuple[ToolCallDelta, ...] = ()
    confidence: list[dict] | None = None  # goinfer_confidence records, on the last delta only
    stop_sequence: str | None = None  # the stop string that ended the reply, on the last delta
    reasoning: str = ""  # the model's thinking (a thinking model's block), before any answer text
    index: int = 0  # the choice it belongs to (OpenAI's n)


class StopMatcher:
    """Finds the first stop string in streamed text; releases only text that cannot start one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.matched: str | None = None  # the stop string found, once one is

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit)."""
        self.held += text
        hits = [(i, s) for s in self.stops if (i := self.held.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self.held = self.held[:at], ""
            return out, True
        keep = max((self._overlap(s) for s in self.stops), default=0)
        cut = len(self.held) - keep
        out, self.held = self.held[:cut], self.held[cut:]
        return out, False

    def _overlap(self, stop: str) -> int:
        # The longest suffix of the held text that is a proper prefix of `stop`.
        for k in range(min(len(stop) - 1, len(self.held)), 0, -1):
            if self.held.endswith(stop[:k]):
                return k
        return 0

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def text_deltas(
    events: Iterable[StepEvent],
    prompt_tokens: int,
    stop: Sequence[str] = (),
    token_text: Callable[[int], str] = str,
    logprobs: bool = False,
    end_at: Callable[[str], int | None] | None = None,
    split: ReasoningSplit | None = None,
) -> Iterator[Delta]:
    """Fold token events into client-visible deltas (see the module docstring).

    `end_at(text so far)` may end the reply like a stop string does, at the index it returns
    (a complete bare tool call, say); the text after that index is dropped.

    `split` separates a thinking model's reasoning from its answer (runtime/thinking.py): the
    reasoning goes out as it comes, in `Delta.reasoning`; stop strings, `end_at` and logprobs read
    the answer only (a stop string in the reasoning ends nothing).

    completion_tokens counts every token the model produced as text, including those a stop string
    swallowed; the end-of-sequence token is not text and is not counted. `token_text` names a token
    id in logprob entries.
    """
    matcher = StopMatcher(stop)
    pending: deque[tuple[int, int, TokenLogprob]] = deque()  # (start, end) of the token's text, entry
    produced = emitted = completion = cached = 0
    sofar = ""  # the whole text, kept only for end_at
    finish = "length"
    it = iter(events)

    def release(upto: int) -> tuple[TokenLogprob, ...]:
        out = []
        while pending and pending[0][1] <= upto:
            out.append(pending.popleft()[2])
        return tuple(out)

    def usage() -> Usage:
        return Usage(prompt_tokens, completion, cached, split.reasoning_tokens if split else None)

    try:
        for ev in it:
            cached = int(ev.timings.get("cached_tokens", cached))
            thought, text = split.push(ev.token_id, ev.text) if split is not None else ("", ev.text)
            if thought:
                yield Delta("", reasoning=thought)
            if ev.token_id is not None:
                completion += 1
                if logprobs and (split is None or split.answered):
                    pending.append((produced, produced + len(text), _entry(ev, token_text)))
            else:
                finish = ev.finish_reason or finish
            produced += len(text)
            out, hit = matcher.push(text)
            if end_at is not None and not hit:
                sofar += text
                cut_at = end_at(sofar)
                if cut_at is not None:
                    out, hit = sofar[emitted : max(cut_at, emitted)], True
                    matcher.flush()
            if hit:
                # Tokens whose text starts before the stop string belong to the reply; the rest do not.
                cut = emitted + len(out)
                entries = tuple(e for start, _end, e in pending if start < cut)
                yield Delta(out, entries, "stop", usage(), stop_sequence=matcher.matched)
                return
            if ev.token_id is None:
                break
            emitted += len(out)
            ready = release(emitted)
            if out or ready:
                yield Delta(out, ready)
        else:
            out = ""  # the source ended without a final event
        rest = out + matcher.flush()
        yield Delta(rest, tuple(e for _s, _e, e in pending), finish, usage())
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()  # stop the model's generator at once (a stop string, or the consumer gave up)


def _entry(ev: StepEvent, token_text: Callable[[int], str]) -> TokenLogprob:
    assert ev.token_id is not None
    top = tuple((token_text(t), float(lp)) for t, lp in ev.top_logprobs)
    return TokenLogprob(token_text(ev.token_id), float(ev.logprob or 0.0), top)


# -- 2. deltas -> an API's events -----------------------------------------------------------------
log = logging.getLogger("goinfer.serve")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Chunk = dict[str, Any]


def _usage(u: Usage) -> dict[str, Any]:
    out = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    if u.reasoning_tokens is not None:  # a thinking model's reply: how much of it was the thinking
        out["completion_tokens_details"] = {"reasoning_tokens": u.reasoning_tokens}
    return out


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
    """OpenAI's chunks for one reply (one id, one `created`); subclasses shape the choices. With
    n choices, each ends with its own finish chunk, and the usage chunk follows the last of them:
    the prompt once, the completions of all."""

    prefix = ""
    object = ""

    def __init__(self, model: str, include_usage: bool, logprobs: bool = False, n: int = 1):
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model, self.include_usage, self.logprobs, self.n = model, include_usage, logprobs, n
        self.usages: dict[int, Usage] = {}  # each finished choice's

    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> Chunk:
        c: Chunk = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        c["choices"] = choices
        if self.include_usage:
            c["usage"] = _usage(usage) if usage is not None else None
        return c

    def step(self, d: Delta) -> list[Chunk]:
        out = []
        if d.text or d.logprobs or d.tool_calls or d.reasoning:
            out.append(self._chunk([self._choice(d, None)]))
        if d.finish_reason is not None:
            out.append(self._chunk([self._choice(Delta("", index=d.index), d.finish_reason)]))
            if d.confidence is not None:  # goinfer's own event, after the finish chunk
                out.append({"id": self.id, "goinfer_confidence": d.confidence})
            usage = self._finished(d)
            if self.include_usage and usage is not None:
                out.append(self._chunk([], usage))  # OpenAI's last chunk: no choices, the usage
        return out

    def _finished(self, d: Delta) -> Usage | None:
        """The request's usage once every choice has finished, else None: the prompt's counts are
        the first choice's (the others start from a copy of its KV), the completion tokens all of
        theirs."""
        if d.usage is not None:
            self.usages[d.index] = d.usage
        if len(self.usages) < self.n or 0 not in self.usages:
            return None
        first = self.usages[0]
        completion = sum(u.completion_tokens for u in self.usages.values())
        thought = [u.reasoning_tokens for u in self.usages.values() if u.reasoning_tokens is not None]
        return Usage(first.prompt_tokens, completion, first.cached_tokens, sum(thought) if thought else None)

    @abstractmethod
    def _choice(self, d: Delta, finish: str | None) -> dict[str, Any]: ...


class ChatChunks(ChunkBuilder):
    prefix, object = "chatcmpl", "chat.completion.chunk"

    def start(self) -> list[Chunk]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.n)]  # fmt: skip

    def fold(self, events: list[Chunk]) -> dict[str, Any]:
        return fold_chat(events, self.logprobs)

    def _choice(self, d: Delta, finish: str | None) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if finish is None and (d.text or not (d.tool_calls or d.reasoning)):
            delta["content"] = d.text
        if d.tool_calls:
            delta["tool_calls"] = [_tool_call(t) for t in d.tool_calls]
        lp = {"content": [_chat_logprob(e) for e in d.logprobs], "refusal": None} if d.logprobs else None
        return {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish}


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

    def __init__(self, model: str, include_usage: bool, logprobs: bool = False, echo: str = "", n: int = 1):
        super().__init__(model, include_usage, logprobs, n)
        self.offsets = [0] * n  # each choice's text_offset of its next token, within its completion
        self.echo = echo  # the prompt, first (echo: true; never with logprobs)

    def start(self) -> list[Chunk]:
        if not self.echo:
            return []
        return [
            self._chunk([{"index": i, "text": self.echo, "logprobs": None, "finish_reason": None}])
            for i in range(self.n)
        ]

    def fold(self, events: list[Chunk]) -> dict[str, Any]:
        return fold_completion(events, self.logprobs)

    def _choice(self, d: Delta, finish: str | None) -> dict[str, Any]:
        lp = None
        if d.logprobs:
            offsets = []
            for e in d.logprobs:
                offsets.append(self.offsets[d.index])
                self.offsets[d.index] += len(e.token)
            lp = {
                "tokens": [e.token for e in d.logprobs],
                "token_logprobs": [e.logprob for e in d.logprobs],
                "top_logprobs": [dict(e.top) for e in d.logprobs],
                "text_offset": offsets,
            }
        return {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": finish}


def fold_chat(chunks: Iterable[Chunk], logprobs: bool) -> dict[str, Any]:
    """A chat.completion object from its stream: one choice per index."""
    head: Chunk | None = None
    usage, confidence = None, None
    choices: dict[int, _ChatChoice] = {}
    for c in chunks:
        head = head or c
        usage = c.get("usage") or usage
        confidence = c.get("goinfer_confidence", confidence)
        for ch in c.get("choices", ()):
            choices.setdefault(ch["index"], _ChatChoice()).add(ch)
    assert head is not None, "a stream always has its first chunk"
    folded = [choices[i].fold(i, logprobs) for i in sorted(choices)]
    return _reply(head, "chat.completion", folded, usage, confidence)


class _ChatChoice:
    """One choice of a chat stream, gathered."""

    def __init__(self) -> None:
        self.role, self.finish = "assistant", None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.lps: list[dict[str, Any]] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, ch: dict[str, Any]) -> None:
        self.role = ch["delta"].get("role", self.role)
        self.content.append(ch["delta"].get("content") or "")
        self.reasoning.append(ch["delta"].get("reasoning_content") or "")
        for t in ch["delta"].get("tool_calls", ()):
            call = self.calls.setdefault(t["index"], {"id": None, "type": "function", "function": {}})
            call["id"] = t.get("id") or call["id"]
            fn = call["function"]
            fn["name"] = t["function"].get("name") or fn.get("name")
            fn["arguments"] = fn.get("arguments", "") + t["function"].get("arguments", "")
        self.lps += (ch.get("logprobs") or {}).get("content") or []
        self.finish = ch["finish_reason"] or self.finish

    def fold(self, index: int, logprobs: bool) -> dict[str, Any]:
        text, calls = "".join(self.content), self.calls
        message: dict[str, Any] = {"role": self.role, "content": text if text or not calls else None,
                                   "refusal": None}  # fmt: skip
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        if any(self.reasoning):
            message["reasoning_content"] = "".join(self.reasoning)
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": self.lps, "refusal": None} if logprobs else None,
            "finish_reason": self.finish,
        }


def fold_completion(chunks: Iterable[Chunk], logprobs: bool) -> dict[str, Any]:
    """A text_completion object from its stream: one choice per index."""
    head: Chunk | None = None
    usage, confidence = None, None
    texts: dict[int, list[str]] = {}
    finishes: dict[int, str | None] = {}
    lps: dict[int, dict[str, list[Any]]] = {}
    for c in chunks:
        head = head or c
        usage = c.get("usage") or usage
        confidence = c.get("goinfer_confidence", confidence)
        for ch in c.get("choices", ()):
            i = ch["index"]
            texts.setdefault(i, []).append(ch["text"])
            lp = lps.setdefault(
                i, {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            )
            for k, v in (ch.get("logprobs") or {}).items():
                lp[k] += v
            finishes[i] = ch["finish_reason"] or finishes.get(i)
    assert head is not None, "a stream always has its first chunk"
    choices = [
        {"index": i, "text": "".join(texts[i]), "logprobs": lps[i] if logprobs else None,
         "finish_reason": finishes[i]}
        for i in sorted(texts)
    ]  # fmt: skip
    return _reply(head, "text_completion", choices, usage, confidence)


def _reply(
    head: Chunk, obj: str, choices: list[dict[str, Any]], usage: Any, confidence: Any
) -> dict[str, Any]:
    reply = {
        "id": head["id"],
        "object": obj,
        "created": head["created"],
        "model": head["model"],
        "choices": choices,
        "usage": usage,
    }
    if confidence is not None:
        reply["goinfer_confidence"] = confidence
    return reply


# -- 3. sending ---------------------------------------------------------------------------------
async def chunk_stream(run: Generation, builder: EventBuilder) -> AsyncIterator[Chunk | None]:
    """The run's chunks in order; None at each poll with nothing new."""
    for c in builder.start():
        yield c
    async with aclosing(run.ticks()) as ticks:
        async for d in ticks:
            if d is None:
                yield None
                continue
            for c in builder.step(d):
                yield c


def client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def respond(
    request: web.Request,
    run: Generation,
    builder: EventBuilder,
    *,
    stream: bool,
    keepalive_s: float,
) -> web.StreamResponse:
    async with aclosing(chunk_stream(run, builder)) as chunks:
        if stream:
            return await _sse(request, chunks, builder, keepalive_s)
        collected = []
        async for c in chunks:
            if c is not None:
                collected.append(c)
            elif client_gone(request):
                return web.Response(status=499)  # nobody reads this; leaving cancels the run
        return web.json_response(builder.fold(collected))


async def _sse(
    request: web.Request, chunks: AsyncIterator[Chunk | None], builder: EventBuilder, keepalive_s: float
) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)  # headers now, so keep-alives can flow through a long prefill
    loop = asyncio.get_running_loop()
    last = loop.time()
    try:
        async for c in chunks:
            if c is None:
                if client_gone(request):
                    return resp
                if loop.time() - last >= keepalive_s:
                    await resp.write(builder.keepalive)
                    last = loop.time()
                continue
            await resp.write(builder.sse(c))
            last = loop.time()
        if builder.sse_end:
            await resp.write(builder.sse_end)
    except ConnectionError:  # the client hung up mid-stream (aiohttp's reset errors subclass this)
        return resp
    except Exception as e:
        # Headers are gone already: the error travels as an event, in the envelope, without a traceback.
        err = e if isinstance(e, APIError) else APIError(500, f"generation failed ({type(e).__name__})")
        if not isinstance(e, APIError):
            log.exception("stream failed")
        try:
            await resp.write(builder.sse_error(err))
        except ConnectionError:
            return resp
    await resp.write_eof()
    return resp
