"""Tool calling: the request's tools and tool_choice, the prompt, the constraint, the parser.

- `plan_tools` reads `tools` / `tool_choice` (400 on a bad tool or an unknown named tool).
- The call format follows the checkpoint's chat template (hermes `<tool_call>`, llama3, mistral).
  A template that renders tools itself gets them as the `tools` variable; one that does not gets
  the documented fallback: the tools described in the system message in the Hermes form, and
  earlier calls and results replayed as `<tool_call>` / `<tool_response>` text.
- `ToolPlan.constraint` is the grammar mask, compiled once with the model's tokenizer: a named tool
  or `required` is constrained from the first token; `auto` from the moment the model writes the
  opener, so prose decodes untouched.
- Argument schemas compile leniently (runtime/grammar.py `LENIENT_OPTIONS`): a keyword the grammar
  cannot enforce (propertyNames, if/then, ...) is ignored and logged once, never a 400, as the
  upstream APIs accept such schemas. A schema that cannot be compiled at all (an external $ref) is
  a 400 naming the tool.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from goinfer.runtime import grammar as g
from llguidance import LLTokenizer

from ..errors import bad_request
from .formats import HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS, MISTRAL_TEKKEN, CallFormat
from .stream import bare_call_end

__all__ = ["CallFormat", "Tool", "ToolPlan", "call_format", "call_grammar", "plan_tools", "prepare_messages"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def call_format(template: str) -> tuple[CallFormat, bool]:
    """(the family's call format, whether its template renders tools itself)."""
    native = re.search(r"\btools\b", template) is not None
    if "[TOOL_CALLS]" in template and "[ARGS]" in template:
        return MISTRAL_ARGS, native
    if "[TOOL_CALLS][" in template:
        return MISTRAL_TEKKEN, native
    if "[TOOL_CALLS]" in template:
        return MISTRAL, native
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and native):
        return LLAMA3, native
    return HERMES, native and "<tool_call>" in template


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def arguments_schema(self) -> dict[str, Any]:
        """The schema a call's arguments are held to: always an object, whatever else the tool's
        schema allows (`plan_tools` refused one whose type excludes objects; one that names no
        type gets it here)."""
        return {**self.parameters, "type": "object"}

    def openai(self) -> dict[str, Any]:
        """The tool as the OpenAI request spelled it (what chat templates expect)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


def call_grammar(fmt: CallFormat, tools: list[Tool], parallel: bool, tok: LLTokenizer | None = None) -> str:
    """Lark for everything after the opener: one call (or several) to the supplied tools. With the
    model's tokenizer, tags that are special tokens are matched as those tokens."""
    alts = " | ".join(f"call{i}" for i in range(len(tools)))
    rules = [f"call{i}: {_call_rule(fmt, t, tok)}" for i, t in enumerate(tools)]
    more = f"({g.lark_literal(fmt.joiner, tok)} call)*" if parallel else ""
    start = f"start: {g.lark_literal(fmt.call_open, tok)} call {more} {g.lark_literal(fmt.close, tok)}"
    return "\n".join([start, f"call: {alts}", *rules])


def _call_rule(fmt: CallFormat, tool: Tool, tok: LLTokenizer | None) -> str:
    """One call to `tool`: a JSON object, or (named formats) its name, tags and arguments."""
    if not fmt.args_tag:
        return g.json_in_lark(call_schema(fmt, tool))
    call_id = f"({g.lark_literal(fmt.id_tag, tok)} /[A-Za-z0-9]{{9}}/)?" if fmt.id_tag else ""
    args = g.json_in_lark(tool.arguments_schema())
    return f"{g.lark_literal(tool.name)} {call_id} {g.lark_literal(fmt.args_tag, tok)} {args}"


