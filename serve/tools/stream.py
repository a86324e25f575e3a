"""Reading tool calls out of a reply: text deltas -> prose deltas and OpenAI-style tool-call deltas,
as the reply is generated. This is the one reader of calls (tests hold it to recorded replies).

Prose before a call streams as it comes (text that could still be the opener is held back, as
with stop strings). Inside a call, the name goes out as soon as it is complete and the arguments
stream piece by piece. A reply that starts with a bare call object (formats with `unwrapped`) is
held until it ends, because only then is it known to be a call rather than prose; so is a ```json
block after prose, which may be the call (`fenced_call`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..events import Delta, StopMatcher, ToolCallDelta
from .formats import CallFormat


# -- reading calls out of text ------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


def to_call(obj: Any, names: set[str], args_key: str = "arguments") -> Call | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return Call(obj["name"], args) if isinstance(args, dict) else None


_OPEN = re.compile(r"[\[{]")


def json_objects(text: str) -> list[Any]:
    """Every top-level JSON value that starts with `{` or `[` in `text`, arrays flattened."""
    dec, out, i = json.JSONDecoder(), [], 0
    while (m := _OPEN.search(text, i)) is not None:
        try:
            value, i = dec.raw_decode(text, m.start())
        except ValueError:
            i = m.start() + 1
            continue
        out.extend(value if isinstance(value, list) else [value])
    return out


# A bare call may come inside a markdown fence, as Qwen2.5-Coder-0.5B writes it under auto.
_FENCE = re.compile(r"```(?:json)?[ \t]*\n")
_FENCE_PREFIX = re.compile(r"`{1,3}(?:j(?:s(?:o(?:n)?)?)?)?[ \t]*")
_SPACE = re.compile(r"\s*")


def bare_start(text: str) -> int | None:
    """Where the call object starts in a reply that opens with one (after spaces, or a ```json
    fence), or None when it does not. Reads only the reply's head: it runs at every token."""
    at = _SPACE.match(text).end()
    m = _FENCE.match(text, at)
    if m:
        at = _SPACE.match(text, m.end()).end()
    return at if text.startswith("{", at) else None


def may_open_bare(text: str) -> bool:
    """Could more text still make this a reply that opens with a bare call?"""
    s = text.lstrip()
    if not s or _FENCE_PREFIX.fullmatch(s):
        return True
    m = _FENCE.match(s)
    return m is not None and not s[m.end() :].strip()  # a fence line, nothing after it yet


def _bare_call(text: str, names: set[str], args_key: str) -> tuple[Call, int] | None:
    """The call a reply opens with (see `unwrapped_call`), and where its object ends."""
    at = bare_start(text)
    if at is None:
        return None
    try:
        obj, end = json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        return None
    call = to_call(obj, names, args_key)
    return (call, end) if call is not None else None


def unwrapped_call(text: str, names: set[str], args_key: str = "arguments") -> Call | None:
    """A reply whose first non-space byte opens a JSON object naming a supplied tool, with object
    arguments, is that one call (the first object only); so is one whose first line is a ```json
    fence around such an object. Anything else is prose."""
    found = _bare_call(text, names, args_key)
    return found[0] if found else None


def bare_call_end(text: str, names: set[str], args_key: str = "arguments") -> int | None:
    """Where a reply's call ends once it is complete: a bare call object's (a small model that
    writes one tends to write it again and again: the first is the call), or a fenced one's."""
    found = _bare_call(text, names, args_key)
    if found:
        return found[1]
    fenced = fenced_call(text, names, args_key)
    return fenced[2] if fenced else None


# Prose, then the call as a ```json block: how Qwen2.5-Coder-1.5B calls under auto when it explains
# first ("I need to read the file. Here's how: ```json {"name": ...}```"). llama.cpp's Hermes
# parser takes such a block as the call too. A fence that is not one call to a supplied tool is prose.
_FENCED = re.compile(r"```(?:json)?[ \t]*\n\s*(?=\{)")


def fenced_call(text: str, names: set[str], args_key: str = "arguments") -> tuple[int, Call, int] | None:
    """The first ```json block in ``text`` holding a call to a supplied tool: (where its fence
    starts, the call, where its object ends)."""
    for m in _FENCED.finditer(text):
        try:
            obj, end = json.JSONDecoder().raw_decode(text, m.end())
        except ValueError:
            continue
        call = to_call(obj, names, args_key)
        if call is not None:
            return m.start(), call, end
    return None


def fence_state(text: str, names: set[str], args_key: str = "arguments") -> str:
    """What text that starts with ``` (a fence opening after prose) is so far: "call" (a complete
    call block), "maybe" (it could still become one) or "prose"."""
    if fenced_call(text, names, args_key) is not None:
        return "call"
    m = _FENCED.match(text)
    if m is None:  # not yet a whole fence line then "{": is it still on its way to one?
        line, _, after = text.partition("\n")
        return "maybe" if _FENCE_PREFIX.fullmatch(line) and not after.strip() else "prose"
    try:
        json.JSONDecoder().raw_decode(text, m.end())
    except ValueError:  # not complete yet, unless the block already closed around it
        return "prose" if "```" in text[m.end() :] else "maybe"
    return "prose"  # complete, and not a call


# -- the splitter -------------------------------------------------------------------------------
FENCE = "```"

Pieces = tuple[str, list[ToolCallDelta]]  # (prose to send, call pieces to send)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _CallScan:
    """One call object, fed piece by piece: reports its name once, then its arguments' text. A
    named format's call (`fmt.args_tag`) is the name, maybe an id, the tag, then the arguments."""

    def __init__(self, fmt: CallFormat):
        if fmt.args_tag:
            call_id = rf"(?:{re.escape(fmt.id_tag)}\s*[A-Za-z0-9]*\s*)?" if fmt.id_tag else ""
            self.head = re.compile(rf"\s*([A-Za-z0-9_.\-]+)\s*{call_id}{re.escape(fmt.args_tag)}\s*")
        else:
            key = re.escape(fmt.args_key)
            self.head = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + key + r'"\s*:\s*')
        self.named = bool(fmt.args_tag)
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
            self.name = named = m.group(1) if self.named else json.loads(f'"{m.group(1)}"')
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


