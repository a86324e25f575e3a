"""Per-field confidence for a schema-constrained reply (goinfer_confidence).

For each enum, boolean and integer field of the reply, at any depth, the model's probability over
what the schema allowed at the positions that decided it (captured at temperature 1 by the decode
loop as StepChoice records). It ranks fields; it is not a calibrated probability of being right.

- enum / boolean: every legal token's mass is summed by the option its text spells; a token that
  is still a prefix of several options is "undecided" unless it is the one taken, whose mass is
  then split at the next position that decides (so a literal split across tokens is not diluted).
- integer: the lowest probability among the positions that chose its digits.
- A field the schema forced (one option, or no free position) says nothing about the model and is
  not reported.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from goinfer.runtime.decode import StepChoice, StepEvent

from .events import Delta


@dataclass(frozen=True)
class Step:
    """One generated token: its character span in the reply text, and what the grammar allowed."""

    start: int
    end: int
    token_id: int
    choice: StepChoice | None


@dataclass(frozen=True)
class _Leaf:
    path: str
    kind: str  # "enum" | "boolean" | "integer"
    value: Any
    start: int  # the value's character span in the reply
    end: int
    options: tuple[Any, ...] = ()


def field_confidence(
    schema: dict[str, Any], text: str, steps: Sequence[Step], token_text: Callable[[int], str]
) -> list[dict[str, Any]]:
    """One record per reported field, in the order the fields appear in the reply."""
    try:
        node = _Scanner(text).document()
    except ValueError:
        return []  # not JSON (max_tokens cut it): nothing to report
    leaves: list[_Leaf] = []
    _walk(schema, schema, node, "", leaves)
    out = []
    for leaf in leaves:
        inside = [s for s in steps if s.end > leaf.start and s.start < leaf.end]
        free = [s for s in inside if s.choice is not None and s.choice.legal > 1]
        if not free:
            continue
        rec: dict[str, Any] = {"path": leaf.path, "kind": leaf.kind, "value": leaf.value}
        if leaf.kind == "integer":
            rec["confidence"] = round(min(s.choice.prob for s in free if s.choice), 4)
        else:
            dist, undecided = _option_mass(leaf, text, inside, token_text)
            rec["confidence"] = round(dist.get(_spell(leaf.value), 0.0), 4)
            rec["distribution"] = {_label(o): round(dist.get(_spell(o), 0.0), 4) for o in leaf.options}
            rec["undecided"] = round(undecided, 4)
        rec["free_tokens"] = len(free)
        rec["calibrated"] = False
        out.append(rec)
    return out


def recorded(events: Iterable[StepEvent], into: list[StepEvent]) -> Iterator[StepEvent]:
    """The events, each kept in `into` on its way through (what `with_confidence` reads at the end)."""
    for ev in events:
        into.append(ev)
        yield ev


def with_confidence(
    deltas: Iterable[Delta], steps: list[StepEvent], schema: dict[str, Any], token_text: Callable[[int], str]
) -> Iterator[Delta]:
    """The deltas, the last one carrying the reply's records (`steps` is filled by `recorded`)."""
    for d in deltas:
        if d.finish_reason is None:
            yield d
            continue
        spans, pos = [], 0
        for ev in steps:
            if ev.token_id is not None:
                spans.append(Step(pos, pos + len(ev.text), ev.token_id, ev.choice))
            pos += len(ev.text)
        text = "".join(ev.text for ev in steps)
        yield replace(d, confidence=field_confidence(schema, text, spans, token_text))


def _spell(option: Any) -> str:
    return json.dumps(option, ensure_ascii=False, separators=(", ", ": "))


def _label(option: Any) -> str:
    return option if isinstance(option, str) else _spell(option)


def _option_mass(
    leaf: _Leaf, text: str, steps: list[Step], token_text: Callable[[int], str]
) -> tuple[dict[str, float], float]:
    """Mass per option's spelling, along the path the reply took (see the module docstring)."""
    spelled = [_spell(o) for o in leaf.options]
    dist: dict[str, float] = dict.fromkeys(spelled, 0.0)
    carry, undecided, open_ = 1.0, 0.0, False
    for s in steps:
        outside = text[s.start : leaf.start] if s.start < leaf.start else ""
        prefix = text[leaf.start : s.start] if s.start > leaf.start else ""
        viable = [o for o in spelled if o.startswith(prefix)]
        if len(viable) < 2 or s.choice is None or not s.choice.options:
            continue  # nothing was decided here (forced, or already settled)
        taken = False
        for tok, p in s.choice.options:
            alt = token_text(tok)
            if not alt.startswith(outside):
                undecided += carry * p  # the token leaves this value for other structure
                continue
            cand = prefix + alt[len(outside) :]
            group = [o for o in viable if o.startswith(cand) or cand.startswith(o)]
            if len(group) == 1:
                dist[group[0]] += carry * p
            elif tok == s.token_id:
                taken = True
                next_carry = carry * p  # still ambiguous: the next deciding position splits it
            else:
                undecided += carry * p
        rest = 1.0 - sum(p for _t, p in s.choice.options)
        undecided += carry * max(rest, 0.0)
        if not taken:
            return dist, undecided
        carry, open_ = next_carry, True
    return dist, undecided + (carry if open_ else 0.0)  # open_: cut off while still ambiguous


