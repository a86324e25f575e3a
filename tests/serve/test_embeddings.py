"""POST /v1/embeddings on fake encoders (tests/fake_engine.py's FakeEncoder: real vectors, a hashed
bag of tokens): every input shape and option, the refusals, the encoder's own queue and its
batching across requests, serving beside a decoder, the openai SDK, and `goinfer embed`."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import threading
from typing import Any

import numpy as np
import pytest
import sdk_models
from fake_engine import NOMIC_PROMPTS, FakeEncoder, ScoringEngine, ScriptedEngine
from goinfer.serve import server
from goinfer.serve.app import create_app
from goinfer.serve.config import EMBEDDINGS_CAP, EmbeddingsConfig, MiB, ServeConfig
from goinfer.serve.keys import CAPS, REGISTRY
from openai.types import CreateEmbeddingResponse

pytestmark = pytest.mark.asyncio

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
HELLO = [{"role": "user", "content": "hi"}]


def app_for(encoders: dict | None = None, engines: dict | None = None, **config: Any):
    encoders = encoders if encoders is not None else {"enc": FakeEncoder()}
    return create_app(engines or {}, ServeConfig(**{**FAST, **config}), encoders=encoders)


async def client_for(aiohttp_client, encoders: dict | None = None, engines: dict | None = None, **config):
    return await aiohttp_client(app_for(encoders, engines, **config))


async def embed(client, **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/embeddings", json=body)
    assert resp.status == 200, await resp.text()
    data = await resp.json()
    # the SDK's own type, checked (it decodes base64 vectors before it builds one)
    decoded = [{**d, "embedding": _floats(d["embedding"])} for d in data["data"]]
    CreateEmbeddingResponse.model_validate({**data, "data": decoded}, strict=True)
    assert data["object"] == "list" and [d["index"] for d in data["data"]] == list(range(len(data["data"])))
    assert resp.headers["X-Goinfer-Embedding-Task"] == data["goinfer_task"]["name"]
    return data


async def refused(
    client, body: Any, status: int = 400, param: str | None = None, route: str = "/v1/embeddings"
):
    resp = await (client.post(route, data=body) if isinstance(body, bytes) else client.post(route, json=body))
    assert resp.status == status, (body if not isinstance(body, bytes) else body[:80], await resp.text())
    err = sdk_models.openai_error(await resp.json())["error"]
    if param is not None:  # the field, or a place inside it ("input.0")
        assert (err["param"] or "").split(".")[0] == param, err
    assert "Traceback" not in err["message"] and ".py" not in err["message"]
    return err


def _floats(embedding: list[float] | str) -> list[float]:
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), "<f4").tolist()
    return embedding


def vectors(reply: dict[str, Any]) -> np.ndarray:
    return np.array([d["embedding"] for d in reply["data"]], np.float32)


# -- the request ---------------------------------------------------------------------------------------
async def test_every_input_shape(aiohttp_client):
    enc = FakeEncoder()
    client = await client_for(aiohttp_client, {"enc": enc})
    one = await embed(client, model="enc", input="hello")
    assert one["model"] == "enc" and len(one["data"]) == 1
    np.testing.assert_array_equal(vectors(one)[0], enc.vector(enc.tokenize("hello")))
    assert one["usage"] == {"prompt_tokens": 7, "total_tokens": 7}  # [CLS] h e l l o [SEP]
    assert one["goinfer_task"] == {"name": "none", "prompt": ""} and "goinfer_truncated" not in one

    many = await embed(client, input=["a", "bb", "hello"])  # one encoder: `model` may be left out
    want = np.stack([enc.vector(enc.tokenize(t)) for t in ("a", "bb", "hello")])
    np.testing.assert_array_equal(vectors(many), want)
    assert many["usage"]["prompt_tokens"] == 3 + 4 + 7

    ids = [1, 40, 41, 2]
    single = await embed(client, input=ids)  # one token-id array: taken as given
    np.testing.assert_array_equal(vectors(single)[0], enc.vector(ids))
    assert single["usage"]["prompt_tokens"] == 4
    arrays = await embed(client, input=[ids, [7], [1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(
        vectors(arrays), np.stack([enc.vector(x) for x in (ids, [7], [1, 2, 3, 4, 5, 6])])
    )
    assert arrays["usage"]["total_tokens"] == 11
    assert enc.calls[-1] == [ids, [7], [1, 2, 3, 4, 5, 6]]  # no special tokens added to ids
    # `user` is accepted and changes nothing
    assert vectors(await embed(client, input="hello", user="u-1")).tolist() == vectors(one).tolist()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[1], []]}, "input"),
        ({}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": [True]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": [[1], "a"]}, "input"),
        ({"input": [9999]}, "input"),  # outside the vocabulary (500)
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": -3}, "dimensions"),
        ({"input": "a", "dimensions": "8"}, "dimensions"),
        ({"input": "a", "dimensions": 17}, "dimensions"),  # over the width (16)
        ({"input": "a", "input_type": "search"}, "input_type"),
        ({"input": "a", "task": "classify"}, "task"),
        ({"input": "a", "truncate": "yes"}, "truncate"),
        ({"input": "a", "model": 3}, "model"),
        ({"input": "x" * 40}, "input"),  # 42 tokens, over max_tokens (32)
    ],
)
async def test_bad_requests_are_400s_naming_the_field(aiohttp_client, body, param):
    enc = FakeEncoder()
    client = await client_for(aiohttp_client, {"enc": enc})
    await refused(client, body, param=param)
    assert not enc.calls


async def test_bodies_that_are_not_requests(aiohttp_client):
    client = await client_for(aiohttp_client)
    for raw, code in [(b"", "missing_body"), (b"{", "invalid_json"), (b"[1]", "invalid_json")]:
        assert (await refused(client, raw))["code"] == code
    err = await refused(client, {"input": ["a"] * 2049})
    assert "2048" in err["message"]


async def test_base64_is_the_float_vectors_bytes(aiohttp_client):
    client = await client_for(aiohttp_client)
    texts = ["one", "two words", "three little words"]
    floats = await embed(client, input=texts)
    b64 = await embed(client, input=texts, encoding_format="base64")
    for f, b in zip(floats["data"], b64["data"], strict=True):
        got = np.frombuffer(base64.b64decode(b["embedding"]), "<f4")
        np.testing.assert_array_equal(got, np.array(f["embedding"], np.float32))
        assert abs(np.linalg.norm(got) - 1) < 1e-5
    assert b64["usage"] == floats["usage"]


async def test_dimensions_cut_and_renormalize(aiohttp_client):
    enc = FakeEncoder()
    client = await client_for(aiohttp_client, {"enc": enc})
    full = vectors(await embed(client, input=["alpha", "beta"]))
    for d in (1, 5, 16):
        cut = vectors(await embed(client, input=["alpha", "beta"], dimensions=d))
        assert cut.shape == (2, d)
        want = full[:, :d] / np.linalg.norm(full[:, :d], axis=1, keepdims=True)
        np.testing.assert_allclose(cut, want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1, rtol=1e-6)
    err = await refused(client, {"input": "a", "dimensions": 17}, param="dimensions")
    assert "16" in err["message"]


async def test_an_input_over_the_limit_is_refused_or_cut(aiohttp_client):
    enc = FakeEncoder(max_tokens=8)
    client = await client_for(aiohttp_client, {"enc": enc})
    texts = ["short", "a sentence far over eight tokens", "ok"]
    err = await refused(client, {"input": texts}, param="input")
    assert "input[1]" in err["message"] and "8" in err["message"] and "truncate" in err["message"]
    assert err["code"] == "context_length_exceeded"
    long_ids = list(range(10, 30))
    err = await refused(client, {"input": [[1, 2], long_ids]}, param="input")
    assert "input[1]" in err["message"] and "20 tokens" in err["message"]
    assert not enc.calls

    cut = await embed(client, input=texts, truncate=True)
    assert cut["goinfer_truncated"] == [1]
    ids = enc.tokenize(texts[1])
    kept = enc.truncate(ids)
    assert len(kept) == 8 and kept[-1] == FakeEncoder.SEP
    np.testing.assert_array_equal(vectors(cut)[1], enc.vector(kept))
    assert cut["usage"]["prompt_tokens"] == 7 + 8 + 4
    again = await embed(client, input=[[1, 2], long_ids], truncate=True)
    assert again["goinfer_truncated"] == [1]
    assert (await embed(client, input="ok", truncate=True))["goinfer_truncated"] == []


async def test_input_type_applies_the_models_prompts(aiohttp_client):
    nomic, plain = FakeEncoder(max_tokens=64, prompts=NOMIC_PROMPTS), FakeEncoder()
    client = await client_for(aiohttp_client, {"nomic": nomic, "plain": plain})
    text = "what is a b-tree"

    async def ask(model: str, **kw: Any) -> tuple[dict, np.ndarray]:
        reply = await embed(client, model=model, input=[text], **kw)
        return reply["goinfer_task"], vectors(reply)[0]

    for kw, name in [
        ({}, "document"),
        ({"input_type": "document"}, "document"),
        ({"input_type": "query"}, "query"),
    ]:
        task, v = await ask("nomic", **kw)
        prompt = NOMIC_PROMPTS[name]
        assert task == {"name": name, "prompt": prompt}
        np.testing.assert_array_equal(v, nomic.vector(nomic.tokenize(prompt + text)))
    task, v = await ask("nomic", input_type="query", task="none")  # `task` wins; "none" is no prompt
    assert task == {"name": "none", "prompt": ""}
    np.testing.assert_array_equal(v, nomic.vector(nomic.tokenize(text)))
    task, _ = await ask("nomic", task="query")
    assert task == {"name": "query", "prompt": "search_query: "}
    err = await refused(client, {"model": "nomic", "input": text, "task": "STS"}, param="task")
    assert "document, query, none" in err["message"]
    # usage counts the prompt's tokens: they went through the model
    reply = await embed(client, model="nomic", input=text, input_type="query")
    assert reply["usage"]["prompt_tokens"] == len("search_query: " + text) + 2
    # token ids are the whole input: no prompt, and the reply says so
    ids = await embed(client, model="nomic", input=[1, 9, 2], input_type="query")
    assert ids["goinfer_task"] == {"name": "none", "prompt": ""}

    # a model whose card defines no prompts: input_type is accepted, nothing is applied
    for kw in ({}, {"input_type": "query"}, {"input_type": "document"}, {"task": "none"}):
        task, v = await ask("plain", **kw)
        assert task == {"name": "none", "prompt": ""}
        np.testing.assert_array_equal(v, plain.vector(plain.tokenize(text)))
    resp = await client.post("/v1/embeddings", json={"model": "plain", "input": "x", "input_type": "query"})
    assert resp.headers["X-Goinfer-Embedding-Task"] == "none"


# -- models of two kinds -----------------------------------------------------------------------------------
CHAT_ROUTES = {
    "/v1/chat/completions": {"messages": HELLO},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/systemone": {"state": "s", "questions": {"q": {"type": "noul"}}},
}


async def test_a_request_to_the_wrong_kind_of_model_is_a_400_naming_those_that_can(aiohttp_client):
    client = await client_for(aiohttp_client, {"enc": FakeEncoder()}, {"chat": ScoringEngine()})
    for route, body in CHAT_ROUTES.items():
        err = await refused(client, {**body, "model": "enc"}, param="model", route=route)
        assert err["code"] == "wrong_model_kind" and "embedding model" in err["message"], err
        assert "chat models here: chat" in err["message"], err
    resp = await client.post("/v1/messages", json={"model": "enc", "max_tokens": 4, "messages": HELLO})
    assert resp.status == 400
    body = sdk_models.anthropic_error(await resp.json())
    assert "embedding model" in body["error"]["message"]

    err = await refused(client, {"model": "chat", "input": "hi"}, param="model")
    assert err["code"] == "wrong_model_kind" and "embedding models here: enc" in err["message"]
    err = await refused(client, {"model": "nope", "input": "hi"}, status=404, param="model")
    assert "served: chat, enc" in err["message"]
    # each kind's route finds its only model when `model` is left out
    assert (await embed(client, input="hi"))["model"] == "enc"
    resp = await client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2})
    assert resp.status == 200 and (await resp.json())["model"] == "chat"

    listing = sdk_models.models(await (await client.get("/v1/models")).json())
    entries = {m["id"]: m for m in listing["data"]}
    assert entries["chat"]["kind"] == "chat"
    e = entries["enc"]
    assert (e["kind"], e["dimensions"], e["max_tokens"], e["pooling"]) == ("embedding", 16, 32, "mean")
    assert e["prompts"] == {} and e["quant"] == "f32"
    health = await (await client.get("/health")).json()
    assert health["models"]["chat"]["kind"] == "chat"
    h = health["models"]["enc"]
    assert h["kind"] == "embedding" and h["loaded"] is True and h["target"] == "llvm/fake"
    assert h["selftest"] == [] and h["forwards"] >= 1  # none ran: always an array


async def test_an_encoder_alone(aiohttp_client):
    client = await client_for(aiohttp_client, {"enc": FakeEncoder(prompts=NOMIC_PROMPTS)})
    for route, body in CHAT_ROUTES.items():
        err = await refused(client, body, param="model", route=route)  # no model named
        assert "serves no chat model" in err["message"] and "embedding" in err["message"], err
        err = await refused(client, {**body, "model": "gpt-4"}, status=404, route=route)
        assert "served: enc" in err["message"]
    listing = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in listing["data"]] == ["enc"]
    assert listing["data"][0]["prompts"] == NOMIC_PROMPTS
    assert (await embed(client, input="hi"))["goinfer_task"]["name"] == "document"


async def test_a_decoder_alone_says_no_encoder_is_served(aiohttp_client):
    client = await client_for(aiohttp_client, {}, {"chat": ScriptedEngine()})
    err = await refused(client, {"input": "hi"}, param="model")
    assert "serves no embedding model" in err["message"] and "--embed-model" in err["message"]
    err = await refused(client, {"model": "chat", "input": "hi"}, param="model")
    assert "is a chat model" in err["message"]
    listing = await (await client.get("/v1/models")).json()
    assert listing["data"][0]["kind"] == "chat"


async def test_admin_cannot_load_a_chat_model_under_an_encoders_name(aiohttp_client):
    app = create_app(
        {}, ServeConfig(**FAST, allow_admin=True), lambda n, p, q: ScriptedEngine(), {"enc": FakeEncoder()}
    )
    client = await aiohttp_client(app)
    err = await refused(client, {"name": "enc", "path": "x.giw"}, param="name", route="/admin/models/load")
    assert "already loaded" in err["message"]
    resp = await client.post("/admin/models/load", json={"name": "chat", "path": "x.giw"})
    assert resp.status == 200 and (await resp.json())["loaded"]["kind"] == "chat"
    assert (await embed(client, input="hi"))["model"] == "enc"


async def test_a_page_allowed_by_cors_origin_may_read_the_task_header(aiohttp_client):
    client = await client_for(aiohttp_client, cors_origins=("http://app.example",))
    resp = await client.post("/v1/embeddings", json={"input": "hi"}, headers={"Origin": "http://app.example"})
    assert resp.status == 200
    assert resp.headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert resp.headers["Access-Control-Expose-Headers"] == "X-Goinfer-Embedding-Task"


# -- the queue and its batching ----------------------------------------------------------------------------
async def until(cond, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


async def test_requests_that_arrive_during_a_forward_share_the_next(aiohttp_client):
    hold = threading.Event()
    enc = FakeEncoder(hold=hold)
    app = app_for({"enc": enc})
    client = await aiohttp_client(app)
    slot = app[REGISTRY].encoders["enc"]
    texts = {"first": ["a"], "b": ["bb", "bbb"], "c": ["c"], "d": ["dddd", "d", "dd"]}

    first = asyncio.create_task(client.post("/v1/embeddings", json={"input": texts["first"]}))
    await until(enc.entered.is_set)  # its forward runs, held
    rest = {
        k: asyncio.create_task(client.post("/v1/embeddings", json={"input": v}))
        for k, v in texts.items()
        if k != "first"
    }
    await until(lambda: slot.admitted == 4)
    hold.set()
    replies = {"first": await first, **{k: await t for k, t in rest.items()}}
    bodies = {k: await r.json() for k, r in replies.items()}
    assert all(r.status == 200 for r in replies.values()), bodies

    assert len(enc.calls) == 2, enc.calls  # the three that waited went in one forward together
    gathered = sorted(map(tuple, enc.calls[1]))
    assert gathered == sorted(tuple(enc.tokenize(t)) for k in ("b", "c", "d") for t in texts[k])
    for k, body in bodies.items():  # each got its own rows, equal to a lone request's
        want = np.stack([enc.vector(enc.tokenize(t)) for t in texts[k]])
        np.testing.assert_array_equal(vectors(body), want)
        assert body["usage"]["prompt_tokens"] == sum(len(t) + 2 for t in texts[k])
    alone = await embed(client, input=texts["d"])
    np.testing.assert_array_equal(vectors(alone), vectors(bodies["d"]))


async def test_a_forward_holds_at_most_the_token_cap(aiohttp_client):
    enc = FakeEncoder()
    client = await client_for(aiohttp_client, {"enc": enc}, embeddings=EmbeddingsConfig(max_batch_tokens=10))
    texts = ["aaa", "bbbbbb", "c", "dd", "eeeeeeeeeeeeee"]  # 5, 8, 3, 4, 16 tokens
    reply = await embed(client, input=texts)
    np.testing.assert_array_equal(vectors(reply), np.stack([enc.vector(enc.tokenize(t)) for t in texts]))
    # in order, each forward within 10 tokens but an input over the cap, which goes alone
    assert [sum(map(len, c)) for c in enc.calls] == [5, 8, 3 + 4, 16]


async def test_a_long_generation_does_not_hold_up_embeddings(aiohttp_client):
    gate = threading.Event()
    chat = ScriptedEngine(gate=gate)
    enc = FakeEncoder()
    client = await client_for(aiohttp_client, {"enc": enc}, {"chat": chat}, max_concurrent=1, max_queue=0)
    generating = asyncio.create_task(
        client.post("/v1/chat/completions", json={"model": "chat", "messages": HELLO})
    )
    await until(chat.started.is_set)  # the one generation the model runs, held in its prefill
    busy = await refused(
        client, {"model": "chat", "messages": HELLO}, status=429, route="/v1/chat/completions"
    )
    assert busy["code"] == "queue_full"
    reply = await asyncio.wait_for(embed(client, model="enc", input=["while", "it", "generates"]), 5)
    assert len(reply["data"]) == 3 and not generating.done()
    gate.set()
    assert (await generating).status == 200


async def test_a_full_queue_is_a_429_with_retry_after(aiohttp_client):
    hold = threading.Event()
    enc = FakeEncoder(hold=hold)
    app = app_for({"enc": enc}, embeddings=EmbeddingsConfig(max_queue=2), retry_after_s=3)
    client = await aiohttp_client(app)
    waiting = [asyncio.create_task(client.post("/v1/embeddings", json={"input": t})) for t in ("a", "b")]
    await until(lambda: app[REGISTRY].encoders["enc"].admitted == 2)
    resp = await client.post("/v1/embeddings", json={"input": "c"})
    assert resp.status == 429 and resp.headers["Retry-After"] == "3"
    err = sdk_models.openai_error(await resp.json())["error"]
    assert err["code"] == "queue_full" and "enc" in err["message"]
    hold.set()
    assert [(await t).status for t in waiting] == [200, 200]


async def test_a_client_that_leaves_does_not_poison_the_others(aiohttp_client):
    hold = threading.Event()
    enc = FakeEncoder(hold=hold)
    app = app_for({"enc": enc})
    client = await aiohttp_client(app)
    slot = app[REGISTRY].encoders["enc"]
    first = asyncio.create_task(client.post("/v1/embeddings", json={"input": "first"}))
    await until(enc.entered.is_set)
    # one waits in the queue, then its client goes (the handler cancelled, as a server may)
    leaving = asyncio.create_task(slot.embed([[1, 77, 2]]))
    staying = asyncio.create_task(client.post("/v1/embeddings", json={"input": "stays"}))
    await until(lambda: slot.admitted == 3)
    leaving.cancel()
    await until(lambda: slot.admitted == 2)
    hold.set()
    assert (await first).status == 200
    body = await (await staying).json()
    np.testing.assert_array_equal(vectors(body)[0], enc.vector(enc.tokenize("stays")))
    assert [1, 77, 2] not in [ids for call in enc.calls for ids in call]  # never embedded

    # a client that hangs up over HTTP while its request waits: the next is answered as usual
    hold.clear()
    blocker = asyncio.create_task(client.post("/v1/embeddings", json={"input": "x"}))
    await until(lambda: slot.admitted == 1)
    gone = asyncio.create_task(client.post("/v1/embeddings", json={"input": "gone"}))
    await asyncio.sleep(0.05)
    gone.cancel()
    hold.set()
    assert (await blocker).status == 200
    assert (await embed(client, input="after"))["data"][0]["embedding"]


async def test_a_failing_forward_fails_only_its_own_request(aiohttp_client, caplog):
    hold = threading.Event()
    enc = FakeEncoder(hold=hold, poison=66)
    app = app_for({"enc": enc})
    client = await aiohttp_client(app)
    slot = app[REGISTRY].encoders["enc"]
    first = asyncio.create_task(client.post("/v1/embeddings", json={"input": "first"}))
    await until(enc.entered.is_set)
    posts = [
        asyncio.create_task(client.post("/v1/embeddings", json={"input": x})) for x in ("a", [1, 66, 2], "c")
    ]
    await until(lambda: slot.admitted == 4)
    hold.set()
    statuses = [(await first).status] + [(await p).status for p in posts]
    assert statuses == [200, 200, 500, 200]
    err = sdk_models.openai_error(await (await posts[1]).json())["error"]
    assert "secret" not in err["message"]
    assert [len(c) for c in enc.calls] == [1, 3, 1, 1, 1]  # gathered, failed, then one by one


# -- the body cap --------------------------------------------------------------------------------
async def test_the_route_has_its_own_body_cap(aiohttp_client):
    app = app_for(engines={"chat": ScriptedEngine()})
    caps = app[CAPS]
    assert caps.embeddings == EMBEDDINGS_CAP == 64 * MiB and caps.text == 4 * MiB  # not a window's
    assert caps.embedding_routes == ("/v1/embeddings",)
    assert "/v1/embeddings" not in caps.text_routes
    line = next(x for x in server.banner(ServeConfig(), caps, {}, {"enc": FakeEncoder()}) if "body caps" in x)
    assert "/v1/embeddings 64.0 MiB" in line and "other routes 64 KiB" in line, line
    client = await aiohttp_client(app)
    padded = b'{"input": "hi",' + b" " * (5 * MiB) + b'"model": "enc"}'  # over the text cap
    resp = await client.post("/v1/embeddings", data=padded, headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()
    chat = b'{"messages": [{"role": "user", "content": "hi"}],' + b" " * (5 * MiB) + b'"model": "chat"}'
    assert (await client.post("/v1/chat/completions", data=chat)).status == 413

    small = app_for()
    small[CAPS] = dataclasses.replace(small[CAPS], embeddings=MiB)
    client = await aiohttp_client(small)
    err = await refused(client, b'{"input": "hi",' + b" " * MiB + b"}", status=413)
    assert err["code"] == "body_too_large" and str(MiB) in err["message"]
    capped = await client_for(aiohttp_client, max_body_bytes=2048)  # --max-body-bytes caps it too
    assert (await refused(capped, {"input": "x" * 3000}, status=413))["code"] == "body_too_large"


# -- the openai SDK ------------------------------------------------------------------------------------------
async def test_the_openai_sdk(aiohttp_client):
    openai = pytest.importorskip("openai")
    enc = FakeEncoder(max_tokens=64, prompts=NOMIC_PROMPTS)
    client = await client_for(aiohttp_client, {"enc": enc}, api_key="k")
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
    texts = ["the first", "the second one"]
    want = np.stack([enc.vector(enc.tokenize("search_document: " + t)) for t in texts])
    # the SDK asks for base64 by default and decodes it itself
    got = await sdk.embeddings.create(model="enc", input=texts)
    np.testing.assert_array_equal(np.array([d.embedding for d in got.data], np.float32), want)
    assert got.usage.prompt_tokens == sum(len("search_document: " + t) + 2 for t in texts)
    floats = await sdk.embeddings.create(model="enc", input=texts, encoding_format="float")
    np.testing.assert_array_equal(np.array([d.embedding for d in floats.data], np.float32), want)
    raw = await sdk.embeddings.with_raw_response.create(
        model="enc", input="q", dimensions=4, extra_body={"input_type": "query"}
    )
    assert raw.headers["X-Goinfer-Embedding-Task"] == "query"
    short = raw.parse()
    assert (
        len(short.data[0].embedding) == 4 and short.model_extra["goinfer_task"]["prompt"] == "search_query: "
    )
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.embeddings.create(model="enc", input="x", dimensions=99)
    assert "16" in e.value.message
    with pytest.raises(openai.NotFoundError):
        await sdk.embeddings.create(model="text-embedding-3-small", input="x")
    await sdk.close()


# -- the CLI -------------------------------------------------------------------------------------------------
def _run(*args: str, stdin: str | None = None):
    from click.testing import CliRunner
    from goinfer.cli.main import main

    return CliRunner().invoke(main, [str(a) for a in args], input=stdin, env={"GOINFER_API_KEY": ""})


def _one_line_error(result, needle: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("goinfer: error: ") and needle in lines[0], lines


@pytest.fixture
def fake_loader(monkeypatch):
    """`goinfer embed` and `serve --embed-model` load FakeEncoders; returns the loads' arguments."""
    from goinfer.cli import embed as embed_cli

    loads: list[tuple[Any, ...]] = []

    def load(ref: str, quant: str, self_test: bool = True, device: str = "auto") -> FakeEncoder:
        if ref.endswith("broken.giw"):
            raise ValueError(f"{ref}: bundle is truncated")
        loads.append(
            (ref, quant, self_test, device, enc := FakeEncoder(max_tokens=64, prompts=NOMIC_PROMPTS))
        )
        return enc

    monkeypatch.setattr(embed_cli, "load_encoder", load)
    return loads


