"""The HTTP server through pytest-aiohttp, on fake engines: every edge a client can hit."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
import sdk_models
from fake_engine import PIECES, SampledEngine, ScriptedEngine, render
from goinfer.serve.app import create_app
from goinfer.serve.config import SamplingDefaults, ServeConfig
from goinfer.serve.events import fold_chat, fold_completion

pytestmark = pytest.mark.asyncio

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
HELLO = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": HELLO, **kw}


async def client_for(aiohttp_client, engines: dict | None = None, loader=None, **config: Any):
    engines = engines if engines is not None else {"fake": ScriptedEngine()}
    return await aiohttp_client(create_app(engines, ServeConfig(**{**FAST, **config}), loader=loader))


def assert_envelope(body: dict[str, Any], param: str | None = None, code: str | None = None) -> str:
    assert set(body) == {"error"}, body
    sdk_models.openai_error(body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert "Traceback" not in err["message"] and ".py" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err["message"]


async def sse_events(resp) -> list[str]:
    """The `data:` payloads of an SSE response, in order (keep-alive comments dropped)."""
    text = (await resp.read()).decode()
    blocks = (b.strip("\n") for b in text.split("\n\n"))
    return [b[6:] for b in blocks if b.startswith("data: ")]


async def stream_chunks(resp) -> list[dict[str, Any]]:
    events = await sse_events(resp)
    assert events[-1] == "[DONE]", events[-1:]
    return [sdk_models.chunk(json.loads(e)) for e in events[:-1]]


async def checked_reply(resp) -> dict[str, Any]:
    """A generation's JSON reply, checked against the SDK's type for its object."""
    assert resp.status == 200, await resp.text()
    return sdk_models.openai_reply(await resp.json())


def content_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


# -- bad input ------------------------------------------------------------------------------
LONG = [{"role": "user", "content": "x" * 80}]  # 80 characters: 80 tokens in the fake, window 64

BAD = [
    # (case, route, raw body or JSON, status, param, code)
    ("malformed JSON", "chat", b'{"model": "fake", "messages": [', 400, None, "invalid_json"),
    ("missing body", "chat", b"", 400, None, "missing_body"),
    ("not an object", "chat", b"[1, 2]", 400, None, "invalid_json"),
    ("messages not a list", "chat", {"model": "fake", "messages": "hi"}, 400, "messages", None),
    ("no messages", "chat", {"model": "fake", "messages": []}, 400, "messages", None),
    ("temperature as string", "chat", chat(temperature="hot"), 400, "temperature", None),
    ("max_tokens as float", "chat", chat(max_tokens=1.5), 400, "max_tokens", None),
    ("stream as string", "chat", chat(stream="yes"), 400, "stream", None),
    ("content as number", "chat", {"model": "fake", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content", None),
    ("unknown role", "chat", {"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role", None),
    ("negative max_tokens", "chat", chat(max_tokens=-5), 400, "max_tokens", None),
    ("zero max_tokens", "chat", chat(max_tokens=0), 400, "max_tokens", None),
    ("temperature over 2", "chat", chat(temperature=3.0), 400, "temperature", None),
    ("negative temperature", "chat", chat(temperature=-0.1), 400, "temperature", None),
    ("top_p over 1", "chat", chat(top_p=1.5), 400, "top_p", None),
    ("penalty out of range", "chat", chat(presence_penalty=2.5), 400, "presence_penalty", None),
    ("five stop strings", "chat", chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    ("n over its limit", "chat", chat(n=17), 400, "n", None),
    ("top_logprobs without logprobs", "chat", chat(top_logprobs=2), 400, "top_logprobs", None),
    ("image part", "chat", {"model": "fake", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "messages.0.content.0.type", None),
    ("user without content", "chat", {"model": "fake", "messages": [{"role": "user"}]}, 400,
     "messages.0.content", None),
    ("unknown model", "chat", {"model": "gpt-9", "messages": HELLO}, 404, "model", "model_not_found"),
    ("over-context prompt", "chat", {"model": "fake", "messages": LONG}, 400, "messages",
     "context_length_exceeded"),
    ("tools, engine without grammar", "chat", chat(tools=[{"type": "function", "function": {"name": "f"}}]),
     422, "tools", "unsupported_parameter"),
    ("json response_format, engine without grammar", "chat", chat(response_format={"type": "json_object"}),
     422, "response_format", "unsupported_parameter"),
    ("completions: no prompt", "completions", {"model": "fake"}, 400, "prompt", None),
    ("completions: two prompts", "completions", {"model": "fake", "prompt": ["a", "b"]}, 400, "prompt", None),
    ("completions: token id out of vocab", "completions", {"model": "fake", "prompt": [1, 5000]}, 400,
     "prompt", None),
    ("completions: over-context prompt", "completions", {"model": "fake", "prompt": "y" * 100}, 400,
     "prompt", "context_length_exceeded"),
    ("completions: echo+logprobs", "completions",
     {"model": "fake", "prompt": "a", "echo": True, "logprobs": 1}, 422, "echo", None),
]  # fmt: skip


@pytest.mark.parametrize(("case", "route", "body", "status", "param", "code"), BAD, ids=[b[0] for b in BAD])
async def test_bad_input_gets_the_right_status_and_envelope(
    aiohttp_client, case, route, body, status, param, code
):
    engine = ScriptedEngine()
    client = await client_for(aiohttp_client, {"fake": engine})
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}[route]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    assert resp.status == status, (case, await resp.text())
    assert resp.content_type == "application/json"
    assert_envelope(await resp.json(), param, code)
    assert not engine.started.is_set(), "a refused request must never reach the model"


async def test_over_context_message_names_the_limit(aiohttp_client):
    client = await client_for(aiohttp_client)
    resp = await client.post("/v1/chat/completions", json={"model": "fake", "messages": LONG})
    message = assert_envelope(await resp.json())
    assert "context window of 64 tokens" in message and f"is {len(render(LONG))} tokens" in message


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_a_budget_past_the_window_is_clamped_to_it(aiohttp_client, field):
    """As llama.cpp: no 400 for max_tokens over the window; the reply stops at it with "length"."""
    engine = ScriptedEngine()
    client = await client_for(aiohttp_client, {"fake": engine})
    user = "u" * (64 - len(render([{"role": "user", "content": ""}])) - 3)  # leaves room for 3 tokens
    reply = await checked_reply(await client.post("/v1/chat/completions", json=chat(
        messages=[{"role": "user", "content": user}], **{field: 10**9})))  # fmt: skip
    assert engine.requests[-1].budget(64) == 3  # clamped once, in the runtime
    assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 3
    completion = {"model": "fake", "prompt": "y" * 62, "max_tokens": 10**6}
    reply = await checked_reply(await client.post("/v1/completions", json=completion))
    assert engine.requests[-1].budget(64) == 2 and reply["choices"][0]["finish_reason"] == "length"


async def test_sampling_defaults_fill_only_what_a_request_leaves_out(aiohttp_client):
    """serve --temp/--top-p/--top-k/--min-p, as llama-server's: a harness that sends no sampling
    settings (Claude Code) gets them; a request's own values, zero included, win."""
    engine = ScriptedEngine()
    defaults = SamplingDefaults(temperature=0.2, top_p=0.8, top_k=20, min_p=0.05)
    client = await client_for(aiohttp_client, {"fake": engine}, sampling=defaults)
    await checked_reply(await client.post("/v1/chat/completions", json=chat()))
    p = engine.params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.2, 0.8, 20, 0.05)
    await checked_reply(
        await client.post("/v1/chat/completions", json=chat(temperature=0.7, top_k=0, min_p=0))
    )
    p = engine.params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.8, 0, 0.0)
    engine = ScriptedEngine()
    client = await client_for(aiohttp_client, {"fake": engine})
    await checked_reply(await client.post("/v1/chat/completions", json=chat()))
    p = engine.params[-1]  # without flags: the APIs' defaults
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)


