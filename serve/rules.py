"""What constrains a reply: response_format, tools and goinfer_confidence, from a job to a grammar.

`rules_for()` reads and checks them without compiling anything (every refusal here comes before any
prefill). `Rules.constraint` then compiles the one grammar a request needs, once, with the model's
tokenizer (llguidance), off the event loop.

`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` constrains the reply to the
schema, strict or not. With `strict: true` every keyword must be enforceable, else a 400 names the
one that is not; without it the schema compiles leniently, as tools' do (runtime/grammar.py
`LENIENT_OPTIONS`). `{"type": "json_object"}` constrains the reply to any JSON object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from goinfer.runtime import grammar as g

from .engine import Engine
from .errors import APIError, bad_request, unsupported
from .job import Job
from .tools import ToolPlan, plan_tools

SCHEMA_PARAM = "response_format.json_schema.schema"


@dataclass(frozen=True)
class Structured:
    grammar: str  # not compiled yet
    schema: dict[str, Any] | None  # None for json_object


@dataclass(frozen=True)
class Rules:
    """A response format's grammar or tools (not both), and, when per-field confidence is asked
    for, the schema it reads field kinds from."""

    structured: Structured | None = None
    tools: ToolPlan | None = None
    confidence: dict[str, Any] | None = None

    def template_vars(self) -> dict[str, Any]:
        out = self.tools.template_vars() if self.tools else {}
        if self.structured is not None or (self.tools is not None and self.tools.forced):
            out["enable_thinking"] = False  # constrained from token 1: no open <think> block
        return out

    @property
    def constrained(self) -> bool:
        return self.structured is not None or self.tools is not None

    def constraint(self, engine: Engine) -> g.Constraint | None:
        """The grammar mask, compiled once. Blocking (the tokenizer may still be building)."""
        tok = engine.grammar
        if not self.constrained or tok is None:  # (an engine without grammar was refused in `rules_for`)
            return None
        what = "tools" if self.tools is not None else "response_format"
        try:
            tok.get()
        except g.GrammarError as e:  # this tokenizer cannot drive llguidance
            raise unsupported(f"{what}: {e}", what) from None
        if self.tools is not None:
            return self.tools.constraint(tok, engine.token_text)
        assert self.structured is not None
        try:
            return g.GrammarConstraint(tok.matcher(self.structured.grammar), tok.vocab_size)
        except g.GrammarError as e:
            raise _schema_error(e) from None


def rules_for(engine: Engine, job: Job) -> Rules:
    """The job's constraints, checked against what the model can do."""
    tools = plan_tools(job.tools, job.tool_choice, job.parallel_tool_calls, engine.info.chat_template)
    fmt = response_format(job.response_format)
    schema = confidence_schema(job.confidence, fmt, bool(job.tools))
    if tools is not None and fmt is not None:
        raise unsupported(
            "tools with a JSON response_format in one request is not supported", "response_format"
        )
    if (tools is not None or fmt is not None) and engine.grammar is None:
        what = "tools" if tools is not None else "response_format"
        raise unsupported(f"{what}: this model cannot run grammar-constrained decoding", what)
    return Rules(fmt, tools, schema)


def response_format(rf: dict[str, Any] | None) -> Structured | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured(g.json_schema_grammar({"type": "object"}), None)
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
        raise bad_request(f"{SCHEMA_PARAM} must be a JSON schema object", param=SCHEMA_PARAM)
    try:
        return Structured(g.compile_json_schema(schema, lenient=spec.get("strict") is not True), schema)
    except g.GrammarError as e:
        raise _schema_error(e) from None


def _schema_error(e: g.GrammarError) -> APIError:
    return bad_request(f"{SCHEMA_PARAM} is not a usable JSON schema: {e}", param=SCHEMA_PARAM)


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
