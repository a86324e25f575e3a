"""Token events -> text deltas: stop strings, logprobs and exact usage, for every API alike.

The engine yields one StepEvent per token (runtime/stream.py). `text_deltas` turns those into
what a client sees:

- stop strings are matched on the text, across token boundaries, and never emitted: text that
  could still be the start of a stop string is held back until it cannot;
- each token's logprob entry travels with the delta that releases its text;
- the last delta carries the finish reason and the usage (prompt and completion tokens).

It only reads events, so a fake token source (tests) goes through exactly the same path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from goinfer.runtime.decode import StepEvent


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
) -> Iterator[Delta]:
    """Fold token events into client-visible deltas (see the module docstring).

    `end_at(text so far)` may end the reply like a stop string does, at the index it returns
    (a complete bare tool call, say); the text after that index is dropped.

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

    try:
        for ev in it:
            cached = int(ev.timings.get("cached_tokens", cached))
            if ev.token_id is not None:
                completion += 1
                if logprobs:
                    pending.append((produced, produced + len(ev.text), _entry(ev, token_text)))
            else:
                finish = ev.finish_reason or finish
            produced += len(ev.text)
            out, hit = matcher.push(ev.text)
            if end_at is not None and not hit:
                sofar += ev.text
                cut_at = end_at(sofar)
                if cut_at is not None:
                    out, hit = sofar[emitted : max(cut_at, emitted)], True
                    matcher.flush()
            if hit:
                # Tokens whose text starts before the stop string belong to the reply; the rest do not.
                cut = emitted + len(out)
                entries = tuple(e for start, _end, e in pending if start < cut)
                usage = Usage(prompt_tokens, completion, cached)
                yield Delta(out, entries, "stop", usage, stop_sequence=matcher.matched)
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
        yield Delta(rest, tuple(e for _s, _e, e in pending), finish, Usage(prompt_tokens, completion, cached))
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()  # stop the model's generator at once (a stop string, or the consumer gave up)


def _entry(ev: StepEvent, token_text: Callable[[int], str]) -> TokenLogprob:
    assert ev.token_id is not None
    top = tuple((token_text(t), float(lp)) for t, lp in ev.top_logprobs)
    return TokenLogprob(token_text(ev.token_id), float(ev.logprob or 0.0), top)
