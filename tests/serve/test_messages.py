"""Anthropic's Messages API on fake engines: shapes, the named-event stream, errors, tools."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sdk_models
from fake_engine import GrammarEngine, ScriptedEngine, render
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from goinfer.serve.messages import fold_message
from sse import named_events

pytestmark = pytest.mark.asyncio

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
HI = [{"role": "user", "content": "hi"}]
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-04-04"}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}  # fmt: skip
WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}


async def client_for(aiohttp_client, engine=None, **config: Any):
    engine = engine if engine is not None else ScriptedEngine(context_window=4096)
    return await aiohttp_client(create_app({"fake": engine}, ServeConfig(**{**FAST, **config})))


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "max_tokens": 64, "messages": HI, **kw}


async def events(client, payload: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    r = await client.post("/v1/messages", json={**payload, "stream": True}, headers=HEADERS)
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    return [(d["type"], sdk_models.message_event(d)) for d in named_events((await r.read()).decode())]


async def message(resp) -> dict[str, Any]:
    """A created message's body, checked against the SDK's Message."""
    assert resp.status == 200, await resp.text()
    return sdk_models.message(await resp.json())


async def test_create_has_the_message_shape(aiohttp_client):
    client = await client_for(aiohttp_client)
    r = await client.post("/v1/messages", json=body(system="be brief", metadata={"user_id": "u"},
                                                    thinking={"type": "enabled", "budget_tokens": 1024}),
                          headers=HEADERS)  # fmt: skip
    m = await message(r)
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert m["content"] == [{"type": "text", "text": "Hello world!"}]
    assert m["stop_reason"] == "end_turn" and m["stop_sequence"] is None and m["model"] == "fake"
    prompt = render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert m["usage"] == {"input_tokens": len(prompt), "output_tokens": 5, "cache_read_input_tokens": 0}


async def test_stream_event_order_and_fold(aiohttp_client):
    client = await client_for(aiohttp_client)
    evs = await events(client, body())
    kinds = [k for k, _ in evs]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[3:-3] == ["content_block_delta"] * 5
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert evs[0][1]["message"]["usage"]["input_tokens"] == len(render(HI))
    delta = {"stop_reason": "end_turn", "stop_sequence": None}
    usage = {"output_tokens": 5, "input_tokens": len(render(HI)), "cache_read_input_tokens": 0}
    assert evs[-2][1] == {"type": "message_delta", "delta": delta, "usage": usage}
    folded = fold_message(d for _, d in evs)
    whole = await message(await client.post("/v1/messages", json=body()))
    assert folded["content"] == whole["content"] and folded["usage"] == whole["usage"]


async def test_stop_sequences(aiohttp_client):
    client = await client_for(aiohttp_client)
    m = await message(await client.post("/v1/messages", json=body(stop_sequences=["wor", "zzz"])))
    assert m["content"] == [{"type": "text", "text": "Hello "}]
    assert m["stop_reason"] == "stop_sequence" and m["stop_sequence"] == "wor"
    m = await message(await client.post("/v1/messages", json=body(max_tokens=2)))
    assert m["stop_reason"] == "max_tokens"


@pytest.mark.parametrize(
    ("payload", "status", "kind", "needle"),
    [
        (body(messages=[{"role": "system", "content": "x"}, *HI]), 400, "invalid_request_error", "'system'"),
        (body(messages=[{"role": "developer", "content": "x"}]), 400, "invalid_request_error", "'developer'"),
        (body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400,
         "invalid_request_error", "vision"),
        ({"model": "fake", "messages": HI}, 400, "invalid_request_error", "max_tokens"),
        (body(model="claude-9"), 404, "not_found_error", "claude-9"),
        (body(temperature=1.5), 400, "invalid_request_error", "temperature"),
        (body(goinfer_confidence=True), 400, "invalid_request_error", "goinfer_confidence"),
    ],
)  # fmt: skip
async def test_errors_use_anthropics_envelope(aiohttp_client, payload, status, kind, needle):
    client = await client_for(aiohttp_client)
    r = await client.post("/v1/messages", json=payload)
    assert r.status == status
    err = sdk_models.anthropic_error(await r.json())
    assert set(err) == {"type", "error"} and err["type"] == "error"
    assert err["error"]["type"] == kind and needle in err["error"]["message"]


async def test_auth_takes_x_api_key_or_bearer(aiohttp_client):
    client = await client_for(aiohttp_client, api_key="sekrit")
    r = await client.post("/v1/messages", json=body())
    assert r.status == 401
    assert sdk_models.anthropic_error(await r.json())["error"]["type"] == "authentication_error"
    for headers in ({"x-api-key": "sekrit"}, {"Authorization": "Bearer sekrit"}):
        assert (await client.post("/v1/messages", json=body(), headers={**HEADERS, **headers})).status == 200


async def test_count_tokens_counts_what_create_prefills(aiohttp_client):
    client = await client_for(aiohttp_client)
    payload = {"model": "fake", "system": [{"type": "text", "text": "rules"}], "messages": HI}
    counted = sdk_models.token_count(
        await (await client.post("/v1/messages/count_tokens", json=payload)).json()
    )
    created = await message(await client.post("/v1/messages", json={**payload, "max_tokens": 8}))
    assert counted == {"input_tokens": created["usage"]["input_tokens"]}


@pytest.mark.parametrize("streamed", [False, True])
async def test_forced_tool_use_then_a_tool_result_turn(aiohttp_client, streamed):
    engine = GrammarEngine("Let me check the weather for you.")
    client = await client_for(aiohttp_client, engine)
    choice = {"type": "tool", "name": "get_weather"}
    payload = body(tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=300)
    if streamed:
        evs = await events(client, payload)
        assert any(d.get("delta", {}).get("type") == "input_json_delta" for _, d in evs)
        m = fold_message(d for _, d in evs)
    else:
        m = await message(await client.post("/v1/messages", json=payload))
    assert m["stop_reason"] == "tool_use"
    (use,) = m["content"]
    assert use["type"] == "tool_use" and use["name"] == "get_weather" and use["id"].startswith("toolu_")
    assert isinstance(use["input"]["city"], str)

    result = {"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}
    turn = [*HI, {"role": "assistant", "content": m["content"]},
            {"role": "user", "content": [result, {"type": "text", "text": "thanks"}]}]  # fmt: skip
    r = await client.post("/v1/messages", json=body(messages=turn, tools=[WEATHER], temperature=0))
    assert r.status == 200
    roles = [x["role"] for x in engine.messages]
    assert roles == ["system", "user", "assistant", "user", "user"]  # the fallback: results as a user turn
    assert engine.messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    assert engine.messages[4] == {"role": "user", "content": "thanks"}  # no mark of ours reaches a template


async def test_prose_before_a_call_is_its_own_text_block(aiohttp_client):
    script = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    client = await client_for(aiohttp_client, GrammarEngine(script))
    evs = await events(client, body(tools=[WEATHER], temperature=0, max_tokens=300))
    starts = [d["content_block"]["type"] for k, d in evs if k == "content_block_start"]
    assert starts == ["text", "tool_use"]
    m = fold_message(d for _, d in evs)
    assert m["content"][0] == {"type": "text", "text": "Checking. "}
    assert m["content"][1]["input"] == {"city": "Oslo"} and m["stop_reason"] == "tool_use"


async def test_a_system_message_inside_messages_is_folded_into_a_user_turn(aiohttp_client):
    """Claude Code sends one after the first user turn, under its beta; every chat template can
    render the fold, and the user's own words stay last."""
    engine = ScriptedEngine(context_window=4096)
    client = await client_for(aiohttp_client, engine)
    beta = {**HEADERS, "anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07"}
    parts = [{"type": "text", "text": "a"}]
    turns = [{"role": "system", "content": "first"}, *HI, {"role": "system", "content": parts},
             {"role": "assistant", "content": "ok"}, {"role": "system", "content": "late"},
             {"role": "user", "content": "go"}]  # fmt: skip
    await message(await client.post("/v1/messages", json=body(system="top", messages=turns), headers=beta))
    assert engine.messages == [
        {"role": "system", "content": "top\n\nfirst"},
        {"role": "user", "content": "a\n\nhi"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "late\n\ngo"},
    ]
    r = await client.post(
        "/v1/messages", json=body(messages=[{"role": "system", "content": "x"}]), headers=beta
    )
    assert (
        r.status == 400 and "user message" in sdk_models.anthropic_error(await r.json())["error"]["message"]
    )