async def test_body_over_the_cap_is_413_before_reading(aiohttp_client):
    engine = ScriptedEngine()
    client = await client_for(aiohttp_client, {"fake": engine}, max_body_bytes=1024)
    big = json.dumps(chat(user="u" * 2000)).encode()
    resp = await client.post("/v1/chat/completions", data=big, headers={"Content-Type": "application/json"})
    assert resp.status == 413
    assert "1024-byte cap" in assert_envelope(await resp.json(), code="body_too_large")

    async def chunked():  # no Content-Length: the cap is enforced while reading
        for _ in range(4):
            yield b" " * 512

    resp = await client.post("/v1/chat/completions", data=chunked())
    assert resp.status == 413
    assert_envelope(await resp.json(), code="body_too_large")
    assert not engine.started.is_set()
    ok = await client.post("/v1/chat/completions", json=chat(max_tokens=2))
    assert ok.status == 200


async def test_unknown_route_and_method_use_the_envelope(aiohttp_client):
    client = await client_for(aiohttp_client)
    resp = await client.get("/v1/nothing")
    assert resp.status == 404
    assert "/v1/nothing" in assert_envelope(await resp.json())
    resp = await client.get("/v1/chat/completions")
    assert resp.status == 405
    assert_envelope(await resp.json())
    resp = await client.post("/admin/models/load", json={"path": "x.giw"})  # admin is off by default
    assert resp.status == 404


