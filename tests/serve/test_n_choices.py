"""OpenAI's n through the server on fake engines: every choice in the reply shape the SDKs read
(an index per choice, each with its own finish; streamed chunks tagged with their index; usage
after the last choice, the prompt counted once), each choice the reply to the same request with
n=1 and seed + i, stop strings per choice, and the limits refused before the model is reached."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sdk_models
from fake_engine import PIECES, SampledEngine, ScriptedEngine, render
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from goinfer.serve.routes import MAX_CHOICES

pytestmark = pytest.mark.asyncio

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
HELLO = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": HELLO, **kw}


async def client_for(aiohttp_client, engine) -> Any:
    return await aiohttp_client(create_app({"fake": engine}, ServeConfig(**FAST)))


async def reply(client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    return sdk_models.openai_reply(await resp.json())


async def chunks(client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200, await resp.text()
    text = (await resp.read()).decode()
    data = [b[6:] for b in (b.strip("\n") for b in text.split("\n\n")) if b.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [sdk_models.chunk(json.loads(d)) for d in data[:-1]]


async def test_chat_choices_each_equal_n1_with_seed_plus_index(aiohttp_client):
    client = await client_for(aiohttp_client, SampledEngine())
    body = await reply(client, "/v1/chat/completions", chat(n=3, seed=40, temperature=1.0))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for i, choice in enumerate(body["choices"]):
        alone = await reply(client, "/v1/chat/completions", chat(seed=40 + i, temperature=1.0))
        assert choice["message"] == alone["choices"][0]["message"], i
        assert choice["finish_reason"] == "length"
    assert len({c["message"]["content"] for c in body["choices"]}) == 3
    # the prompt once, every choice's tokens (SampledEngine: 24 each)
    prompt = len(render(HELLO))
    assert body["usage"]["prompt_tokens"] == prompt
    assert body["usage"]["completion_tokens"] == 3 * 24
    assert body["usage"]["total_tokens"] == prompt + 3 * 24


async def test_a_streamed_reply_tags_each_choice_and_ends_with_one_usage(aiohttp_client):
    client = await client_for(aiohttp_client, ScriptedEngine())
    opts = {"n": 2, "stream_options": {"include_usage": True}}
    got = await chunks(client, "/v1/chat/completions", chat(**opts))
    firsts = [c for c in got if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert [c["choices"][0]["index"] for c in firsts] == [0, 1]
    for i in (0, 1):
        mine = [c["choices"][0] for c in got if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(ch["delta"].get("content") or "" for ch in mine) == "".join(PIECES)
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["stop"]
    usages = [c["usage"] for c in got if c.get("usage")]
    assert len(usages) == 1 and got[-1]["choices"] == [] and got[-1]["usage"] == usages[0]
    prompt = len(render(HELLO))
    assert usages[0]["prompt_tokens"] == prompt and usages[0]["completion_tokens"] == 2 * len(PIECES)


async def test_completions_choices_with_a_stop_string_and_logprobs(aiohttp_client):
    client = await client_for(aiohttp_client, ScriptedEngine())
    body = {"model": "fake", "prompt": "ab", "n": 2, "stop": "ld", "logprobs": 1, "max_tokens": 10}
    whole = await reply(client, "/v1/completions", body)
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    for c in whole["choices"]:
        assert c["text"] == "Hello wor" and c["finish_reason"] == "stop"
        assert c["logprobs"]["tokens"] == ["Hel", "lo", " wor"]  # "ld" begins the stop string
        assert c["logprobs"]["text_offset"] == [0, 3, 5]  # each choice's own offsets
    streamed = await chunks(client, "/v1/completions", body)
    for i in (0, 1):
        mine = [c["choices"][0] for c in streamed if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(ch["text"] for ch in mine) == "Hello wor"


async def test_n_limits_are_refused_before_the_model(aiohttp_client):
    engine = ScriptedEngine()
    client = await client_for(aiohttp_client, engine)
    for body, param in [
        (chat(n=MAX_CHOICES + 1), "n"),
        (chat(n=0), "n"),
        (chat(n=2, goinfer_confidence=True), "goinfer_confidence"),
    ]:
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 400, await resp.text()
        err = sdk_models.openai_error(await resp.json())["error"]
        assert err["param"] == param, err
    assert not engine.started.is_set()
