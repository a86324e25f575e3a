"""response_format and goinfer_confidence: from the request to a grammar, refused before prefill.

`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` constrains the reply to the
schema (always enforced, strict or not); `{"type": "json_object"}` to any JSON object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from goinfer.runtime import grammar as g

from .errors import bad_request


@dataclass(frozen=True)
class Structured:
    grammar: str
    schema: dict[str, Any] | None  # None for json_object


def response_format(rf: dict[str, Any] | None) -> Structured | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured(g.compile_json_schema({"type": "object"}), None)
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
            param="response_format.type",
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        where = "response_format.json_schema"
        raise bad_request(f"{where} must be an object", param=where)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request(
            "response_format.json_schema.schema must be a JSON schema object",
            param="response_format.json_schema.schema",
        )
    try:
        return Structured(g.compile_json_schema(schema), schema)
    except g.GrammarError as e:
        raise bad_request(
            f"response_format.json_schema.schema is not a usable JSON schema: {e}",
            param="response_format.json_schema.schema",
        ) from None


def confidence_schema(asked: bool, fmt: Structured | None, with_tools: bool) -> dict[str, Any] | None:
    """The schema goinfer_confidence reads field kinds from; None when it was not asked for."""
    if not asked:
        return None
    if fmt is None or fmt.schema is None:
        raise bad_request(
            'goinfer_confidence needs response_format {"type": "json_schema", ...}: the schema says each '
            "field's kind",
            param="goinfer_confidence",
        )
    if with_tools:
        raise bad_request("goinfer_confidence cannot be combined with tools", param="goinfer_confidence")
    return fmt.schema