async def test_engine_failure_never_leaks_a_traceback(aiohttp_client):
    client = await client_for(aiohttp_client, {"fake": ScriptedEngine(fail=True)})
    resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status == 500
    assert_envelope(await resp.json())  # checks for "Traceback" and ".py"
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert resp.status == 200  # the stream had started: the error comes as an event
    events = await sse_events(resp)
    assert_envelope(json.loads(events[-1]))


async def test_chat_template_refusal_is_422(aiohttp_client):
    engine = ScriptedEngine()

    def refuse(messages):
        raise ValueError("chat template failed: Conversation roles must alternate user/assistant")

    engine.chat_ids = refuse
    client = await client_for(aiohttp_client, {"fake": engine})
    resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status == 422
    assert "alternate" in assert_envelope(await resp.json(), param="messages", code="chat_template_error")


# -- auth -------------------------------------------------------------------------------------
async def test_every_route_needs_the_key(aiohttp_client):
    client = await client_for(aiohttp_client, api_key="sekret")
    for method, path, body in [
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", chat()),
        ("POST", "/v1/completions", {"model": "fake", "prompt": "a"}),
        ("GET", "/v1/nothing", None),
    ]:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"x-api-key": "wrong"},
            {"Authorization": "sekret"},
        ):
            resp = await client.request(method, path, json=body, headers=headers)
            assert resp.status == 401, (path, headers)
            assert_envelope(await resp.json(), code="invalid_api_key")
    for headers in ({"Authorization": "Bearer sekret"}, {"x-api-key": "sekret"}):
        assert (await client.get("/health", headers=headers)).status == 200
        resp = await client.post("/v1/chat/completions", json=chat(), headers=headers)
        assert resp.status == 200


# -- replies ----------------------------------------------------------------------------------
async def test_chat_reply_shape_and_exact_usage(aiohttp_client):
    client = await client_for(aiohttp_client)
    resp = await client.post("/v1/chat/completions", json=chat(temperature=0))
    assert resp.status == 200
    body = await checked_reply(resp)
    assert (
        body["object"] == "chat.completion" and body["model"] == "fake" and body["id"].startswith("chatcmpl-")
    )
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello world!", "refusal": None}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    prompt_tokens = len(render(HELLO))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(PIECES),
        "total_tokens": prompt_tokens + len(PIECES),
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_max_tokens_and_max_completion_tokens_cut_with_length(aiohttp_client):
    engine = ScriptedEngine()
    client = await client_for(aiohttp_client, {"fake": engine})
    body = await checked_reply(await client.post("/v1/chat/completions", json=chat(max_tokens=2)))
    assert body["choices"][0]["message"]["content"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 2
    # max_completion_tokens (the newer name) wins over max_tokens
    body = await checked_reply(
        await client.post("/v1/chat/completions", json=chat(max_tokens=4, max_completion_tokens=3))
    )
    assert body["choices"][0]["message"]["content"] == "Hello wor"
    # left out: the rest of the context window
    await client.post("/v1/chat/completions", json=chat())
    assert engine.params[-1].max_tokens is None  # the runtime gives the reply what the window leaves
    assert engine.requests[-1].budget(64) == 64 - len(render(HELLO))


async def test_sampling_fields_reach_the_sampler(aiohttp_client):
    engine = ScriptedEngine()
    client = await client_for(aiohttp_client, {"fake": engine})
    knobs = dict(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=11, frequency_penalty=0.5,
                 presence_penalty=-0.5)  # fmt: skip
    assert (await client.post("/v1/chat/completions", json=chat(**knobs))).status == 200
    p = engine.params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 5, 0.05, 11)
    assert (p.frequency_penalty, p.presence_penalty) == (0.5, -0.5)
    await client.post("/v1/chat/completions", json=chat())
    assert engine.params[-1].temperature == 1.0 and engine.params[-1].top_p == 1.0  # OpenAI's defaults


