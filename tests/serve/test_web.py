"""The web page's routes (serve/webpage.py, serve/pulls.py) on fake engines and a fake Puller: the
page and its files without a key, the status and cache routes behind it, the admin plan and the
pull's server-sent events, and the rules the admin routes keep (same origin, --allow-admin)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any

import pytest
from fake_engine import ScriptedEngine
from goinfer.serve import webpage
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from goinfer.serve.pulls import BadQuant, PullProgress

pytestmark = pytest.mark.asyncio

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}


class FakePuller:
    """The Puller interface over a scripted pull: two pull lines, two build lines, then the bundle.
    `gate` given, the pull waits on it after its first line (a download in progress)."""

    def __init__(self, gate: threading.Event | None = None, fail: str | None = None):
        self.gate, self.fail = gate, fail
        self.pulls: list[tuple[str, str | None]] = []
        self.started = threading.Event()

    def catalog(self) -> dict[str, Any]:
        zoo = [{"name": "tiny", "description": "a tiny model", "size": 1234, "kind": "chat", "pulled": False}]
        return {"zoo": zoo, "quants": ["gguf", "int4"], "default_quant": "gguf"}

    def check(self, ref: str, quant: str | None) -> None:
        if quant not in (None, "gguf", "int4"):
            raise BadQuant(f"quant {quant!r}: choose one of gguf, int4")
        if ref != "tiny" and not ref.startswith("hf:"):
            raise ValueError(f"{ref!r} is neither a zoo model (tiny) nor hf:owner/repo:QUANT")

    def plan(self, ref: str, quant: str | None) -> dict[str, Any]:
        if ref == "hf:o/missing:Q4_K_M":
            raise ValueError("hf:o/missing:Q4_K_M: no repo o/missing on the Hub")
        files = [{"name": "tiny-F32.gguf", "size": 1000}, {"name": "README.md", "size": 5}]
        return {"ref": ref, "source": "hub", "kind": "chat", "files": files, "total_bytes": 1005, "notes": []}

    def pull_build(self, ref: str, quant: str | None, progress: PullProgress) -> dict[str, Any]:
        self.pulls.append((ref, quant))
        self.started.set()
        progress("pull", f"pulling {ref}")
        if self.gate is not None:
            self.gate.wait(timeout=30)
        progress("pull", "    tiny-F32.gguf: 0.0 / 0.0 MB")
        if self.fail:
            raise ValueError(self.fail)
        progress("build", "[1/6] read tiny")
        progress("build", "built tiny.giw")
        return {"bundle": "/cache/bundles/tiny.giw", "name": "tiny-F32", "kind": "chat"}

    def on_disk(self) -> list[dict[str, Any]]:
        return [
            {
                "kind": "hub",
                "name": "hf:o/tiny-GGUF:F32",
                "path": "/cache/hub/o--tiny-GGUF/F32",
                "size": 1005,
                "complete": True,
                "detail": "gguf, 2 files",
                "ref": "hf:o/tiny-GGUF:F32",
                "stale": False,
            }
        ]


async def client_for(aiohttp_client, puller=None, **config: Any):
    app = create_app({"fake": ScriptedEngine()}, ServeConfig(**{**FAST, **config}), puller=puller)
    return await aiohttp_client(app)


def own_origin(client) -> str:
    return f"http://{client.server.host}:{client.server.port}"


async def sse(resp) -> list[dict[str, Any]]:
    text = (await resp.read()).decode()
    return [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: ")]


async def until(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


# -- the page ----------------------------------------------------------------------------------------
async def test_the_page_and_its_files_need_no_key_and_forbid_framing(aiohttp_client):
    client = await client_for(aiohttp_client, api_key=KEY)
    resp = await client.get("/")
    html = await resp.text()
    assert resp.status == 200 and resp.content_type == "text/html", html
    csp = resp.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    for asset in re.findall(r'(?:src|href)="(/web/assets/[^"]+)"', html):
        r = await client.get(asset)
        assert r.status == 200, asset
    js = await client.get("/web/assets/app.js")
    assert js.content_type == "text/javascript"
    # everything it calls keeps the key
    assert (await client.get("/web/status")).status == 401
    assert (await client.get("/v1/models")).status == 401
    assert (await client.get("/web/status", headers=AUTH)).status == 200


async def test_every_module_the_page_imports_is_served():
    """No build step: the modules import each other by relative path, and each is package data."""
    served = webpage.assets()
    page = {"index.html", "style.css", "app.js", "api.js", "chat.js", "models.js", "markdown.js"}
    assert page <= set(served)
    for name, (body, _kind) in served.items():
        if name.endswith(".js"):
            for imported in re.findall(r'from "\./([^"]+)"', body.decode()):
                assert imported in served, (name, imported)
            assert "http://" not in body.decode() and "https://cdn" not in body.decode(), name


async def test_an_unknown_file_is_a_404_in_the_envelope(aiohttp_client):
    client = await client_for(aiohttp_client)
    for path in ("/web/assets/nope.js", "/web/assets/..%2F..%2Fwebpage.py", "/web/assets/%2e%2e"):
        resp = await client.get(path)
        assert resp.status == 404, path
        assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("config", "served"),
    [
        ({}, True),  # loopback: on by default
        ({"web": False}, False),  # --no-web
        ({"host": "0.0.0.0", "api_key": KEY}, False),  # off loopback: off unless asked for
        ({"host": "0.0.0.0", "api_key": KEY, "web": True}, True),  # --web
    ],
)
async def test_web_is_on_by_default_on_loopback_only(aiohttp_client, config, served):
    client = await client_for(aiohttp_client, **config)
    assert ServeConfig(**config).serves_web is served
    assert (await client.get("/", headers=AUTH)).status == (200 if served else 404)
    assert (await client.get("/web/status", headers=AUTH)).status == (200 if served else 404)


async def test_status_says_what_the_page_may_offer(aiohttp_client):
    client = await client_for(aiohttp_client)
    body = await (await client.get("/web/status")).json()
    assert body == {"admin": False, "puller": False, "loader": False, "key": False, "pull": None}
    client = await client_for(aiohttp_client, FakePuller(), allow_admin=True, api_key=KEY)
    body = await (await client.get("/web/status", headers=AUTH)).json()
    assert body == {"admin": True, "puller": True, "loader": False, "key": True, "pull": None}


async def test_the_web_routes_answer_their_own_origin_only(aiohttp_client):
    client = await client_for(aiohttp_client, FakePuller(), cors_origins=("http://app.example",))
    own = await client.get("/web/models/cache", headers={"Origin": own_origin(client)})
    assert own.status == 200
    for origin in ("http://app.example", "http://evil.example"):  # --cors-origin opens the API, not these
        resp = await client.get("/web/models/cache", headers={"Origin": origin})
        assert resp.status == 403 and (await resp.json())["error"]["code"] == "origin_not_allowed"


# -- the Models tab's routes ---------------------------------------------------------------------------
async def test_catalog_and_cache_come_from_the_puller(aiohttp_client):
    puller = FakePuller()
    client = await client_for(aiohttp_client, puller)
    catalog = await (await client.get("/web/models/catalog")).json()
    assert catalog == puller.catalog()
    on_disk = await (await client.get("/web/models/cache")).json()
    assert on_disk == {"object": "list", "data": puller.on_disk()}
    bare = await client_for(aiohttp_client)
    for path in ("/web/models/catalog", "/web/models/cache"):
        resp = await bare.get(path)
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_puller"


async def test_plan_and_pull_are_admin_routes(aiohttp_client):
    client = await client_for(aiohttp_client, FakePuller())  # no --allow-admin
    for path in ("/admin/models/plan", "/admin/models/pull"):
        assert (await client.post(path, json={"ref": "tiny"})).status == 404
    client = await client_for(aiohttp_client, FakePuller(), allow_admin=True, api_key=KEY)
    assert (await client.post("/admin/models/plan", json={"ref": "tiny"})).status == 401
    foreign = {**AUTH, "Origin": "http://evil.example"}
    resp = await client.post("/admin/models/pull", json={"ref": "tiny"}, headers=foreign)
    assert resp.status == 403 and (await resp.json())["error"]["code"] == "origin_not_allowed"


async def test_plan_refuses_bad_input_naming_the_field(aiohttp_client):
    client = await client_for(aiohttp_client, FakePuller(), allow_admin=True)
    resp = await client.post("/admin/models/plan", json={"ref": "hf:o/tiny-GGUF:F32"})
    assert resp.status == 200
    plan = await resp.json()
    assert plan["files"][0] == {"name": "tiny-F32.gguf", "size": 1000} and plan["total_bytes"] == 1005
    cases = [
        ({"ref": "hf:o/missing:Q4_K_M"}, "ref", "no repo o/missing"),
        ({"ref": "nope"}, "ref", "neither a zoo model"),
        ({"ref": "  "}, "ref", "ref is empty"),
        ({"ref": "tiny", "quant": "int3"}, "quant", "choose one of"),
        ({"quant": "gguf"}, "ref", "Field required"),
    ]
    for body, param, needle in cases:
        resp = await client.post("/admin/models/plan", json=body)
        err = (await resp.json())["error"]
        assert resp.status == 400 and err["param"] == param and needle in err["message"], (body, err)


async def test_a_pull_streams_its_stages_and_lines_then_the_bundle(aiohttp_client):
    puller = FakePuller()
    client = await client_for(aiohttp_client, puller, allow_admin=True)
    resp = await client.post("/admin/models/pull", json={"ref": "tiny", "quant": "int4"})
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    events = await sse(resp)
    assert [e["type"] for e in events] == ["stage", "line", "line", "stage", "line", "line", "stage", "built"]
    assert [e["stage"] for e in events if e["type"] == "stage"] == ["pull", "build", "built"]
    assert events[1] == {"type": "line", "stage": "pull", "line": "pulling tiny"}
    built = {"type": "built", "bundle": "/cache/bundles/tiny.giw", "name": "tiny-F32", "kind": "chat"}
    assert events[-1] == built
    assert puller.pulls == [("tiny", "int4")]
    # the last pull, replayed for a page that comes back
    again = await sse(await client.get("/admin/models/pull"))
    assert again == events
    status = await (await client.get("/web/status")).json()
    assert status["pull"] == {"ref": "tiny", "done": True}


async def test_a_failed_pull_ends_with_its_reason(aiohttp_client):
    why = "hf:o/x:F32: lost the Hub while fetching x.gguf; run again to resume"
    client = await client_for(aiohttp_client, FakePuller(fail=why), allow_admin=True)
    events = await sse(await client.post("/admin/models/pull", json={"ref": "hf:o/x:F32"}))
    assert events[-1] == {"type": "error", "error": {"message": why, "code": "pull_failed"}}


async def test_one_pull_at_a_time_and_it_outlives_the_page(aiohttp_client):
    gate = threading.Event()
    puller = FakePuller(gate=gate)
    client = await client_for(aiohttp_client, puller, allow_admin=True)
    resp = await client.post("/admin/models/pull", json={"ref": "tiny"})
    await resp.content.readline()
    await until(puller.started.is_set)
    other = await client.post("/admin/models/pull", json={"ref": "hf:o/tiny-GGUF:F32"})
    assert other.status == 429 and (await other.json())["error"]["code"] == "pull_running"
    assert other.headers["Retry-After"]
    resp.close()  # the page goes away mid-download
    same = await client.post("/admin/models/pull", json={"ref": "tiny"})  # a reloaded page asks again
    gate.set()
    events = await sse(same)
    assert events[-1]["type"] == "built"
    assert puller.pulls == [("tiny", None)]  # followed, not started twice


async def test_a_stream_that_is_stopped_frees_its_slot(aiohttp_client):
    """The page's Stop aborts its fetch: the server cancels the generation and frees the slot."""
    engine = ScriptedEngine(pieces=[f"t{i} " for i in range(400)], context_window=4096, step_s=0.005)
    app = create_app({"fake": engine}, ServeConfig(**FAST))
    client = await aiohttp_client(app)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    resp = await client.post("/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}})
    await resp.content.readline()
    resp.close()
    health = None
    for _ in range(500):
        health = await (await client.get("/health")).json()
        if health["models"]["fake"]["running_or_queued"] == 0 and engine.finished.is_set():
            break
        await asyncio.sleep(0.01)
    assert health["models"]["fake"]["running_or_queued"] == 0 and engine.yielded < 400
