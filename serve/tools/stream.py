"""Text deltas -> prose deltas and OpenAI-style tool-call deltas, as the reply is generated.

Prose before a call streams as it comes (text that could still be the opener is held back, as
with stop strings). Inside a call, the name goes out as soon as it is complete and the arguments
stream piece by piece. A reply that starts with a bare call object (formats with `unwrapped`) is
held until it ends, because only then is it known to be a call rather than prose.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Iterator

from goinfer.runtime.stream import Delta, StopMatcher, ToolCallDelta

from .base import Call, CallFormat, bare_start, json_objects, may_open_bare, to_call, unwrapped_call


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def whole(index: int, call: Call) -> ToolCallDelta:
    """A call known only once complete, sent as one delta."""
    return ToolCallDelta(index, call_id(), call.name, json.dumps(call.arguments, ensure_ascii=False))


class _CallScan:
    """One call object, fed piece by piece: reports its name once, then its arguments' text."""

    def __init__(self, args_key: str):
        key = re.escape(args_key)
        self.head = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + key + r'"\s*:\s*')
        self.buf, self.pos = "", 0
        self.name: str | None = None
        self.depth, self.in_str, self.esc, self.done = 0, False, False, False

    def feed(self, text: str) -> tuple[str | None, str]:
        """(the name, if it just became known; the new arguments text)."""
        self.buf += text
        named = None
        if self.name is None:
            m = self.head.match(self.buf)
            if m is None:
                return None, ""
            self.name = named = json.loads(f'"{m.group(1)}"')
            self.pos = m.end()
        while self.depth == 0 and self.pos < len(self.buf) and self.buf[self.pos].isspace():
            self.pos += 1  # the space after the key's colon is not part of the arguments
        start = self.pos
        while self.pos < len(self.buf) and not self.done:
            c = self.buf[self.pos]
            self.pos += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    self.done = self.depth == 0  # arguments sent as one JSON string
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.done = self.depth == 0
        return named, self.buf[start : self.pos]

    @property
    def rest(self) -> str:
        return self.buf[self.pos :]


def tool_deltas(deltas: Iterable[Delta], fmt: CallFormat, names: set[str]) -> Iterator[Delta]:
    """See the module docstring. The last delta's finish_reason becomes "tool_calls" when the
    reply made a call and ended on its own (not cut by max_tokens)."""
    opener = StopMatcher([fmt.opener])
    mode = "start"  # start -> prose | bare ; prose -> between <-> call
    lead, bare, region = "", "", ""  # leading spaces; a held bare reply; text since the opener
    scan: _CallScan | None = None
    index, emitted = -1, False

    def calls_from(text: str) -> list[ToolCallDelta]:
        nonlocal index, emitted
        out = []
        for obj in json_objects(text):
            c = to_call(obj, names, fmt.args_key)
            if c is not None:
                index, emitted = index + 1, True
                out.append(whole(index, c))
        return out

    def in_calls(text: str) -> list[ToolCallDelta]:
        """Text after the opener: skip structure between calls, scan each call object."""
        nonlocal scan, index, emitted, region
        out: list[ToolCallDelta] = []
        region += text
        while text:
            if scan is None:
                at = text.find("{")
                if at < 0:
                    return out
                scan, text = _CallScan(fmt.args_key), text[at:]
            named, args = scan.feed(text)
            if named is not None and named in names:
                index, emitted = index + 1, True
                out.append(ToolCallDelta(index, call_id(), named, ""))
            if args and scan.name in names:
                out.append(ToolCallDelta(index, arguments=args))
            if not scan.done:
                return out
            text, scan, region = scan.rest, None, scan.rest
        return out

    for d in deltas:
        text, calls = "", []
        piece = d.text
        if mode == "start":  # held until it is known whether the reply opens with a bare call
            lead += piece
            undecided = may_open_bare(lead) if fmt.unwrapped else not lead.strip()
            if fmt.unwrapped and bare_start(lead) is not None:
                mode, piece, lead = "bare", lead, ""
            elif undecided:
                piece = ""
            else:
                mode, piece, lead = "prose", lead, ""
        if mode == "bare":
            bare += piece
        elif mode == "prose":
            combined = opener.held + piece  # the opener may straddle two pieces
            text, hit = opener.push(piece)
            if hit:  # (the matcher drops what follows the opener: take it from `combined`)
                mode = "between"
                calls = in_calls(combined[combined.find(fmt.opener) + len(fmt.opener) :])
        else:
            calls = in_calls(piece)
        if d.finish_reason is None:
            if text or calls or d.logprobs:
                yield Delta(text, d.logprobs, tool_calls=tuple(calls))
            continue
        # the end: settle whatever is still held
        if mode == "bare":
            call = unwrapped_call(bare, names, fmt.args_key)
            if call is not None:
                index, emitted = index + 1, True
                calls.append(whole(index, call))
            else:
                text += bare
        elif mode == "prose":
            text += opener.flush()
        elif mode == "between" and scan is not None and scan.name is None:
            calls += calls_from(region)  # a call object whose keys were not in the usual order
        elif mode == "start":
            text += lead
        finish = "tool_calls" if emitted and d.finish_reason == "stop" else d.finish_reason
        yield Delta(text, d.logprobs, finish, d.usage, tuple(calls), d.confidence, d.stop_sequence)