@pytest.mark.parametrize(
    ("stop", "content", "completion_tokens"),
    [
        ("o wo", "Hell", 3),  # spans "Hel|lo| wor": matched across three tokens
        (["zzz", "ld!"], "Hello wor", 5),
        ("Hel", "", 1),
        ("!!", "Hello world!", 5),  # a held-back prefix that never completes is released at the end
        (["xyz"], "Hello world!", 5),
    ],
)
async def test_stop_strings_match_across_tokens_and_are_never_sent(
    aiohttp_client, stop, content, completion_tokens
):
    client = await client_for(aiohttp_client)
    body = await checked_reply(await client.post("/v1/chat/completions", json=chat(stop=stop)))
    assert body["choices"][0]["message"]["content"] == content
    assert body["usage"]["completion_tokens"] == completion_tokens
    assert body["choices"][0]["finish_reason"] == "stop"
    chunks = await stream_chunks(await client.post("/v1/chat/completions", json=chat(stop=stop, stream=True)))
    assert content_of(chunks) == content
    stops = [stop] if isinstance(stop, str) else stop
    assert not any(
        s in c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"] for s in stops
    )


async def test_stream_chunk_shape_ends_with_done(aiohttp_client):
    client = await client_for(aiohttp_client)
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    chunks = await stream_chunks(resp)
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake" for c in chunks)
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]] == list(PIECES)
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}


async def test_include_usage_adds_a_last_usage_chunk(aiohttp_client):
    client = await client_for(aiohttp_client)
    opts = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = await stream_chunks(await client.post("/v1/chat/completions", json=chat(**opts)))
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    n = len(render(HELLO))
    cached = {"prompt_tokens_details": {"cached_tokens": 0}}
    assert chunks[-1]["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": 5,
        "total_tokens": n + 5,
        **cached,
    }
    chunks = await stream_chunks(
        await client.post("/v1/completions", json={"model": "fake", "prompt": "ab", **opts})
    )
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7, **cached}


@pytest.mark.parametrize("stop", [None, "o wo"])
async def test_non_stream_reply_is_the_folded_stream(aiohttp_client, stop):
    client = await client_for(aiohttp_client)
    req = chat(logprobs=True, top_logprobs=2, stop=stop)
    whole = await checked_reply(await client.post("/v1/chat/completions", json=req))
    opts = {"stream": True, "stream_options": {"include_usage": True}}
    folded = fold_chat(
        await stream_chunks(await client.post("/v1/chat/completions", json={**req, **opts})), True
    )
    for reply in (whole, folded):
        reply.pop("id"), reply.pop("created")
    assert whole == folded
    lps = whole["choices"][0]["logprobs"]["content"]
    kept = 5 if stop is None else 2  # "Hel", "lo": tokens whose text starts before the stop string
    assert [e["token"] for e in lps] == list(PIECES[:kept])
    assert [e["logprob"] for e in lps] == [-0.25 * (i + 1) for i in range(kept)]
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in lps)

    req = {"model": "fake", "prompt": "ab", "logprobs": 1, "stop": stop}
    whole = await checked_reply(await client.post("/v1/completions", json=req))
    streamed = await stream_chunks(await client.post("/v1/completions", json={**req, **opts}))
    folded = fold_completion(streamed, True)
    for reply in (whole, folded):
        reply.pop("id"), reply.pop("created")
    assert whole == folded
    lp = whole["choices"][0]["logprobs"]
    assert lp["tokens"] == list(PIECES[:kept]) and lp["text_offset"] == [0, 3, 5, 9, 11][:kept]


async def test_completions_take_text_or_token_ids(aiohttp_client):
    client = await client_for(aiohttp_client)
    body = await checked_reply(await client.post("/v1/completions", json={"model": "fake", "prompt": "abc"}))
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello world!"
    assert body["usage"]["prompt_tokens"] == 3
    body = await checked_reply(
        await client.post("/v1/completions", json={"model": "fake", "prompt": [[5, 6, 7, 8]]})
    )
    assert body["usage"]["prompt_tokens"] == 4
    body = await checked_reply(await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1}))
    assert body["choices"][0]["text"] == "Hel"  # a lone model serves a request that names none


