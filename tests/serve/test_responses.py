"""OpenAI's Responses API on fake engines: shapes, the event stream, the store, tools, the SDK."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sdk_models
from fake_engine import GrammarEngine, ScriptedEngine
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from sse import named_events

pytestmark = pytest.mark.asyncio

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY}


async def client_for(aiohttp_client, engine=None, **config: Any):
    engine = engine if engine is not None else ScriptedEngine(context_window=4096)
    return await aiohttp_client(create_app({"fake": engine}, ServeConfig(**{**FAST, **config})))


async def create(client, **kw: Any) -> dict[str, Any]:
    r = await client.post("/v1/responses", json={"model": "fake", "input": "hi", **kw})
    assert r.status == 200, await r.text()
    return sdk_models.response(await r.json())


async def stream(client, **kw: Any) -> list[dict[str, Any]]:
    r = await client.post("/v1/responses", json={"model": "fake", "input": "hi", **kw, "stream": True})
    return [sdk_models.response_event(e) for e in named_events((await r.read()).decode())]


def text_of(resp: dict[str, Any]) -> str:
    return "".join(p["text"] for o in resp["output"] if o["type"] == "message" for p in o["content"])


async def test_create_has_the_response_shape(aiohttp_client):
    client = await client_for(aiohttp_client)
    r = await create(client, instructions="be brief", metadata={"k": "v"})
    assert r["object"] == "response" and r["id"].startswith("resp_") and r["status"] == "completed"
    (msg,) = r["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["status"] == "completed"
    assert msg["content"] == [{"type": "output_text", "text": "Hello world!", "annotations": []}]
    assert r["usage"]["output_tokens"] == 5 and r["usage"]["total_tokens"] == r["usage"]["input_tokens"] + 5
    assert r["instructions"] == "be brief" and r["metadata"] == {"k": "v"} and r["incomplete_details"] is None


async def test_stream_event_order(aiohttp_client):
    client = await client_for(aiohttp_client)
    evs = await stream(client)
    kinds = [e["type"] for e in evs]
    opening = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds == [*opening, *["response.output_text.delta"] * 5, *closing, "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta") == "Hello world!"
    final = evs[-1]["response"]
    assert text_of(final) == "Hello world!" and final["id"] == evs[0]["response"]["id"]
    assert evs[-2]["item"] == final["output"][0]


async def test_max_output_tokens_is_incomplete(aiohttp_client):
    client = await client_for(aiohttp_client)
    r = await create(client, max_output_tokens=2)
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert (await stream(client, max_output_tokens=2))[-1]["type"] == "response.incomplete"


async def test_store_previous_response_id_and_retrieve(aiohttp_client):
    engine = ScriptedEngine(context_window=4096)
    client = await client_for(aiohttp_client, engine, responses_store=2)
    first = await create(client, instructions="rules")
    got = sdk_models.response(await (await client.get(f"/v1/responses/{first['id']}")).json())
    assert got == first
    await create(client, input=[{"role": "user", "content": [{"type": "input_text", "text": "more"}]}],
                 previous_response_id=first["id"])  # fmt: skip
    assert engine.messages == [  # the instructions are not carried over
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello world!"},
        {"role": "user", "content": "more"},
    ]
    r = await client.post(
        "/v1/responses", json={"model": "fake", "input": "x", "previous_response_id": "resp_nope"}
    )
    assert r.status == 404
    assert sdk_models.openai_error(await r.json())["error"]["param"] == "previous_response_id"
    unstored = await create(client, store=False)
    assert (await client.get(f"/v1/responses/{unstored['id']}")).status == 404
    await create(client)
    await create(client)  # the ring holds 2: the first is gone
    assert (await client.get(f"/v1/responses/{first['id']}")).status == 404


async def test_function_call_items_replay(aiohttp_client):
    engine = GrammarEngine("It is sunny in Oslo.")
    client = await client_for(aiohttp_client, engine)
    items = [
        {"role": "user", "content": "weather in Oslo?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear"}'},
    ]
    r = await create(client, input=items, tools=[WEATHER], temperature=0)
    assert text_of(r) == "It is sunny in Oslo."
    roles = [m["role"] for m in engine.messages]
    assert roles == ["system", "user", "assistant", "user"]  # the fallback rendering
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in engine.messages[2]["content"]


@pytest.mark.parametrize("streamed", [False, True])
async def test_forced_function_call(aiohttp_client, streamed):
    client = await client_for(aiohttp_client, GrammarEngine("no thanks"))
    kw = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0,
          "max_output_tokens": 300}  # fmt: skip
    if streamed:
        evs = await stream(client, **kw)
        kinds = [e["type"] for e in evs]
        assert (
            "response.function_call_arguments.delta" in kinds
            and "response.function_call_arguments.done" in kinds
        )
        r = evs[-1]["response"]
    else:
        r = await create(client, **kw)
    (call,) = r["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert isinstance(json.loads(call["arguments"])["city"], str)


async def test_text_format_json_schema(aiohttp_client):
    client = await client_for(aiohttp_client, GrammarEngine("not json at all"))
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = await create(client, text={"format": fmt}, temperature=0, max_output_tokens=300)
    assert set(json.loads(text_of(r))) == {"city"} and r["text"] == {"format": fmt}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"goinfer_confidence": True}, "goinfer_confidence"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
         "text.format.schema"),
    ],
)  # fmt: skip
async def test_bad_requests_are_400(aiohttp_client, body, param):
    client = await client_for(aiohttp_client, GrammarEngine())
    r = await client.post("/v1/responses", json={"model": "fake", "input": "hi", **body})
    assert r.status == 400 and sdk_models.openai_error(await r.json())["error"]["param"] == param


async def test_the_openai_sdk_round_trips(aiohttp_client):
    openai = pytest.importorskip("openai")
    client = await client_for(aiohttp_client, api_key="k")
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
    r = await sdk.responses.create(model="fake", input="hi")
    assert r.output_text == "Hello world!" and r.status == "completed" and r.usage.output_tokens == 5
    events = [e async for e in await sdk.responses.create(model="fake", input="hi", stream=True)]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    async with sdk.responses.stream(model="fake", input="hi") as s:
        final = await s.get_final_response()
    assert final.output_text == "Hello world!"
    follow = await sdk.responses.create(model="fake", input="again", previous_response_id=r.id)
    assert (await sdk.responses.retrieve(follow.id)).output_text == "Hello world!"
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.create(model="fake", input="x", previous_response_id="resp_missing")
    await sdk.close()
