"""Can any finite JSON value satisfy a schema? Asked before a grammar is compiled.

llguidance compiles `{"$ref": "#"}` to a grammar whose only word is the empty reply, and
`{"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}` to one that fails
after `{"` (ParserTooComplex): neither schema has a finite instance. `why_unsatisfiable` finds
such schemas from their structure: the least fixpoint of "has a finite instance" over the local
`$ref` graph, read through types, required properties, minimum item counts, enums, allOf / anyOf /
oneOf and contradictory bounds. It errs toward "satisfiable" wherever it cannot tell (`not`,
patterns, external refs), leaving those to the compiler.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

_SCALARS = {"string", "number", "integer", "boolean", "null"}


def why_unsatisfiable(schema: Any) -> str | None:
    """None when some finite JSON value may satisfy `schema`, else where and why none can."""
    try:
        return _Check(schema).run()
    except RecursionError:
        return "it nests too deeply"


class _Check:
    def __init__(self, root: Any):
        self.root = root
        self.finite: dict[str, bool] = {}  # $ref target pointer -> has a finite instance (this pass)
        self.reason: str | None = None

    def run(self) -> str | None:
        # Least fixpoint: every $ref target starts "not finite" and is raised while a pass raises any.
        while True:
            before = dict(self.finite)
            self.reason = None
            ok = self.ok(self.root, "#")
            for ptr in list(self.finite):
                self.finite[ptr] = self.ok(self._resolve(ptr), ptr)
            if self.finite == before:
                return None if ok else self.reason or "no finite JSON value satisfies it"

    def fail(self, why: str) -> bool:
        self.reason = self.reason or why
        return False

    def ok(self, s: Any, at: str) -> bool:
        if s is False:
            return self.fail(f"{at} is the schema false")
        if not isinstance(s, dict):
            return True  # true, or malformed: the compiler has its say
        ref = s.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = self._resolve(ref)
            if target is not _MISSING:
                if ref not in self.finite:
                    self.finite[ref] = False
                if not self.finite[ref]:
                    return self.fail(f"{at} refers to {ref!r}, each value of which must contain another")
        if "enum" in s and isinstance(s["enum"], list) and not s["enum"]:
            return self.fail(f"{at}.enum is empty")
        for i, sub in enumerate(_list(s.get("allOf"))):
            if not self.ok(sub, f"{at}/allOf/{i}"):
                return False
        for key in ("anyOf", "oneOf"):
            if key in s and isinstance(s[key], list):
                kept = self.reason  # a failing branch beside a good one is no reason
                if not any(self.ok(sub, f"{at}/{key}/{i}") for i, sub in enumerate(s[key])):
                    return self.fail(f"{at}.{key}: no branch has a finite value")
                self.reason = kept
        kinds = s.get("type")
        values = [s["const"]] if "const" in s else s.get("enum")
        if isinstance(values, list):  # a listed value must also be of the schema's type, if it names one
            if kinds is None or any(_of_type(v, kinds) for v in values):
                return True
            return self.fail(f"{at}: no listed value (enum, const) is of its type {kinds!r}")
        if kinds is None:
            return True  # a value of some other type satisfies the type-specific keywords
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not kinds:
            return self.fail(f"{at}.type is an empty list")
        return any(self._kind_ok(s, k, at) for k in kinds)

    def _kind_ok(self, s: dict[str, Any], kind: Any, at: str) -> bool:
        if kind == "object":
            return self._object_ok(s, at)
        if kind == "array":
            return self._array_ok(s, at)
        if kind == "string" and _gt(s.get("minLength"), s.get("maxLength")):
            return self.fail(f"{at}: minLength is over maxLength")
        if kind in ("number", "integer") and _gt(s.get("minimum"), s.get("maximum")):
            return self.fail(f"{at}: minimum is over maximum")
        return kind in _SCALARS or self.fail(f"{at}.type {kind!r} is not a JSON type")

    def _object_ok(self, s: dict[str, Any], at: str) -> bool:
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        extra = s.get("additionalProperties", True)
        if _gt(s.get("minProperties"), s.get("maxProperties")):
            return self.fail(f"{at}: minProperties is over maxProperties")
        for name in _list(s.get("required")):
            if not isinstance(name, str):
                continue
            sub, where = (props[name], f"{at}/properties/{name}") if name in props else (extra, at)
            if sub is False and name not in props:
                return self.fail(f"{at}: required property {name!r} is not allowed (additionalProperties)")
            if not self.ok(sub, where):
                return False
        return True

    def _array_ok(self, s: dict[str, Any], at: str) -> bool:
        least = s.get("minItems", 0)
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        if _gt(least, s.get("maxItems")):
            return self.fail(f"{at}: minItems is over maxItems")
        prefix = _list(s.get("prefixItems"))
        for i in range(min(least, len(prefix))):
            if not self.ok(prefix[i], f"{at}/prefixItems/{i}"):
                return False
        if least > len(prefix):
            return self.ok(s.get("items", True), f"{at}/items")
        return True

    def _resolve(self, ref: str) -> Any:
        node: Any = self.root
        for part in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return _MISSING
        return node


_MISSING = object()


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,), "null": (type(None),),
    "number": (int, float), "integer": (int,),
}  # fmt: skip


def _of_type(value: Any, kinds: Any) -> bool:
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for k in kinds:
        if k not in _PY_TYPES:
            return True  # not a JSON type: the compiler's to refuse
        if isinstance(value, bool) and k != "boolean":
            continue  # True is an int to Python, not to JSON
        whole = k == "integer" and isinstance(value, float) and value.is_integer()
        if isinstance(value, _PY_TYPES[k]) or whole:
            return True
    return False


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _gt(low: Any, high: Any) -> bool:
    nums = (int, float)
    ok = isinstance(low, nums) and isinstance(high, nums) and not isinstance(low, bool)
    return ok and not isinstance(high, bool) and low > high
