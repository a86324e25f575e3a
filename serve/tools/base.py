"""What every tool-call format shares: the supplied tools, the call grammar, and what reads calls.

A family's format (hermes.py, llama3.py, mistral.py) is a `CallFormat`: the text that opens its
calls, how several calls are joined, and the key its arguments sit under. Everything a request
needs follows from that: the grammar that constrains a call (`call_grammar`) and the helpers the
streaming splitter (stream.py, the one reader of calls) finds calls in a reply with.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from goinfer.runtime.grammar import json_in_lark, lark_literal
from llguidance import LLTokenizer


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as the OpenAI request spelled it (what chat templates expect)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallFormat:
    """One family's call syntax: opener, one call object per call, joiner between calls, closer."""

    name: str
    opener: str  # the text (often one special token) that starts the calls
    call_open: str  # between the opener and the first call object
    joiner: str  # between two calls
    close: str  # after the last call
    args_key: str = "arguments"
    unwrapped: bool = False  # a reply that starts with a call object (no opener) is a call too
    notes: str = field(default="", compare=False)

    # -- constraint ---------------------------------------------------------------------
    def call_grammar(self, tools: list[Tool], parallel: bool, tok: LLTokenizer | None = None) -> str:
        """Lark for everything after the opener: one call (or several) to the supplied tools.
        With the model's tokenizer, tags that are special tokens are matched as those tokens."""
        alts = " | ".join(f"call{i}" for i in range(len(tools)))
        rules = [f"call{i}: {json_in_lark(self.call_schema(t))}" for i, t in enumerate(tools)]
        more = f"({lark_literal(self.joiner, tok)} call)*" if parallel else ""
        start = f"start: {lark_literal(self.call_open, tok)} call {more} {lark_literal(self.close, tok)}"
        return "\n".join([start, f"call: {alts}", *rules])

    def call_schema(self, tool: Tool) -> dict[str, Any]:
        # A call's arguments are an object whatever else the schema allows (`plan_tools` refused a
        # schema whose type excludes objects; one that names no type gets it here).
        args = {**tool.parameters, "type": "object"}
        return {
            "type": "object",
            "properties": {"name": {"const": tool.name}, self.args_key: args},
            "required": ["name", self.args_key],
            "additionalProperties": False,
        }


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
