"""Schemas no finite JSON value satisfies are found before llguidance compiles them (issue 32:
`{"$ref": "#"}` compiled to an empty reply, a recursive required property to ParserTooComplex)."""

from __future__ import annotations

import pytest
from goinfer.runtime import grammar as g
from goinfer.runtime.satisfiable import why_unsatisfiable

# Recursion with a way out: a linked list (next may be left out), a tree (kids may be []).
NODE = {"type": "object", "properties": {"value": {"type": "integer"}, "next": {"$ref": "#"}},
        "required": ["value"]}  # fmt: skip
NONEMPTY = {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/a"}}
KIDS = {"type": "array", "items": {"$ref": "#/$defs/t"}}
TREE = {"$defs": {"t": {"type": "object", "properties": {"kids": KIDS}, "required": ["kids"]}},
        "$ref": "#/$defs/t"}  # fmt: skip


@pytest.mark.parametrize(
    "schema, where",
    [
        ({"$ref": "#"}, "'#'"),
        ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, "#/properties/x"),
        ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": NONEMPTY}, "$ref": "#/$defs/a"}, "#/$defs/a"),
        ({"type": "object", "properties": {"x": False}, "required": ["x"]}, "false"),
        ({"enum": []}, "enum is empty"),
        ({"type": "object", "enum": [1, "a", [2]]}, "no listed value"),  # a tool's arguments, so spelled
        ({"type": "integer", "const": True}, "no listed value"),
        ({"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}, "anyOf"),
        ({"type": "object", "required": ["y"], "additionalProperties": False}, "'y'"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems"),
        ({"type": "string", "minLength": 9, "maxLength": 2}, "minLength"),
    ],
)
def test_a_schema_without_a_finite_instance_is_named(schema, where) -> None:
    why = why_unsatisfiable(schema)
    assert why is not None and where in why, why
    with pytest.raises(g.GrammarError, match="no finite JSON value"):
        g.json_schema_grammar(schema, lenient=True)


@pytest.mark.parametrize(
    "schema",
    [
        NODE,
        TREE,
        {"type": "object", "properties": {"x": {"$ref": "#"}}},  # x may be left out
        {"properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # no type: 1 satisfies it
        {"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # null
        {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
        {"type": ["object", "integer"], "enum": [3.0]},
        {"type": "array", "items": {"$ref": "#"}},  # [] satisfies it
        {"$ref": "#/$defs/missing"},  # the compiler's to refuse, with its own reason
        True,
        {},
    ],
)
def test_recursion_with_a_way_out_is_left_alone(schema) -> None:
    assert why_unsatisfiable(schema) is None


def test_deep_nesting_is_a_reason_not_a_crash() -> None:
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "array", "minItems": 1, "items": deep}
    assert why_unsatisfiable(deep) == "it nests too deeply"
    with pytest.raises(g.GrammarError):
        g.json_schema_grammar(deep)


def test_a_grammar_that_admits_only_an_empty_reply_is_refused_before_any_token() -> None:
    """The first step of every constraint is tried at plan time (GrammarTokenizer.constraint)."""
    from fake_engine import GrammarEngine

    tok = GrammarEngine().grammar
    with pytest.raises(g.GrammarError, match="only an empty reply"):
        tok.constraint(g.compile_lark('start: ""'))
    assert tok.constraint(g.compile_lark('start: "a"')).allowed().sum() == 1