def _walk(schema: dict[str, Any], root: dict[str, Any], node: Any, path: str, out: list[_Leaf]) -> None:
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or node is None:
        return
    for key in ("anyOf", "oneOf"):
        if key in schema:  # the branch the value took: the first whose type fits
            for branch in schema[key]:
                b = _resolve(branch, root)
                if isinstance(b, dict) and _fits(b, node):
                    _walk(b, root, node, path, out)
                    return
            return
    value, start, end = node.value, node.start, node.end
    if "enum" in schema:
        options = tuple(schema["enum"])
        if len(options) > 1 and not isinstance(value, (dict, list)):
            out.append(_Leaf(path, "enum", value, start, end, options))
        return
    if "const" in schema:
        return
    kind = schema.get("type")
    if kind == "boolean" and isinstance(value, bool):
        out.append(_Leaf(path, "boolean", value, start, end, (True, False)))
    elif kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
        out.append(_Leaf(path, "integer", value, start, end))
    elif isinstance(value, dict):
        props = schema.get("properties", {})
        for k, child in value.items():
            sub = props.get(k, schema.get("additionalProperties"))
            if isinstance(sub, dict):
                _walk(sub, root, child, f"{path}.{k}" if path else k, out)
    elif isinstance(value, list):
        prefix = schema.get("prefixItems", [])
        for i, child in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items")
            if isinstance(sub, dict):
                _walk(sub, root, child, f"{path}[{i}]", out)


_TYPES: dict[str, type | tuple[type, ...]] = {
    "null": type(None),
    "boolean": bool,
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
}


def _fits(schema: dict[str, Any], node: Any) -> bool:
    if "enum" in schema:
        return node.value in schema["enum"]
    if "const" in schema:
        return node.value == schema["const"]
    kind = schema.get("type")
    if kind is None:
        return True
    kinds = kind if isinstance(kind, list) else [kind]
    v = node.value
    return any(
        isinstance(v, _TYPES[k]) and not (k in ("integer", "number") and isinstance(v, bool))
        for k in kinds
        if k in _TYPES
    )


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    seen = 0
    while isinstance(schema, dict) and "$ref" in schema and seen < 32:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            return {}
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        schema, seen = target, seen + 1
    return schema


@dataclass
class _Node:
    """A JSON value with its character span; containers hold child nodes."""

    value: Any
    start: int
    end: int


class _Scanner:
    """A small JSON reader that remembers where each value sits in the text."""

    def __init__(self, text: str):
        self.s, self.i = text, 0
        self.dec = json.JSONDecoder()

    def document(self) -> _Node:
        self._ws()
        node = self._value()
        self._ws()
        if self.i != len(self.s.rstrip()):
            raise ValueError("trailing text")
        return node

    def _ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def _value(self) -> _Node:
        start, c = self.i, self.s[self.i : self.i + 1]
        if c == "{":
            self.i += 1
            items: dict[str, _Node] = {}
            self._ws()
            if self.s[self.i : self.i + 1] == "}":
                self.i += 1
                return _Node(items, start, self.i)
            while True:
                self._ws()
                key = self._value()
                self._ws()
                self._expect(":")
                self._ws()
                items[str(key.value)] = self._value()
                self._ws()
                if self._take("}"):
                    return _Node(items, start, self.i)
                self._expect(",")
        if c == "[":
            self.i += 1
            elems: list[_Node] = []
            self._ws()
            if self._take("]"):
                return _Node(elems, start, self.i)
            while True:
                self._ws()
                elems.append(self._value())
                self._ws()
                if self._take("]"):
                    return _Node(elems, start, self.i)
                self._expect(",")
        value, end = self.dec.raw_decode(self.s, self.i)
        self.i = end
        return _Node(value, start, end)

    def _take(self, ch: str) -> bool:
        if self.s[self.i : self.i + 1] == ch:
            self.i += 1
            return True
        return False

    def _expect(self, ch: str) -> None:
        if not self._take(ch):
            raise ValueError(f"expected {ch!r} at {self.i}")
