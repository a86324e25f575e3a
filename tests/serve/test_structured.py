"""Structured output, tool calls and goinfer_confidence through the server, on GrammarEngine: a
fake model over a real tokenizer and the real decode loop, so every grammar mask is llguidance's.

The fake "wants" to write a script; where the grammar forbids it, noise picks a legal token. So a
script that breaks the schema checks the constraint, and one that fits checks it leaves the reply
alone.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import sdk_models
from fake_engine import GrammarEngine
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from goinfer.serve.events import fold_chat

pytestmark = pytest.mark.asyncio

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
HELLO = [{"role": "user", "content": "hi"}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
        "city": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
        "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}  # fmt: skip


async def client_for(aiohttp_client, engine: GrammarEngine):
    return await aiohttp_client(create_app({"fake": engine}, ServeConfig(**FAST)))


async def post(client, body: dict[str, Any], path: str = "/v1/chat/completions"):
    r = await client.post(path, json={"model": "fake", "messages": HELLO, **body})
    return r.status, sdk_models.openai_reply(await r.json())


async def stream(client, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = await client.post(
        "/v1/chat/completions", json={"model": "fake", "messages": HELLO, **body, "stream": True}
    )
    assert r.status == 200
    text = (await r.read()).decode()
    events = [e[len("data: ") :] for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [sdk_models.chunk(json.loads(e)) for e in events[:-1]]


BAD_SCRIPT = '{"name": "a very long name indeed", "age": "old", "tags": [], "extra": 1}'
GOOD_SCRIPT = '{"name": "Ann", "age": 41, "tags": ["b"], "ok": true, "city": "Paris"}'


@pytest.mark.parametrize("temperature", [0, 0.8])
@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("script", [BAD_SCRIPT, GOOD_SCRIPT, "Sure! Here is the JSON you asked for"])
async def test_json_schema_replies_validate(aiohttp_client, temperature, streamed, script):
    engine = GrammarEngine(script)
    client = await client_for(aiohttp_client, engine)
    body = {"response_format": FORMAT, "temperature": temperature, "seed": 3, "max_tokens": 400}
    if streamed:
        reply = fold_chat(await stream(client, body), logprobs=False)
    else:
        status, reply = await post(client, body)
        assert status == 200
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    assert engine.template_vars == {"enable_thinking": False}  # constrained requests render thinking-off
    if script == GOOD_SCRIPT and temperature == 0:
        assert choice["message"]["content"] == GOOD_SCRIPT  # a reply that fits is left alone


async def test_json_object_and_max_tokens_cut(aiohttp_client):
    client = await client_for(aiohttp_client, GrammarEngine("no json here"))
    status, reply = await post(client, {"response_format": {"type": "json_object"}, "temperature": 0})
    assert status == 200 and isinstance(json.loads(reply["choices"][0]["message"]["content"]), dict)
    status, reply = await post(client, {"response_format": FORMAT, "max_tokens": 5})
    assert reply["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "strin"}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "(["}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
            "type": "object", "propertyNames": {"maxLength": 3}}}}}, "response_format.json_schema.schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "$ref": "https://example.com/remote.json"}}}]}, "tools.0.function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
         "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"goinfer_confidence": True}, "goinfer_confidence"),
        ({"goinfer_confidence": True, "response_format": {"type": "json_object"}}, "goinfer_confidence"),
        ({"goinfer_confidence": True, "response_format": FORMAT, "tools": [WEATHER]}, "goinfer_confidence"),
    ],
)  # fmt: skip
async def test_bad_schemas_and_tools_are_400_before_prefill(aiohttp_client, body, param):
    engine = GrammarEngine()
    client = await client_for(aiohttp_client, engine)
    status, reply = await post(client, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["message"]
    assert engine.params == []  # refused before anything ran


LOOSE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
         "required": ["city"], "propertyNames": {"maxLength": 8},
         "if": {"required": ["city"]}, "then": {"minProperties": 1}}  # fmt: skip


@pytest.mark.parametrize("where", ["tools", "response_format"])
async def test_keywords_the_grammar_cannot_enforce_are_ignored_and_logged_once(aiohttp_client, caplog, where):
    """Tools and non-strict formats compile leniently, as the upstream APIs accept such schemas
    (Claude Code's use propertyNames); the reply is valid for the schema without those keywords."""
    from goinfer.runtime import grammar

    grammar._validated.cache_clear()  # a fresh process, as far as the log is concerned
    grammar._compiled.cache_clear()
    grammar._note_ignored.cache_clear()
    loose = {"type": "function", "function": {"name": "where", "parameters": LOOSE}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": LOOSE}}
    body = {"tools": [loose], "tool_choice": "required"} if where == "tools" else {"response_format": fmt}
    script = '{"city": "Oslo"}' if where == "response_format" else _call_script("where", {"city": "Oslo"})
    client = await client_for(aiohttp_client, GrammarEngine(script))
    with caplog.at_level("WARNING", logger="goinfer.grammar"):
        for _ in range(2):
            status, reply = await post(client, {**body, "temperature": 0})
            assert status == 200, reply
    message = reply["choices"][0]["message"]
    args = message["tool_calls"][0]["function"]["arguments"] if where == "tools" else message["content"]
    assert json.loads(args) == {"city": "Oslo"}
    ignored = sorted(r.getMessage().split("'")[1] for r in caplog.records)
    assert ignored == ["if", "propertyNames", "then"]  # each once, over both requests


def _call_script(name: str, args: dict[str, Any], prose: str = "") -> str:
    return f"{prose}<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.mark.parametrize("streamed", [False, True])
async def test_named_tool_is_forced_from_the_first_token(aiohttp_client, streamed):
    engine = GrammarEngine("I would rather chat about the weather.")  # the model wants prose
    client = await client_for(aiohttp_client, engine)
    body = {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    reply = fold_chat(await stream(client, body), False) if streamed else (await post(client, body))[1]
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"])["tz"] in ("UTC", "CET")


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("choice", ["auto", "required", NAMED])
async def test_a_tools_request_compiles_its_grammar_once(aiohttp_client, monkeypatch, choice):
    """Once, with the model's tokenizer, before the prefill; each tool's schema is also checked
    without it (leniently, cached), called or not, so a refusal names the tool at fault."""
    import llguidance
    from goinfer.runtime import grammar

    built, checked = [], []
    real = llguidance.LLMatcher

    class Counting:
        def __call__(self, *args: Any, **kw: Any) -> Any:
            built.append(args[1])
            return real(*args, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    def spy(fn):
        return lambda *args, **kw: checked.append(fn.__name__) or fn(*args, **kw)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    for name in ("compile_lark", "compile_json_schema"):
        monkeypatch.setattr(grammar, name, spy(getattr(grammar, name)))
    engine = GrammarEngine(_call_script("get_time", {"tz": "UTC"}))
    client = await client_for(aiohttp_client, engine)
    status, reply = await post(client, {"tools": [WEATHER, TIME], "tool_choice": choice, "temperature": 0})
    assert status == 200 and reply["choices"][0]["finish_reason"] == "tool_calls"
    assert len(built) == 1 and engine.constrained == [True]
    assert checked == ["compile_json_schema"] * 2  # WEATHER's and TIME's


async def test_required_calls_one_of_the_tools_with_valid_arguments(aiohttp_client):
    engine = GrammarEngine(_call_script("get_weather", {"city": "Paris", "when": "now"}))
    client = await client_for(aiohttp_client, engine)
    _, reply = await post(client, {"tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 0})
    (call,) = reply["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])  # the extra "when" was refused
    assert args["city"] == "Paris"


async def test_auto_prose_is_untouched_and_unconstrained(aiohttp_client):
    script = "The weather is sunny."
    engine = GrammarEngine(script)
    client = await client_for(aiohttp_client, engine)
    _, with_tools = await post(client, {"tools": [WEATHER], "temperature": 0})
    assert engine.template_vars == {}  # the fake template has no tools: the fallback system note
    assert "<tools>" in engine.messages[0]["content"] and engine.messages[0]["role"] == "system"
    _, without = await post(client, {"temperature": 0})
    msg = with_tools["choices"][0]["message"]
    assert msg["content"] == without["choices"][0]["message"]["content"] == script
    assert "tool_calls" not in msg and with_tools["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("streamed", [False, True])
async def test_auto_call_after_prose_is_parsed_and_constrained(aiohttp_client, streamed):
    script = _call_script("get_weather", {"city": "Paris", "bogus": 1}, prose="Let me look. ")
    client = await client_for(aiohttp_client, GrammarEngine(script))
    body = {"tools": [WEATHER, TIME], "temperature": 0}
    if streamed:
        chunks = await stream(client, body)
        deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
        first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
        assert "".join(d.get("content") or "" for d in deltas[:first_call]) == "Let me look. "
        reply = fold_chat(chunks, False)
    else:
        reply = (await post(client, body))[1]
    msg = reply["choices"][0]["message"]
    assert msg["content"] == "Let me look. " and reply["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = msg["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


async def test_unwrapped_call_is_accepted_only_for_a_supplied_name(aiohttp_client):
    client = await client_for(
        aiohttp_client, GrammarEngine('{"name": "get_time", "arguments": {"tz": "UTC"}}')
    )
    _, reply = await post(client, {"tools": [WEATHER, TIME], "temperature": 0})
    assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    client = await client_for(aiohttp_client, GrammarEngine('{"name": "rm_rf", "arguments": {}}'))
    _, reply = await post(client, {"tools": [WEATHER, TIME], "temperature": 0})
    assert reply["choices"][0]["message"]["content"] == '{"name": "rm_rf", "arguments": {}}'
    assert "tool_calls" not in reply["choices"][0]["message"]


async def test_tool_history_replays_with_names_looked_up(aiohttp_client):
    engine = GrammarEngine("It is sunny.")
    client = await client_for(aiohttp_client, engine)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    r = await client.post(
        "/v1/chat/completions", json={"model": "fake", "messages": messages, "tools": [WEATHER]}
    )
    assert r.status == 200
    roles = [m["role"] for m in engine.messages]
    assert roles == ["system", "user", "assistant", "user"]  # fallback: results as a user turn
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in engine.messages[2]["content"]
    assert engine.messages[3]["content"] == '<tool_response>\n{"sky": "clear"}\n</tool_response>'


CONF_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "shipping", "technical"]},
        "urgent": {"type": "boolean"},
        "count": {"type": "integer"},
        "items": {"type": "array", "items": {"type": "object", "required": ["status"],
                                              "properties": {"status": {"enum": ["ok", "bad"]}}}},
        "fixed": {"enum": ["only"]},
        "note": {"type": "string"},
    },
    "required": ["category", "urgent", "count", "items", "fixed", "note"],
}  # fmt: skip
CONF_FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": CONF_SCHEMA}}
CONF_SCRIPT = (
    '{"category": "shipping", "urgent": false, "count": 12, "items": [{"status": "ok"}, {"status": "bad"}], '
    '"fixed": "only", "note": "late"}'
)


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_confidence_reports_enum_boolean_integer_fields(aiohttp_client, route):
    engine = GrammarEngine(CONF_SCRIPT, noise=2.0)
    client = await client_for(aiohttp_client, engine)
    body = {"response_format": CONF_FORMAT, "temperature": 0, "max_tokens": 300}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    if route == "completions":
        body = {**body, "prompt": "ticket:"}
    _, plain = await post(client, body, path)
    _, reply = await post(client, {**body, "goinfer_confidence": True}, path)
    text = lambda r: r["choices"][0]["message"]["content"] if route == "chat" else r["choices"][0]["text"]  # noqa: E731
    assert text(reply) == text(plain) == CONF_SCRIPT  # the answer is unchanged by the flag
    assert "goinfer_confidence" not in plain
    recs = {r["path"]: r for r in reply["goinfer_confidence"]}
    assert set(recs) == {"category", "urgent", "count", "items[0].status", "items[1].status"}  # not "fixed"
    cat = recs["category"]
    assert cat["kind"] == "enum" and cat["value"] == "shipping" and cat["calibrated"] is False
    assert set(cat["distribution"]) == {"billing", "shipping", "technical"}
    assert 0 < cat["confidence"] <= 1 and cat["confidence"] == cat["distribution"]["shipping"]
    assert abs(sum(cat["distribution"].values()) + cat["undecided"] - 1) < 1e-3
    assert cat["confidence"] == max(cat["distribution"].values())  # the script's choice is the top one
    assert recs["urgent"]["kind"] == "boolean" and set(recs["urgent"]["distribution"]) == {"true", "false"}
    assert (
        recs["count"]["kind"] == "integer"
        and recs["count"]["value"] == 12
        and "distribution" not in recs["count"]
    )
    assert recs["items[1].status"]["value"] == "bad"


async def test_confidence_streams_as_one_event_after_the_finish_chunk(aiohttp_client):
    client = await client_for(aiohttp_client, GrammarEngine(CONF_SCRIPT))
    chunks = await stream(
        client, {"response_format": CONF_FORMAT, "temperature": 0, "goinfer_confidence": True}
    )
    finish = next(i for i, c in enumerate(chunks) if c.get("choices") and c["choices"][0]["finish_reason"])
    conf = [i for i, c in enumerate(chunks) if "goinfer_confidence" in c]
    assert conf == [finish + 1] and set(chunks[conf[0]]) == {"id", "goinfer_confidence"}
    assert chunks[conf[0]]["id"] == chunks[0]["id"]
    assert fold_chat(chunks, False)["goinfer_confidence"] == chunks[conf[0]]["goinfer_confidence"]


async def test_a_repeated_bare_call_ends_after_the_first(aiohttp_client):
    call = '{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
    engine = GrammarEngine(call * 5)  # as Qwen2.5-Coder-0.5B does after a tool result
    client = await client_for(aiohttp_client, engine)
    _, reply = await post(client, {"tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 500})
    (got,) = reply["choices"][0]["message"]["tool_calls"]
    assert json.loads(got["function"]["arguments"]) == {"tz": "UTC"}
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    assert reply["usage"]["completion_tokens"] < len(call) + 2  # generation stopped at the first call