def call_schema(fmt: CallFormat, tool: Tool) -> dict[str, Any]:
    properties = {"name": {"const": tool.name}, fmt.args_key: tool.arguments_schema()}
    if fmt.id_key:  # optional, as the template replays it: 9 letters and digits
        properties[fmt.id_key] = {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}
    return {
        "type": "object",
        "properties": properties,
        "required": ["name", fmt.args_key],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[Tool, ...]
    choice: str  # "auto" | "required" | "named"
    named: str | None
    parallel: bool
    fmt: CallFormat
    native: bool
    schema_param: str = "tools.{i}.function.parameters"  # where the API spelled a tool's schema

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    @property
    def forced(self) -> bool:
        """Constrained from the first token (the prompt is then rendered thinking-off)."""
        return self.choice != "auto"

    def constraint(self, tok: g.GrammarTokenizer) -> g.Constraint:
        """The call grammar compiled once, with the tokenizer (tags that are special tokens match
        as those tokens), its first step tried. Blocking: the tokenizer may still be building."""
        llg = tok.get()
        called = [t for t in self.tools if t.name == self.named] if self.named else list(self.tools)
        try:
            lark = call_grammar(self.fmt, called, self.parallel and not self.named, llg)
            first = tok.constraint(lark)
        except g.GrammarError as e:
            raise bad_request(f"tools: the call grammar cannot be built: {e}", param="tools") from None
        if self.choice == "auto":  # one request, one run: the trigger fires at most once
            return g.TriggeredConstraint(self.fmt.opener, lambda: first, tok.decode_bytes)
        return g.PrefixedConstraint(llg.tokenize_str(self.fmt.opener), first, tok.vocab_size)

    def reply_end(self, text: str) -> int | None:
        """A reply that opens with a bare call to a supplied tool ends with that call's object."""
        return bare_call_end(text, self.names, self.fmt.args_key) if self.fmt.unwrapped else None

    def template_vars(self) -> dict[str, Any]:
        return {"tools": [t.openai() for t in self.tools]} if self.native else {}


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel: bool | None,
    template: str,
    schema_param: str = "tools.{i}.function.parameters",
) -> ToolPlan | None:
    """The request's tools, or None when no tool may be called (none given, or tool_choice none)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    parsed = tuple(_tool(t, i, schema_param) for i, t in enumerate(tools))
    for i, t in enumerate(parsed):  # every tool shown, callable or not: same rule, before any prefill
        _check_schema(t, schema_param.format(i=i))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise bad_request("tools: each function needs a distinct name", param="tools")
    choice, named = _choice(tool_choice, set(names))
    if choice == "none":
        return None
    fmt, native = call_format(template)
    # One call per reply unless parallel_tool_calls is true (llama.cpp's default too): a small model
    # allowed another call after each one tends to repeat the same call until max_tokens.
    return ToolPlan(parsed, choice, named, parallel is True, fmt, native, schema_param)


def _tool(t: Any, i: int, schema_param: str) -> Tool:
    where = f"tools.{i}"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise bad_request(f"{where}: only tools of type 'function' are supported", param=f"{where}.type")
    fn = t.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
        what = f"{where}.function.name"
        raise bad_request(f"{what} must be 1-64 letters, digits, '_', '-' or '.'", param=what)
    params = fn.get("parameters", {"type": "object", "properties": {}})
    what = schema_param.format(i=i)
    if not isinstance(params, dict):
        raise bad_request(f"{what} must be a JSON schema object", param=what)
    kind = params.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise bad_request(f"{what} must have type 'object': a call's arguments are an object", param=what)
    return Tool(fn["name"], str(fn.get("description") or ""), params)


def _check_schema(t: Tool, where: str) -> None:
    """A 400 naming the tool for a schema that cannot be compiled even leniently, or that no finite
    JSON satisfies (compiles are cached per schema; each ignored keyword is logged once)."""
    try:
        g.compile_json_schema(t.arguments_schema(), lenient=True)
    except g.GrammarError as e:
        why = f"{where} is not a usable JSON schema: {e}"
        raise bad_request(why, param=where, code="invalid_schema") from None


def _choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not in tools ({', '.join(sorted(names))})",
                param="tool_choice",
            )
        return "named", name
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


# -- the conversation ------------------------------------------------------------------------
FALLBACK_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def prepare_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, template: str
) -> list[dict[str, Any]]:
    """Replay earlier calls and results the way the template reads them.

    Call arguments arrive as JSON strings (OpenAI) and are handed to templates as objects (as
    transformers does); a tool result without a name gets the name of the call it answers. A call
    turn's null content reaches a template as "" (Qwen3's looks for `</think>` in it); Mistral's
    templates take ids of 9 letters and digits, so other ids reach them as their last 9 (vLLM's
    rule), a call's and its result's alike.
    """
    fmt, native = (plan.fmt, plan.native) if plan else call_format(template)
    ids = _mistral_id if fmt.opener == MISTRAL.opener else str
    by_id: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [_history_call(c, by_id) for c in m["tool_calls"]]
            if native:
                m["tool_calls"] = [{"type": "function", "id": ids(cid), "function": c} for cid, c in calls]
                if m.get("content") is None:
                    m["content"] = ""
            else:
                text = "".join(f"\n<tool_call>\n{json.dumps(c)}\n</tool_call>" for _cid, c in calls)
                m.pop("tool_calls")
                m["content"] = (m.get("content") or "") + text
        elif m["role"] == "tool":
            m.setdefault("name", by_id.get(str(m.get("tool_call_id")), ""))
            if native and m.get("tool_call_id") is not None:
                m["tool_call_id"] = ids(str(m["tool_call_id"]))
            if not native:
                body = f"<tool_response>\n{m['content']}\n</tool_response>"
                if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                    out[-1]["content"] += "\n" + body
                    continue
                m = {"role": "user", "content": body, "_tool_results": True}
        out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    if plan is not None and not native:
        tools = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in plan.tools)
        note = FALLBACK_SYSTEM.format(tools=tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def _mistral_id(cid: str) -> str:
    """A call id as Mistral's templates take it: 9 letters and digits."""
    alnum = re.sub(r"[^A-Za-z0-9]", "", cid)
    return alnum[-9:] if len(alnum) >= 9 else hashlib.sha256(cid.encode()).hexdigest()[:9]


def _history_call(c: Any, by_id: dict[str, str]) -> tuple[str, dict[str, Any]]:
    if not isinstance(c, dict):
        raise bad_request("messages: each tool_calls entry must be an object", param="messages")
    fn = c.get("function") or {}
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("messages: a tool call needs function.name", param="messages")
    name, args = fn["name"], fn.get("arguments", "{}")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):  # not JSON: kept as the string the client sent
            args = json.loads(args) if args.strip() else {}
    cid = str(c.get("id", ""))
    by_id[cid] = name
    return cid, {"name": name, "arguments": args}