async def test_goinfer_embed_prints_the_vectors_as_json(fake_loader):
    result = _run(
        "embed", "models/nomic.giw", "a query", "another", "--dimensions", "8", "--input-type", "query"
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["model"], out["dimensions"]) == ("nomic", 8)
    assert out["task"] == {"name": "query", "prompt": "search_query: "}
    ref, quant, self_test, _device, enc = fake_loader[-1]
    assert (ref, quant, self_test) == ("models/nomic.giw", "f32", True) and enc.closed
    full = np.stack([enc.vector(enc.tokenize("search_query: " + t)) for t in ("a query", "another")])
    want = full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True)
    got = np.array([d["embedding"] for d in out["data"]], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert [d["index"] for d in out["data"]] == [0, 1]
    assert out["usage"]["prompt_tokens"] == sum(len("search_query: " + t) + 2 for t in ("a query", "another"))

    piped = _run("embed", "nomic.giw", "--no-selftest", "--quant", "q8_0", stdin="one\n\n  \ntwo words\n")
    assert piped.exit_code == 0, piped.output
    out = json.loads(piped.stdout)
    assert len(out["data"]) == 2 and out["dimensions"] == 16 and out["task"]["name"] == "document"
    assert fake_loader[-1][1:3] == ("q8_0", False)

    cut = _run("embed", "nomic.giw", "x" * 100, "--truncate")
    assert cut.exit_code == 0 and json.loads(cut.stdout)["truncated"] == [0]


async def test_goinfer_embed_fails_in_one_line(fake_loader, tmp_path):
    _one_line_error(_run("embed", "nomic.giw", "a", "--dimensions", "99"), "dimensions 99")
    _one_line_error(_run("embed", "nomic.giw", "a", "--dimensions", "0"), "--dimensions")
    _one_line_error(_run("embed", "nomic.giw", "x" * 100), "at most 64 tokens")
    _one_line_error(_run("embed", "nomic.giw", stdin="\n\n"), "no texts")
    _one_line_error(_run("embed", "nomic.giw", "a", "--input-type", "search"), "--input-type")
    _one_line_error(_run("embed", "broken.giw", "a"), "bundle is truncated")


async def test_goinfer_embed_names_a_missing_bundle():
    result = _run("embed", "/nonexistent/minilm.giw", "a")
    _one_line_error(result, "minilm.giw")


async def test_serve_with_an_embedding_model_alone(fake_loader, monkeypatch, aiohttp_client):
    got: dict[str, Any] = {}
    monkeypatch.setattr(server, "run", lambda app, config, ctx: got.update(app=app, config=config))
    result = _run("serve", "--embed-model", "models/nomic.giw", "--embed-quant", "q8_0", "--no-selftest")
    assert result.exit_code == 0, result.output
    app, config = got["app"], got["config"]
    assert set(app[REGISTRY].encoders) == {"nomic"} and not app[REGISTRY].slots  # no default chat model
    assert config.embeddings.quant == "q8_0" and fake_loader[-1][1:3] == ("q8_0", False)
    out = result.stdout
    assert "embedding model nomic: 16 dimensions, 64 tokens an input, mean pooling" in out
    assert "prompts: query 'search_query: ', document 'search_document: '" in out
    assert "/v1/embeddings 64.0 MiB" in out
    client = await aiohttp_client(app)
    reply = await embed(client, input=["served"], input_type="query")
    assert reply["model"] == "nomic" and reply["goinfer_task"]["name"] == "query"


async def test_serve_refuses_embedding_models_before_loading(fake_loader, tmp_path):
    missing = tmp_path / "missing.giw"
    result = _run("serve", "--model", f"a={missing}", "--embed-model", "a=nomic.giw")
    _one_line_error(result, "'a' is given twice")
    assert not fake_loader
    _one_line_error(
        _run("serve", "--embed-model", "e=broken.giw"), "--embed-model e=broken.giw: bundle is truncated"
    )
    _one_line_error(_run("serve", "--embed-model", "e.giw", "--embed-quant", "int4"), "--embed-quant")


# -- the real encoder ----------------------------------------------------------------------------------------
@pytest.mark.slow
async def test_minilm_served_batched_equals_alone(aiohttp_client):
    """all-MiniLM-L6-v2 (the zoo's, built f32 once into the cache) through the route: 16 concurrent
    requests, gathered into shared forwards, give each input the bits it gets alone."""
    from goinfer.cli.embed import load_encoder

    enc = load_encoder("all-minilm-l6-v2", "f32", self_test=True)
    texts = [f"sentence {i} about {'cats' if i % 2 else 'databases'} " * (1 + i % 7) for i in range(64)]
    lone = enc.embed(texts)  # before the server's worker owns it
    cli = _run("embed", "all-minilm-l6-v2", texts[5])
    assert cli.exit_code == 0, cli.output
    np.testing.assert_array_equal(
        np.array(json.loads(cli.stdout)["data"][0]["embedding"], np.float32), lone[5]
    )

    client = await client_for(aiohttp_client, {"minilm": enc})
    posts = [client.post("/v1/embeddings", json={"input": texts[i : i + 4]}) for i in range(0, 64, 4)]
    bodies = [await r.json() for r in await asyncio.gather(*posts)]
    np.testing.assert_array_equal(np.concatenate([vectors(b) for b in bodies]), lone)
    assert sum(b["usage"]["prompt_tokens"] for b in bodies) == sum(len(enc.tokenize(t)) for t in texts)
    entry = (await (await client.get("/v1/models")).json())["data"][0]
    assert (entry["kind"], entry["dimensions"], entry["max_tokens"], entry["pooling"]) == (
        "embedding",
        384,
        512,
        "mean",
    )
    long = "word " * 600
    err = await refused(client, {"input": ["ok", long]}, param="input")
    assert "input[1]" in err["message"] and "512" in err["message"]
    cut = await embed(client, input=["ok", long], truncate=True, encoding_format="base64")
    assert cut["goinfer_truncated"] == [1] and cut["usage"]["prompt_tokens"] == len(enc.tokenize("ok")) + 512
