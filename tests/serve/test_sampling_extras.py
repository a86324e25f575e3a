"""logit_bias, repetition_penalty and echo (issue 37 part 3) through the server, on GrammarEngine:
a fake model over a real tokenizer and the real decode loop (runtime.decode.sample_tokens), so the
bias, the penalty and the grammar mask act exactly as on a bundle."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_engine import GrammarEngine
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig

pytestmark = pytest.mark.asyncio

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
HELLO = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


async def client_for(aiohttp_client, engine: GrammarEngine):
    return await aiohttp_client(create_app({"fake": engine}, ServeConfig(**FAST)))


async def post(client, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    base = {"model": "fake", **({"messages": HELLO} if path == CHAT else {"prompt": "hi"})}
    r = await client.post(path, json={**base, **body})
    return r.status, await r.json()


def text(reply: dict[str, Any]) -> str:
    c = reply["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


def tid(engine: GrammarEngine, s: str) -> int:
    return engine.tok.token_to_id({" ": "Ġ"}.get(s, s))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_greedy_plus_100_picks_the_token_and_minus_100_never(aiohttp_client, path):
    engine = GrammarEngine("Hello!")
    client = await client_for(aiohttp_client, engine)
    x = tid(engine, "x")
    status, reply = await post(client, path, {"temperature": 0, "max_tokens": 5, "logit_bias": {str(x): 100}})
    assert status == 200, reply
    assert text(reply) == "xxxxx"
    base = {"temperature": 0, "max_tokens": 6}
    _, plain = await post(client, path, base)
    assert text(plain) == "Hello!"
    h = tid(engine, "H")
    _, banned = await post(client, path, {**base, "logit_bias": {str(h): -100}})
    assert "H" not in text(banned)
    for seed in range(5):  # sampled too
        body = {"temperature": 1.0, "seed": seed, "max_tokens": 6, "logit_bias": {str(h): -100}}
        assert "H" not in text((await post(client, path, body))[1])


async def test_a_bias_never_allows_what_the_grammar_forbids(aiohttp_client):
    engine = GrammarEngine("Hello!")
    client = await client_for(aiohttp_client, engine)
    fmt = {"type": "json_object"}
    bias = {str(tid(engine, "x")): 100, str(tid(engine, "H")): 100}
    status, reply = await post(
        client, CHAT, {"temperature": 0, "max_tokens": 30, "response_format": fmt, "logit_bias": bias}
    )
    assert status == 200, reply
    out = text(reply)
    assert out.startswith("{") and "x" not in out.split('"')[0]  # the grammar's '{' first, not the +100 'x'


async def test_without_the_fields_the_reply_is_exactly_the_old_one(aiohttp_client):
    engine = GrammarEngine("Hello there, this is a test.", noise=3.0)
    client = await client_for(aiohttp_client, engine)
    for path in (CHAT, COMPLETIONS):
        for seed in range(3):
            body = {"temperature": 0.9, "seed": seed, "max_tokens": 20}
            _, a = await post(client, path, body)
            _, b = await post(client, path, {**body, "logit_bias": {}, "repetition_penalty": 1.0})
            assert text(a) == text(b)
    p = engine.params[-1]
    assert p.logit_bias == () and p.repetition_penalty == 1.0


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_repetition_penalty_acts_and_reaches_the_sampler(aiohttp_client, path):
    engine = GrammarEngine("aaaaaaaa", noise=1.0)
    client = await client_for(aiohttp_client, engine)
    base = {"temperature": 0, "max_tokens": 8}
    _, plain = await post(client, path, base)
    assert text(plain) == "aaaaaaaa"
    status, pen = await post(client, path, {**base, "repetition_penalty": 50.0})
    assert status == 200, pen
    assert engine.params[-1].repetition_penalty == 50.0
    assert text(pen).startswith("a") and not text(pen).startswith(
        "aa"
    )  # once seen, 20 / 50 loses to the noise


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logit_bias": {"5": 100.5}}, "logit_bias.5"),
        ({"logit_bias": {"5": -101}}, "logit_bias.5"),
        ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
        ({"logit_bias": {"-3": 1}}, "logit_bias.-3"),
        ({"logit_bias": {"99999": 1}}, "logit_bias.99999"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.5}, "repetition_penalty"),
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_out_of_range_is_a_400_naming_the_key(aiohttp_client, path, body, param):
    client = await client_for(aiohttp_client, GrammarEngine())
    status, reply = await post(client, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param
    if param.startswith("logit_bias."):
        assert repr(param.split(".", 1)[1]) in reply["error"]["message"]


async def test_three_hundred_entries_pass_the_count_limit(aiohttp_client):
    engine = GrammarEngine()
    client = await client_for(aiohttp_client, engine)
    vocab = engine.info.vocab_size
    status, _ = await post(client, CHAT, {"logit_bias": {str(i): 0.5 for i in range(vocab)}, "max_tokens": 2})
    assert status == 200
    # (the fake's vocabulary is under 300: the 300th entry is refused for its id, not the count)
    status, reply = await post(client, CHAT, {"logit_bias": {str(i): 0.5 for i in range(300)}})
    assert status == 400 and reply["error"]["param"] == f"logit_bias.{vocab}"


async def test_echo_prepends_the_prompt(aiohttp_client):
    engine = GrammarEngine("Hello!")
    client = await client_for(aiohttp_client, engine)
    body = {"prompt": "Say hi: ", "temperature": 0, "max_tokens": 6}
    _, plain = await post(client, COMPLETIONS, body)
    status, echoed = await post(client, COMPLETIONS, {**body, "echo": True})
    assert status == 200, echoed
    assert text(echoed) == "Say hi: " + text(plain) == "Say hi: Hello!"
    assert echoed["usage"] == plain["usage"]  # the prompt is not completion tokens
    # token ids: their texts
    ids = engine.tok.encode("Say hi: ").ids
    _, by_ids = await post(client, COMPLETIONS, {**body, "prompt": ids, "echo": True})
    assert text(by_ids) == "Say hi: Hello!"


async def test_echo_streams_the_prompt_first(aiohttp_client):
    client = await client_for(aiohttp_client, GrammarEngine("Hello!"))
    body = {
        "model": "fake",
        "prompt": "Say hi: ",
        "temperature": 0,
        "max_tokens": 6,
        "echo": True,
        "stream": True,
    }
    r = await client.post(COMPLETIONS, json=body)
    assert r.status == 200
    events = [e[len("data: ") :] for e in (await r.read()).decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c.get("choices")]
    assert texts[0] == "Say hi: " and "".join(texts) == "Say hi: Hello!"


async def test_echo_with_logprobs_is_refused(aiohttp_client):
    client = await client_for(aiohttp_client, GrammarEngine())
    status, reply = await post(client, COMPLETIONS, {"echo": True, "logprobs": 2})
    assert status == 422 and reply["error"]["param"] == "echo"