async def test_chat_messages_roles_parts_and_developer(aiohttp_client):
    engine = ScriptedEngine(context_window=512)
    client = await client_for(aiohttp_client, {"fake": engine})
    messages = [
        {"role": "system", "content": "old rules"},
        {"role": "developer", "content": "new rules"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        },
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert (
        await client.post("/v1/chat/completions", json={"model": "fake", "messages": messages})
    ).status == 200
    assert engine.messages == [
        {"role": "system", "content": "new rules"},  # developer is system; the last system wins
        {"role": "user", "content": "part one\npart two"},
        # the fake template renders no tools: calls and results replay as Hermes text (the fallback)
        {"role": "assistant", "content": '\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n42\n</tool_response>"},
    ]


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


async def test_a_seed_reproduces_through_the_server(aiohttp_client):
    client = await client_for(aiohttp_client, {"fake": SampledEngine()})

    async def reply(**kw):
        body = await checked_reply(
            await client.post("/v1/chat/completions", json=chat(temperature=1.0, **kw))
        )
        return body["choices"][0]["message"]["content"]

    a, b = await reply(seed=5), await reply(seed=5)
    assert a == b and len(a.split()) == 24
    assert await reply(seed=6) != a
    assert await reply(seed=5, top_k=8) == await reply(seed=5, top_k=8)


async def test_models_and_health(aiohttp_client):
    client = await client_for(aiohttp_client, {"a": ScriptedEngine(context_window=99), "b": ScriptedEngine()})
    body = sdk_models.models(await (await client.get("/v1/models")).json())
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["a", "b"]
    first = body["data"][0]
    assert first["context_window"] == 99 and first["vision"] is False
    assert first["decode_path"] == "fake decode" and first["prefill_path"] == "fake prefill"
    health = await (await client.get("/health")).json()
    assert health["status"] == "ok" and set(health["models"]) == {"a", "b"}
    resp = await client.post("/v1/chat/completions", json={"messages": HELLO})  # two models: must name one
    assert resp.status == 400
    assert_envelope(await resp.json(), param="model")


# -- queueing, parallelism, keep-alive, cancellation -----------------------------------------------
async def _until(predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "timed out waiting"
        await asyncio.sleep(0.01)


async def test_a_full_queue_is_429_and_the_rest_succeed(aiohttp_client):
    gate = threading.Event()
    engine = ScriptedEngine(gate=gate)
    client = await client_for(
        aiohttp_client, {"fake": engine}, max_queue=2, max_concurrent=1, retry_after_s=3
    )
    tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=chat())) for _ in range(6)]
    await _until(lambda: sum(t.done() for t in tasks) == 3)  # 1 running + 2 queued; 3 refused at once
    refused = [t.result() for t in tasks if t.done()]
    for resp in refused:
        assert resp.status == 429 and resp.headers["Retry-After"] == "3"
        assert_envelope(await resp.json(), code="queue_full")
    pending = [t for t in tasks if not t.done()]
    gate.set()
    admitted = [await t for t in pending]
    assert len(admitted) == 3
    for resp in admitted:
        assert resp.status == 200
        assert (await checked_reply(resp))["choices"][0]["message"]["content"] == "Hello world!"


async def test_a_prompt_the_kv_cache_cannot_hold_is_a_503_with_the_reason(aiohttp_client):
    from goinfer.runtime.scheduler import KVCacheFull

    class FullEngine(ScriptedEngine):
        def generate(self, *args, **kwargs):
            raise KVCacheFull("the KV cache (64 tokens) has no room for a 90-token prompt")
            yield  # a generator, as the real one

    client = await client_for(aiohttp_client, {"fake": FullEngine()})
    resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert "no room for a 90-token prompt" in assert_envelope(await resp.json(), code="kv_cache_full")


async def test_max_concurrent_generations_run_at_once_and_the_rest_queue_in_order(aiohttp_client):
    gate = threading.Event()
    engine = ScriptedEngine(gate=gate)
    client = await client_for(aiohttp_client, {"fake": engine}, max_queue=1, max_concurrent=2)
    tasks = []
    for i in range(4):
        body = chat(messages=[{"role": "user", "content": f"q{i}"}])
        tasks.append(asyncio.create_task(client.post("/v1/chat/completions", json=body)))
        await asyncio.sleep(0.05)  # arrival order
    await _until(lambda: sum(t.done() for t in tasks) == 1)  # 2 running + 1 queued; the 4th refused
    assert tasks[3].done() and tasks[3].result().status == 429
    await _until(lambda: len(engine.params) == 2)
    assert not tasks[2].done() and len(engine.params) == 2  # the third waits for a free slot
    gate.set()
    for t in tasks[:3]:
        assert (await t).status == 200
    started = ["".join(map(chr, ids)) for ids in engine.prompts]
    assert {p[-len("q0<assistant>") :][:2] for p in started[:2]} == {"q0", "q1"}
    assert "q2" in started[2]  # first come, first served


