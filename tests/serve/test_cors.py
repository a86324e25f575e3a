"""The guards every route passes (serve/middleware.py): the origin check and CORS answers, the API
key compared as bytes, and the body caps as the banner states them."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import hostile
import pytest
import sdk_models
from fake_engine import ScoringEngine, ScriptedEngine
from goinfer.serve import server
from goinfer.serve.app import create_app
from goinfer.serve.config import SMALL_CAP, BodyCaps, ServeConfig
from goinfer.serve.keys import CAPS
from goinfer.serve.middleware import text_routes

pytestmark = pytest.mark.asyncio

APP_ORIGIN = "http://app.example:3000"
EVIL = "http://evil.example"
FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


async def client_for(aiohttp_client, engines: dict | None = None, **config: Any):
    engines = engines if engines is not None else {"fake": ScriptedEngine()}
    return await aiohttp_client(create_app(engines, ServeConfig(**{**FAST, **config})))


def own_origin(client) -> str:
    return f"http://{client.server.host}:{client.server.port}"


def assert_allowed(resp, origin: str) -> None:
    assert resp.headers.get("Access-Control-Allow-Origin") == origin, dict(resp.headers)
    assert "Origin" in resp.headers.get("Vary", ""), dict(resp.headers)


# -- foreign origins ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "origin", [EVIL, "null", "http://127.0.0.1:1", "https://app.example:3000", "file://"]
)
async def test_a_foreign_origin_is_refused_on_every_route(aiohttp_client, origin):
    engine = ScriptedEngine()
    client = await client_for(aiohttp_client, {"fake": engine}, cors_origins=(APP_ORIGIN,))
    headers = {"Origin": origin, "Content-Type": "text/plain"}
    posts = [("POST", p) for p in ("/v1/chat/completions", "/v1/completions", "/v1/responses")]
    for method, path in [*posts, ("GET", "/v1/models"), ("GET", "/health")]:
        resp = await client.request(method, path, json=CHAT, headers=headers)
        assert resp.status == 403, (path, await resp.text())
        body = await resp.json()
        sdk_models.openai_error(body)
        assert body["error"]["type"] == "permission_error" and body["error"]["code"] == "origin_not_allowed"
        assert "Access-Control-Allow-Origin" not in resp.headers
    resp = await client.post("/v1/messages", json={**CHAT, "max_tokens": 5}, headers=headers)
    assert resp.status == 403
    assert (await resp.json())["error"]["type"] == "permission_error"  # Anthropic's envelope
    assert (await resp.json())["type"] == "error"
    assert not engine.started.is_set()


async def test_requests_without_an_origin_and_same_origin_pages_are_served(aiohttp_client):
    client = await client_for(aiohttp_client)
    resp = await client.post("/v1/chat/completions", data=b'{"model": "fake", "messages": [{"role": "user", '
                             b'"content": "hi"}]}', headers={"Content-Type": "text/plain"})  # fmt: skip
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
    assert "Vary" not in resp.headers  # nothing here depends on an Origin
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": own_origin(client)})
    assert resp.status == 200, await resp.text()
    resp = await client.get(
        "/v1/models", headers={"Origin": own_origin(client).upper().replace("HTTP", "http")}
    )
    assert resp.status == 200  # the host compares without case


async def test_a_rebound_name_is_not_a_loopback_servers_own_origin(aiohttp_client):
    """DNS rebinding: evil.example resolved to 127.0.0.1 makes Origin and Host agree; a server bound
    to loopback still refuses the page, and serves its own under loopback names."""
    client = await client_for(aiohttp_client)
    port = client.server.port
    rebound = {"Origin": f"http://evil.example:{port}", "Host": f"evil.example:{port}"}
    resp = await client.post("/v1/chat/completions", json=CHAT, headers=rebound)
    assert resp.status == 403 and (await resp.json())["error"]["code"] == "origin_not_allowed"
    for name in ("localhost", "127.0.0.1", "[::1]"):
        own = {"Origin": f"http://{name}:{port}", "Host": f"{name}:{port}"}
        assert (await client.get("/v1/models", headers=own)).status == 200, name
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={"Host": f"evil.example:{port}"})
    assert resp.status == 200  # no Origin: not a browser page, nothing to rebind


# -- allowed origins ---------------------------------------------------------------------------------
async def test_an_allowed_origin_gets_cors_answers_on_replies_streams_and_errors(aiohttp_client):
    client = await client_for(aiohttp_client, cors_origins=("HTTP://App.Example:3000/",), api_key="k")
    key = {"Origin": APP_ORIGIN, "Authorization": "Bearer k"}
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={**key, "Content-Type": "text/plain"})
    assert resp.status == 200
    assert_allowed(resp, APP_ORIGIN)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=key)
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    assert_allowed(resp, APP_ORIGIN)
    assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    resp = await client.post("/v1/messages", json={**CHAT, "max_tokens": 5, "stream": True}, headers=key)
    assert resp.status == 200
    assert_allowed(resp, APP_ORIGIN)
    for body, headers, status in [({**CHAT, "model": "nope"}, key, 404), (CHAT, {"Origin": APP_ORIGIN}, 401)]:
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status == status
        assert_allowed(resp, APP_ORIGIN)  # the page can read why
    resp = await client.post("/v1/messages", json=CHAT, headers={"Origin": APP_ORIGIN})
    assert resp.status == 401
    assert_allowed(resp, APP_ORIGIN)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                                  "/v1/responses", "/v1/models"])  # fmt: skip
async def test_a_preflight_from_an_allowed_origin_is_answered_without_the_key(aiohttp_client, path):
    client = await client_for(aiohttp_client, cors_origins=(APP_ORIGIN,), api_key="k")
    asked = "authorization, content-type, x-stainless-os, anthropic-version"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked}
    resp = await client.options(path, headers={"Origin": APP_ORIGIN, **preflight})
    assert resp.status == 204, await resp.text()
    assert_allowed(resp, APP_ORIGIN)
    h = resp.headers
    method = "GET" if path == "/v1/models" else "POST"
    assert method in h["Access-Control-Allow-Methods"].split(", ")
    assert h["Access-Control-Allow-Headers"] == asked
    assert int(h["Access-Control-Max-Age"]) > 0


async def test_preflight_edges(aiohttp_client):
    client = await client_for(aiohttp_client, cors_origins=(APP_ORIGIN,), api_key="k")
    preflight = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST"}
    resp = await client.options("/v1/chat/completions", headers=preflight)
    assert resp.status == 204
    assert "x-api-key" in resp.headers["Access-Control-Allow-Headers"]  # none asked: the ones the APIs use
    resp = await client.options("/v1/nothing", headers=preflight)
    assert resp.status == 404
    resp = await client.options("/v1/chat/completions", headers={**preflight, "Origin": EVIL})
    assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
    not_preflight = {"Origin": APP_ORIGIN, "Authorization": "Bearer k"}
    resp = await client.options("/v1/chat/completions", headers=not_preflight)
    assert resp.status == 405


async def test_admin_routes_refuse_every_foreign_origin_even_an_allowed_one(aiohttp_client):
    engine = ScriptedEngine()
    client = await client_for(aiohttp_client, {"fake": engine}, cors_origins=(APP_ORIGIN,), allow_admin=True)
    for origin in (APP_ORIGIN, EVIL, "null"):
        for path in ("/admin/models/unload", "/admin/models/load"):
            resp = await client.post(path, json={"name": "fake", "path": "/etc/passwd"},
                                     headers={"Origin": origin, "Content-Type": "text/plain"})  # fmt: skip
            assert resp.status == 403, (origin, path)
            assert (await resp.json())["error"]["code"] == "origin_not_allowed"
        resp = await client.options("/admin/models/unload", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})  # fmt: skip
        assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
    assert not engine.closed
    resp = await client.post(
        "/admin/models/unload", json={"name": "other"}, headers={"Origin": own_origin(client)}
    )
    assert resp.status == 404  # same-origin reaches the route (no such model)
    resp = await client.post("/admin/models/unload", json={"name": "fake"})  # curl: no Origin
    assert resp.status == 200


# -- the API key, compared as bytes ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "header", "status"),
    [
        ("k", "Bearer \udcff\udcfe", 401),  # not UTF-8
        ("k", "Bearer cl\u00e9", 401),  # not ASCII
        ("cl\u00e9", "Bearer cl\u00e9", 200),  # a non-ASCII key, sent as UTF-8
        ("\udcff", "Bearer \udcff", 200),  # a key given as raw bytes (argv keeps them as surrogates)
        ("\udcff", "Bearer \u00ff", 401),  # the same character, a different byte string
    ],
)
async def test_the_key_is_compared_as_bytes(aiohttp_client, caplog, key, header, status):
    client = await client_for(aiohttp_client, api_key=key)
    case = {"name": "auth", "route": "/v1/models", "method": "GET", "headers": {"Authorization": header}}
    for name in ("Authorization", "x-api-key"):
        value = header if name == "Authorization" else header.removeprefix("Bearer ")
        reply = await asyncio.to_thread(
            hostile.send, client.server.host, client.server.port, {**case, "headers": {name: value}}
        )
        assert reply.status == status, (name, reply.body)
        if status == 401:
            hostile.check_envelope({"route": "/v1/models"}, json.loads(reply.body), "auth")
    assert not [r for r in caplog.records if r.exc_info]


# -- the body caps, as the banner states them --------------------------------------------------------------
async def test_the_banner_names_every_text_route_and_each_takes_a_body_over_the_small_cap(aiohttp_client):
    engine = ScoringEngine(context_window=400_000)  # one token per character: a 100 KiB prompt fits
    app = create_app({"fake": engine}, ServeConfig(**FAST, allow_admin=True))
    caps = app[CAPS]
    routes = text_routes(app)
    assert caps.text_routes == routes
    v2 = [  # KServe v2's prompt routes
        f"{base}/{verb}"
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}")
        for verb in ("infer", "generate", "generate_stream")
    ]
    assert set(routes) == {"/v1/chat/completions", "/v1/completions", "/v1/messages",
                           "/v1/messages/count_tokens", "/v1/responses", "/v1/systemone", *v2}  # fmt: skip
    line = next(x for x in server.banner(ServeConfig(), caps, {"fake": engine}) if "body caps" in x)
    for path in routes:
        assert path in line, line
    assert "12.2 MiB" in line and "other routes 64 KiB" in line, line
    client = await aiohttp_client(app)
    big = "x" * (SMALL_CAP + 40_000)
    bodies = {
        "/v1/chat/completions": {
            "model": "fake",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": big}],
        },
        "/v1/completions": {"model": "fake", "max_tokens": 3, "prompt": big},
        "/v1/messages": {"model": "fake", "max_tokens": 3, "messages": [{"role": "user", "content": big}]},
        "/v1/messages/count_tokens": {"model": "fake", "messages": [{"role": "user", "content": big}]},
        "/v1/responses": {"model": "fake", "max_output_tokens": 3, "input": big},
        "/v1/systemone": {"model": "fake", "state": big, "questions": {"q": {"type": "noul"}}},
        "/v2/models/fake/generate": {"text_input": big, "parameters": {"max_tokens": 3}},
    }
    for path, body in bodies.items():
        resp = await client.post(path, json=body)
        assert resp.status == 200, (path, (await resp.text())[:300])
    resp = await client.post("/admin/models/unload", json={"name": big})  # a small route: capped
    assert resp.status == 413


async def test_caps_describe_themselves():
    caps = BodyCaps(text=4 << 20, small=SMALL_CAP, text_routes=("/v1/a", "/v1/b"))
    assert caps.describe() == "/v1/a, /v1/b 4.0 MiB; other routes 64 KiB"
    assert BodyCaps.resolve(2048, [4096]).describe() == "every route 2 KiB"


# -- requests that are not HTTP ------------------------------------------------------------------------
async def test_a_malformed_request_is_one_log_line_not_a_traceback(caplog):
    from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
    from aiohttp.web import RequestPayloadError

    log = server.http_log()
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        log.exception("Unhandled exception", exc_info=RequestPayloadError("400, message:\n  Can not decode"))
        log.exception(
            "Error handling request from %s", "::1", exc_info=BadHttpMessage("Invalid char:\n  b'\\x01'")
        )
        log.exception("Error handling request from %s", "::1", exc_info=LineTooLong(b"x" * 9, 8190))
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 3
    assert not any(r.exc_info for r in caplog.records)
    assert "RequestPayloadError: Can not decode" in caplog.records[0].getMessage()
    assert "from ::1: BadHttpMessage: Invalid char:" in caplog.records[1].getMessage()
    caplog.clear()
    try:
        raise KeyError("ours")
    except KeyError as e:
        log.exception("Unhandled exception", exc_info=e)  # a bug of ours keeps its traceback
    assert caplog.records[0].levelno == logging.ERROR and caplog.records[0].exc_info