async def test_newer_fields_are_accepted_and_max_tokens_is_clamped_to_the_window(aiohttp_client):
    engine = ScriptedEngine(context_window=4096)
    client = await client_for(aiohttp_client, engine)
    edits = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    extra = {"thinking": {"type": "adaptive"}, "context_management": edits,
             "output_config": {"effort": "high"}, "metadata": {}, "max_tokens": 32000}  # fmt: skip
    headers = {**HEADERS, "anthropic-beta": "claude-code-20250219,context-management-2025-06-27"}
    r = await client.post("/v1/messages?beta=true", json=body(**extra), headers=headers)
    assert (await message(r))["stop_reason"] == "end_turn"
    assert engine.requests[-1].budget(4096) == 4096 - len(render(HI))  # clamped in the runtime


async def test_output_config_format_is_structured_output_and_strict(aiohttp_client):
    engine = GrammarEngine('{"city": "Oslo"}')
    client = await client_for(aiohttp_client, engine)
    fmt = {"type": "json_schema", "schema": CITY}
    m = await message(
        await client.post("/v1/messages", json=body(output_config={"format": fmt}, temperature=0))
    )
    assert json.loads(m["content"][0]["text"]) == {"city": "Oslo"} and engine.constrained[-1]
    m = await message(await client.post("/v1/messages", json=body(output_format=fmt, temperature=0)))
    assert json.loads(m["content"][0]["text"]) == {"city": "Oslo"}
    loose = {"type": "json_schema", "schema": {**CITY, "propertyNames": {"maxLength": 4}}}
    r = await client.post("/v1/messages", json=body(output_config={"format": loose}))
    assert (
        r.status == 400 and "propertyNames" in sdk_models.anthropic_error(await r.json())["error"]["message"]
    )


async def test_the_anthropic_sdk_round_trips(aiohttp_client):
    anthropic = pytest.importorskip("anthropic")
    client = await client_for(aiohttp_client, api_key="k")
    sdk = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="k", max_retries=0)
    m = await sdk.messages.create(model="fake", max_tokens=32, messages=HI)
    assert m.content[0].text == "Hello world!" and m.usage.output_tokens == 5
    async with sdk.messages.stream(model="fake", max_tokens=32, messages=HI) as s:
        text = "".join([t async for t in s.text_stream])
    assert text == "Hello world!"
    assert (await sdk.messages.count_tokens(model="fake", messages=HI)).input_tokens == len(render(HI))
    with pytest.raises(anthropic.BadRequestError, match="'system'"):
        await sdk.messages.create(model="fake", max_tokens=8, messages=[{"role": "system", "content": "x"}])
    wrong = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="bad", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        await wrong.messages.create(model="fake", max_tokens=8, messages=HI)
    await wrong.close()
    await sdk.close()