class ToolDeltas:
    """One reply's text deltas -> prose deltas and tool-call deltas (see the module docstring).

    The reply is in one mode at a time, and each mode is a method that takes the next piece of
    text and returns (prose to send, call pieces to send): `start` until it is known whether the
    reply opens with a bare call, then `bare` (held to the end) or `prose` (streamed, watching for
    the opener and, for `unwrapped` formats, a fence), `calls` after the opener, and `fence` while
    a fenced block may be a call. `end` settles what a mode still holds.
    """

    def __init__(self, fmt: CallFormat, names: set[str]):
        self.fmt, self.names = fmt, names
        self.mode: Callable[[str], Pieces] = self.start
        self.lead = ""  # start: the reply so far
        self.held = ""  # bare: the reply so far
        # prose: holds text that may begin the opener (or a fence that may hold a call)
        self.opener = StopMatcher([fmt.opener, FENCE] if fmt.unwrapped else [fmt.opener])
        self.fenced = ""  # fence: the block so far
        self.region = ""  # calls: text since the opener or the last complete call
        self.scan: _CallScan | None = None  # calls: the call object being read
        self.index = -1  # the last call's index
        self.scanned = 0  # named formats: calls read whole, to a supplied tool or not
        self.called = False

    def __call__(self, deltas: Iterable[Delta]) -> Iterator[Delta]:
        """The last delta's finish_reason becomes "tool_calls" when the reply made a call and
        ended on its own (not cut by max_tokens)."""
        for d in deltas:  # a thinking model's reasoning passes through as it came
            text, calls = self.mode(d.text)
            if d.finish_reason is None:
                if text or calls or d.logprobs or d.reasoning:
                    yield replace(d, text=text, tool_calls=tuple(calls))
                continue
            rest, last = self.end()
            finish = "tool_calls" if self.called and d.finish_reason == "stop" else d.finish_reason
            yield replace(d, text=text + rest, finish_reason=finish, tool_calls=tuple(calls + last))

    def start(self, piece: str) -> Pieces:
        self.lead += piece
        if self.fmt.unwrapped and bare_start(self.lead) is not None:
            self.mode = self.bare
        elif may_open_bare(self.lead) if self.fmt.unwrapped else not self.lead.strip():
            return "", []
        else:
            self.mode = self.prose
        lead, self.lead = self.lead, ""
        return self.mode(lead)

    def bare(self, piece: str) -> Pieces:
        self.held += piece  # only a complete object tells a call from prose
        return "", []

    def prose(self, piece: str) -> Pieces:
        combined = self.opener.held + piece  # the opener may straddle two pieces
        text, hit = self.opener.push(piece)
        if not hit:
            return text, []
        # (the matcher drops what follows the hit: take it from `combined`)
        if self.opener.matched == FENCE:
            self.mode, self.fenced = self.fence, ""
            more, calls = self.fence(combined[combined.find(FENCE) :])
            return text + more, calls
        self.mode = self.calls
        return text, self.calls(combined[combined.find(self.fmt.opener) + len(self.fmt.opener) :])[1]

    def fence(self, piece: str) -> Pieces:
        """Hold a fenced block until it is known to be the call (then that, and nothing after it)
        or prose (then all of it, and back to prose)."""
        if self.called:
            return "", []  # text after the call: the reply ends there (ToolPlan.reply_end)
        self.fenced += piece
        state = fence_state(self.fenced, self.names, self.fmt.args_key)
        if state == "maybe":
            return "", []
        if state == "call":
            found = fenced_call(self.fenced, self.names, self.fmt.args_key)
            return "", [self._whole(found[1])]
        held, self.fenced, self.mode = self.fenced, "", self.prose
        # the block's first three backticks are prose: what follows them is watched again
        text, calls = self.prose(held[len(FENCE) :])
        return FENCE + text, calls

    def calls(self, text: str) -> Pieces:
        """Skip the structure between calls; scan each call object as it comes."""
        if self.fmt.args_tag:
            return self.named_calls(text)
        out: list[ToolCallDelta] = []
        self.region += text
        while text:
            if self.scan is None:
                at = text.find("{")
                if at < 0:
                    break
                self.scan, text = _CallScan(self.fmt), text[at:]
            out += self._scanned(text)
            if not self.scan.done:
                break
            text, self.scan, self.region = self.scan.rest, None, self.scan.rest
        return "", out

    def named_calls(self, text: str) -> Pieces:
        """A named format's calls: the first right after the opener, each further one after the
        joiner (which may come split across pieces: `region` holds what awaits it)."""
        out: list[ToolCallDelta] = []
        self.region += text
        while self.region:
            if self.scan is None:
                if self.scanned:  # past the first call: the next opens with the joiner
                    at = self.region.find(self.fmt.joiner)
                    if at < 0:
                        break
                    self.region = self.region[at + len(self.fmt.joiner) :]
                self.scan = _CallScan(self.fmt)
            piece, self.region = self.region, ""
            out += self._scanned(piece)
            if not self.scan.done:
                break
            self.region, self.scan, self.scanned = self.scan.rest, None, self.scanned + 1
        return "", out

    def _scanned(self, piece: str) -> list[ToolCallDelta]:
        """`piece` through the current call's scan: the call's first delta once its name is known
        (a name not offered is dropped), then its argument text."""
        assert self.scan is not None
        out = []
        named, args = self.scan.feed(piece)
        if named is not None and named in self.names:
            out.append(self._call(named))
        if args and self.scan.name in self.names:
            out.append(ToolCallDelta(self.index, arguments=args))
        return out

    def end(self) -> Pieces:
        if self.mode == self.start:
            return self.lead, []
        if self.mode == self.prose:
            return self.opener.flush(), []
        if self.mode == self.fence:
            return ("", []) if self.called else (self.fenced, [])
        if self.mode == self.bare:
            call = unwrapped_call(self.held, self.names, self.fmt.args_key)
            return ("", [self._whole(call)]) if call is not None else (self.held, [])
        if self.scan is not None and self.scan.name is None:  # a call whose keys came in another order
            found = (to_call(o, self.names, self.fmt.args_key) for o in json_objects(self.region))
            return "", [self._whole(c) for c in found if c is not None]
        return "", []

    def _call(self, name: str, arguments: str = "") -> ToolCallDelta:
        self.index, self.called = self.index + 1, True
        return ToolCallDelta(self.index, call_id(), name, arguments)

    def _whole(self, call: Call) -> ToolCallDelta:
        """A call known only once complete, sent as one delta."""
        return self._call(call.name, json.dumps(call.arguments, ensure_ascii=False))
