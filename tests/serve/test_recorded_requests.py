"""Requests real clients sent, replayed against the server: every field they send is accepted.

The fixtures (tests/fixtures/requests, re-recorded by the scripts there) are Claude Code's turns,
the openai SDK's, LangChain's and the OpenAI Agents SDK's, as they went over the wire: body,
headers and query. Each is replayed as is on a fake model over a real tokenizer and the real
decode loop (fake_engine.GrammarEngine), which "wants" to write what such a client expects next:

- a call to the first offered tool when a call is due (tools offered and no tool result to
  answer, or a call forced), with arguments built from the tool's own schema;
- the schema's JSON for structured output; plain text otherwise.

What the server guarantees is then checked: 200, the API's own reply or event stream (each event
held to the SDK's types, in order), the call's arguments valid for the tool's schema, and a
structured reply valid for its schema.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import sdk_models
from fake_engine import GrammarEngine
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from goinfer.serve.events import fold_chat
from goinfer.serve.messages import fold_message
from sse import named_events

pytestmark = pytest.mark.asyncio

FIXTURES = sorted((Path(__file__).parents[1] / "fixtures" / "requests").glob("*.json"))
ANSWER = "The number is 7319."


def example_of(schema: Any, root: dict[str, Any]) -> Any:
    """A small instance of `schema`: only required properties, the first of each choice."""
    if not isinstance(schema, dict):
        return "x"
    if "$ref" in schema:
        *_, kind, name = schema["$ref"].split("/")
        return example_of(root[kind][name], root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return example_of(schema[key][0], root)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        return {k: example_of(props.get(k, {}), root) for k in schema.get("required", [])}
    if kind == "array":
        return [example_of(schema.get("items", {}), root)] * schema.get("minItems", 0)
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0) + 1)
        return max(1, int(low))
    return {"boolean": True, "null": None}.get(kind, "x" * max(1, schema.get("minLength", 1)))  # type: ignore[arg-type]


def offered_tools(path: str, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each offered function's name -> its argument schema, however the API spells tools."""
    out = {}
    for t in body.get("tools") or []:
        if path == "/v1/messages":
            out[t["name"]] = t.get("input_schema", {})
        elif "function" in t:
            out[t["function"]["name"]] = t["function"].get("parameters", {})
        elif t.get("type") == "function":
            out[t["name"]] = t.get("parameters", {})
    return out


def forced_tool(body: dict[str, Any], names: list[str]) -> str | None:
    """The tool a call must name, when tool_choice forces one (any call: the first offered)."""
    choice = body.get("tool_choice")
    if choice in ("required", "any") or (isinstance(choice, dict) and choice.get("type") == "any"):
        return names[0]
    if isinstance(choice, dict) and choice.get("type") in ("function", "tool"):
        return (choice.get("function") or choice)["name"]
    return None


def answers_a_tool(path: str, body: dict[str, Any]) -> bool:
    """The request's last turn carries a tool's result."""
    if path == "/v1/messages":
        content = body["messages"][-1].get("content")
        return isinstance(content, list) and any(b.get("type") == "tool_result" for b in content)
    if path == "/v1/responses":
        items = body["input"] if isinstance(body["input"], list) else []
        return bool(items) and items[-1].get("type") == "function_call_output"
    return body["messages"][-1]["role"] == "tool"


def structured_schema(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    fmt = (body.get("text") or {}).get("format") if path == "/v1/responses" else body.get("response_format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "object"}
    return fmt["schema"] if path == "/v1/responses" else fmt["json_schema"]["schema"]


def expected(path: str, body: dict[str, Any]) -> tuple[str | None, str]:
    """(the tool a reply calls, or None; the text the fake model wants to write)."""
    tools = offered_tools(path, body)
    names = list(tools)
    forced = forced_tool(body, names) if names else None
    if names and body.get("tool_choice") != "none" and (forced or not answers_a_tool(path, body)):
        name = forced or names[0]
        args = example_of(tools[name], tools[name])
        return name, f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
    schema = structured_schema(path, body)
    if schema is not None:
        return None, json.dumps(example_of(schema, schema) or {"ok": True})
    return None, ANSWER


# -- reading each API's reply: (text, [(tool name, arguments)]) ------------------------------------
Reply = tuple[str, list[tuple[str, Any]]]


def chat_reply(message: dict[str, Any]) -> Reply:
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]
    return message.get("content") or "", calls


def responses_reply(response: dict[str, Any]) -> Reply:
    sdk_models.response(response)
    assert response["status"] == "completed", response
    text = "".join(
        p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"]
    )
    calls = [
        (i["name"], json.loads(i["arguments"])) for i in response["output"] if i["type"] == "function_call"
    ]
    return text, calls


def messages_reply(message: dict[str, Any]) -> Reply:
    text = "".join(b["text"] for b in message["content"] if b["type"] == "text")
    return text, [(b["name"], b["input"]) for b in message["content"] if b["type"] == "tool_use"]


def anthropic_events_in_order(events: list[dict[str, Any]]) -> None:
    kinds = [e["type"] for e in events if e["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    open_block = None
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_block is None, "a block opened before the last one closed"
            open_block = e["index"]
        elif e["type"] in ("content_block_delta", "content_block_stop"):
            assert e["index"] == open_block, e
            if e["type"] == "content_block_stop":
                open_block = None
    assert open_block is None


async def reply_of(resp: Any, path: str, stream: bool) -> Reply:
    raw = (await resp.read()).decode()
    if path == "/v1/chat/completions":
        if not stream:
            return chat_reply(sdk_models.openai_reply(json.loads(raw))["choices"][0]["message"])
        data = [b[6:] for b in raw.split("\n\n") if b.startswith("data: ")]
        assert data[-1] == "[DONE]"
        return chat_reply(
            fold_chat([sdk_models.chunk(json.loads(d)) for d in data[:-1]], False)["choices"][0]["message"]
        )
    if path == "/v1/responses":
        if not stream:
            return responses_reply(json.loads(raw))
        events = [sdk_models.response_event(e) for e in named_events(raw)]
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
        return responses_reply(events[-1]["response"])
    assert path == "/v1/messages"
    if not stream:
        return messages_reply(sdk_models.message(json.loads(raw)))
    events = [sdk_models.message_event(e) for e in named_events(raw)]
    anthropic_events_in_order(events)
    return messages_reply(fold_message(events))


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
async def test_a_recorded_request_is_served_as_its_client_expects(aiohttp_client, fixture: Path):
    rec = json.loads(fixture.read_text())
    path, body = rec["path"], rec["body"]
    call, script = expected(path, body)
    # The window fits Claude Code's 76 KB prompt at a byte per token.
    engine = GrammarEngine(script, context_window=200_000, noise=0.5)
    app = create_app({body["model"]: engine}, ServeConfig(keepalive_s=0.05, poll_s=0.01))
    client = await aiohttp_client(app)
    url = f"{path}?{rec['query']}" if rec["query"] else path
    resp = await client.request(rec["method"], url, data=json.dumps(body), headers=rec["headers"])
    assert resp.status == 200, await resp.text()
    text, calls = await reply_of(resp, path, bool(body.get("stream")))
    if call is not None:
        assert [name for name, _ in calls] == [call], (text, calls)
        jsonschema.validate(calls[0][1], offered_tools(path, body)[call])
        return
    assert not calls, calls
    schema = structured_schema(path, body)
    if schema is not None:
        jsonschema.validate(json.loads(text), schema)
    else:
        assert text == ANSWER