async def test_distinct_models_run_in_parallel(aiohttp_client):
    gate = threading.Event()
    slow, fast = ScriptedEngine(gate=gate), ScriptedEngine()
    client = await client_for(aiohttp_client, {"slow": slow, "fast": fast})
    held = asyncio.create_task(client.post("/v1/chat/completions", json=chat(model="slow")))
    await _until(slow.started.is_set)
    resp = await client.post("/v1/chat/completions", json=chat(model="fast"))
    assert resp.status == 200 and not held.done()  # fast answered while slow is still in prefill
    gate.set()
    assert (await held).status == 200


async def test_keep_alives_flow_during_a_long_prefill(aiohttp_client):
    gate = threading.Event()
    client = await client_for(aiohttp_client, {"fake": ScriptedEngine(gate=gate)})
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert resp.status == 200  # headers are sent before the first token
    seen = b""
    while b"data:" not in seen or seen.count(b": keep-alive") < 2:
        seen += await resp.content.readline()
        if seen.count(b": keep-alive") >= 2:
            break
    gate.set()
    rest = await stream_chunks(resp)
    assert content_of(rest) == "Hello world!"


async def test_a_client_that_leaves_cancels_its_generation(aiohttp_client):
    engine = ScriptedEngine(pieces=[f"t{i} " for i in range(400)], context_window=4096, step_s=0.005)
    client = await client_for(aiohttp_client, {"fake": engine})
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    await resp.content.readline()
    resp.close()  # hang up mid-stream
    await _until(engine.finished.is_set)
    assert engine.yielded < 400

    engine2 = ScriptedEngine(pieces=[f"t{i} " for i in range(400)], context_window=4096, step_s=0.005)
    client = await client_for(aiohttp_client, {"fake": engine2})
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(client.post("/v1/chat/completions", json=chat()), 0.2)  # a non-stream caller
    await _until(engine2.finished.is_set)
    assert engine2.yielded < 400


# -- admin ------------------------------------------------------------------------------------------
async def test_admin_load_and_unload(aiohttp_client):
    loaded: dict[str, ScriptedEngine] = {}

    def loader(name: str, path: str, quant: str | None) -> ScriptedEngine:
        if not path.endswith(".giw"):
            raise FileNotFoundError(f"no such bundle: {path}")
        loaded[name] = ScriptedEngine()
        return loaded[name]

    gate = threading.Event()
    busy = ScriptedEngine(gate=gate)
    client = await client_for(
        aiohttp_client, {"busy": busy}, loader=loader, allow_admin=True, unload_drain_wait_s=0.1
    )
    resp = await client.post("/admin/models/load", json={"path": "/m/extra.giw", "name": "extra"})
    assert resp.status == 200 and sdk_models.model((await resp.json())["loaded"])["id"] == "extra"
    assert (await client.post("/v1/chat/completions", json=chat(model="extra"))).status == 200
    resp = await client.post("/admin/models/load", json={"path": "/m/extra.giw", "name": "extra"})
    assert resp.status == 400
    resp = await client.post("/admin/models/load", json={"path": "/m/missing.gguf"})
    assert resp.status == 400
    assert "no such bundle" in assert_envelope(await resp.json(), param="path", code="load_failed")

    # idle: freed within the drain wait -> 200
    resp = await client.post("/admin/models/unload", json={"name": "extra"})
    assert resp.status == 200 and (await resp.json())["freed"] is True and loaded["extra"].closed
    assert (await client.post("/v1/chat/completions", json=chat(model="extra"))).status == 404

    # busy: unroutable at once, freed only after its in-flight request -> 202
    held = asyncio.create_task(client.post("/v1/chat/completions", json=chat(model="busy")))
    await _until(busy.started.is_set)
    resp = await client.post("/admin/models/unload", json={"name": "busy"})
    assert resp.status == 202 and (await resp.json())["freed"] is False
    assert (await client.post("/v1/chat/completions", json=chat(model="busy"))).status == 404
    assert not busy.closed
    gate.set()
    assert (await held).status == 200  # the in-flight request still finishes
    await _until(lambda: busy.closed)
    resp = await client.post("/admin/models/unload", json={"name": "busy"})
    assert resp.status == 404
