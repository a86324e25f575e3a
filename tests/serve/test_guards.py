"""Halts (serve/guards.py): the swap guard on a fake /proc/meminfo and a fake clock, an admin's
halt and resume, /health's `halted` and `selftest` array, and the load-time swap check."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from fake_engine import DECISIONS_EXAMPLE, FakeEncoder, ScoringEngine
from goinfer.runtime import selftest
from goinfer.runtime.selftest import SelfTestResult
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig, SwapGuardConfig
from goinfer.serve.guards import HALT, SwapGuard, load_guarded

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
HELLO = [{"role": "user", "content": "hi"}]
KEY = {"Authorization": "Bearer sekret"}


class FakeMeminfo:
    """/proc/meminfo's swap lines, with swap used set by the test (in MB)."""

    def __init__(self, used_mb: float = 100.0, total_mb: int = 8192):
        self.used_mb, self.total_mb = used_mb, total_mb

    def __call__(self) -> str:
        free = int((self.total_mb - self.used_mb) * 1024)
        swap = f"SwapTotal: {self.total_mb * 1024} kB\nSwapFree: {free} kB\n"
        return "MemTotal: 16000000 kB\nMemAvailable: 8000000 kB\n" + swap


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def guard(meminfo: FakeMeminfo, clock: FakeClock, threshold: int | None = 512) -> SwapGuard:
    return SwapGuard(SwapGuardConfig(threshold_mb=threshold, poll_s=3600), meminfo, clock)


# Each generation route with a body it would serve, and how its envelope carries the error.
ROUTES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"model": "fake", "messages": HELLO}, "openai"),
    ("/v1/completions", {"model": "fake", "prompt": "hi"}, "openai"),
    ("/v1/responses", {"model": "fake", "input": "hi"}, "openai"),
    ("/v1/systemone", {**DECISIONS_EXAMPLE, "model": "fake"}, "openai"),
    ("/v1/embeddings", {"model": "enc", "input": "hi"}, "openai"),
    ("/v1/messages", {"model": "fake", "messages": HELLO, "max_tokens": 8}, "anthropic"),
]


async def make_client(aiohttp_client, engine: Any = None, **config: Any):
    engine = engine or ScoringEngine({"Which team": "A", "Is this urgent": "A"})
    cfg = ServeConfig(**{**FAST, "api_key": "sekret", "allow_admin": True, **config})
    app = create_app({"fake": engine}, cfg, encoders={"enc": FakeEncoder()})
    return app, await aiohttp_client(app)


def halted_message(body: dict[str, Any], envelope: str) -> str:
    """The reason, checked to sit in the API's own envelope with the `halted` code readable."""
    if envelope == "openai":
        assert set(body) == {"error"} and body["error"]["code"] == "halted", body
        assert body["error"]["type"] == "service_unavailable"
        message = body["error"]["message"]
    else:
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error", body
        message = body["error"]["message"]
    assert message.startswith("halted: "), message
    return message


async def assert_all_halted(client, why: str) -> None:
    for path, body, envelope in ROUTES:
        resp = await client.post(path, json=body, headers=KEY)
        assert resp.status == 503, (path, await resp.text())
        assert resp.headers["Retry-After"] == "30"
        assert why in halted_message(await resp.json(), envelope), path


async def assert_all_serve(client) -> None:
    for path, body, _ in ROUTES:
        resp = await client.post(path, json=body, headers=KEY)
        assert resp.status == 200, (path, await resp.text())


@pytest.mark.asyncio
async def test_the_swap_guard_trips_and_recovers_only_after_30s_back(aiohttp_client):
    meminfo, clock = FakeMeminfo(100), FakeClock()
    app, client = await make_client(aiohttp_client)
    app[HALT].swap = g = guard(meminfo, clock)
    assert g.describe() == "swap guard: armed, threshold +512 MB over baseline (swap used 100 MB)"
    await assert_all_serve(client)

    meminfo.used_mb = 100 + 600  # grew past +512
    assert g.poll() is not None
    await assert_all_halted(client, "swap guard tripped: swap used grew 600 MB")
    health = await (await client.get("/health", headers=KEY)).json()
    assert health["status"] == "halted" and health["halted"]["by"] == "swap guard"

    meminfo.used_mb = 300  # back within the threshold: the gate stays shut for 30 s
    g.poll()
    clock.now += 29
    assert g.poll() is not None
    await assert_all_halted(client, "swap guard tripped")
    meminfo.used_mb = 700  # over again: the 30 s start over
    clock.now += 5
    g.poll()
    meminfo.used_mb = 300
    g.poll()
    clock.now += 29.9
    assert g.poll() is not None
    clock.now += 0.1
    assert g.poll() is None  # 30 s back within it
    await assert_all_serve(client)
    assert (await (await client.get("/health", headers=KEY)).json())["status"] == "ok"


@pytest.mark.asyncio
async def test_a_running_request_finishes_through_a_trip(aiohttp_client):
    gate = threading.Event()
    engine = ScoringEngine({}, margin=2.0)
    engine.gate = gate
    meminfo, clock = FakeMeminfo(0), FakeClock()
    app, client = await make_client(aiohttp_client, engine)
    app[HALT].swap = g = guard(meminfo, clock)
    running = asyncio.create_task(
        client.post("/v1/chat/completions", json={"model": "fake", "messages": HELLO}, headers=KEY)
    )
    await asyncio.to_thread(engine.started.wait, 5)
    meminfo.used_mb = 2000
    assert g.poll() is not None
    resp = await client.post("/v1/chat/completions", json={"model": "fake", "messages": HELLO}, headers=KEY)
    assert resp.status == 503
    gate.set()
    done = await running
    assert done.status == 200, await done.text()
    assert (await done.json())["choices"][0]["message"]["content"] == "Hello world!"


@pytest.mark.asyncio
async def test_off_disables_the_guard(aiohttp_client):
    meminfo, clock = FakeMeminfo(0), FakeClock()
    g = guard(meminfo, clock, threshold=None)
    assert g.describe() == "swap guard: off (GOINFER_SWAP_GUARD=off)" and not g.armed
    meminfo.used_mb = 5000
    assert g.poll() is None
    app, client = await make_client(aiohttp_client)
    app[HALT].swap = g
    resp = await client.post("/v1/completions", json={"model": "fake", "prompt": "hi"}, headers=KEY)
    assert resp.status == 200


def test_goinfer_swap_guard_parses() -> None:
    assert SwapGuardConfig.parse(None).threshold_mb == 512
    assert SwapGuardConfig.parse("").threshold_mb == 512
    assert SwapGuardConfig.parse("off").threshold_mb is None
    assert SwapGuardConfig.parse("OFF").threshold_mb is None
    assert SwapGuardConfig.parse("2048").threshold_mb == 2048
    for bad in ("-1", "0", "lots", "1.5"):
        with pytest.raises(ValueError, match="GOINFER_SWAP_GUARD"):
            SwapGuardConfig.parse(bad)
    # a system with no swap figures: the guard says it is off rather than arming on nothing
    g = SwapGuard(SwapGuardConfig(), lambda: "MemTotal: 1 kB\n")
    assert not g.armed and "off (no /proc/meminfo swap figures" in g.describe()


@pytest.mark.asyncio
async def test_admin_halt_and_resume(aiohttp_client):
    _app, client = await make_client(aiohttp_client)
    resp = await client.post("/admin/halt", json={"reason": "draining for an upgrade"})
    assert resp.status == 401  # admin routes want the key like every route
    resp = await client.post("/admin/halt", json={"reason": "draining for an upgrade"}, headers=KEY)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["halted"]["by"] == "admin"
    await assert_all_halted(client, "halted by an admin: draining for an upgrade")
    health = await (await client.get("/health", headers=KEY)).json()
    assert health["status"] == "halted"
    assert health["halted"] == {"by": "admin", "reason": "halted by an admin: draining for an upgrade"}
    resp = await client.post("/admin/resume", headers=KEY)
    assert (await resp.json()) == {"resumed": True, "halted": None}
    await assert_all_serve(client)
    # no body at all is a halt with no reason given
    resp = await client.post("/admin/halt", headers=KEY)
    assert resp.status == 200 and "no reason given" in (await resp.json())["halted"]["reason"]


@pytest.mark.asyncio
async def test_health_selftest_is_an_array(aiohttp_client, monkeypatch):
    results = [
        SelfTestResult("cpu", "pass", "avx2", 1.25),
        SelfTestResult(
            "cpu",
            "repaired",
            "avx2",
            2.5,
            [{"kernel": "dotI8", "tier": "avx512-vnni", "observed": 0.1, "allowed": 1e-5}],
            ["avx512-vnni"],
        ),
        SelfTestResult("cuda", "skipped", "sm_90", 0.0, reason="disabled (--no-selftest)"),
    ]
    monkeypatch.setattr(selftest, "RESULTS", results)
    engine = ScoringEngine({})
    engine.info = engine.info.__class__(**{**engine.info.__dict__, "selftest": results[1].to_json()})
    _app, client = await make_client(aiohttp_client, engine)
    health = await (await client.get("/health", headers=KEY)).json()
    assert health["status"] == "ok" and "halted" not in health and health["loading"] == []
    got = health["selftest"]
    assert [(r["backend"], r["status"]) for r in got] == [
        ("cpu", "pass"),
        ("cpu", "repaired"),
        ("cuda", "skipped"),
    ]
    assert all(isinstance(r["elapsed_ms"], float) for r in got)
    assert "mismatches" not in got[0] and "stepped_down" not in got[0]
    assert got[1]["stepped_down"] == ["avx512-vnni"] and got[1]["mismatches"][0]["kernel"] == "dotI8"
    model = health["models"]["fake"]
    assert model["selftest"] == [results[1].to_json()] and model["kind"] == "chat"
    assert health["models"]["enc"]["selftest"] == []  # the fake encoder ran none


def test_a_load_that_makes_swap_grow_is_refused_in_one_line() -> None:
    meminfo, closed = FakeMeminfo(100), []

    def load() -> str:
        meminfo.used_mb = 900
        return "engine"

    with pytest.raises(ValueError) as e:
        load_guarded(
            SwapGuardConfig(), load, "weights 4.00 GiB (mapped) + KV 1.0 GiB", closed.append, meminfo
        )
    msg = str(e.value)
    assert "\n" not in msg and closed == ["engine"]
    assert "swap used grow 800 MB" in msg and "+512 MB" in msg and "weights 4.00 GiB" in msg
    meminfo.used_mb = 100
    assert load_guarded(SwapGuardConfig(), lambda: "ok", "", closed.append, meminfo) == "ok"
    meminfo.used_mb = 100
    off = SwapGuardConfig(threshold_mb=None)
    assert load_guarded(off, load, "", closed.append, meminfo) == "engine"


def test_serve_prints_the_guard_line_and_reads_goinfer_swap_guard(tiny_bundle, monkeypatch) -> None:
    from click.testing import CliRunner
    from goinfer.cli.main import main
    from goinfer.serve import server

    monkeypatch.setattr(server, "run", lambda app, config, ctx: None)

    def serve(env: str):
        args = ["serve", "--model", f"tiny={tiny_bundle('qwen2', 'f32')}", "--no-selftest"]
        return CliRunner().invoke(main, args, env={"GOINFER_API_KEY": "", "GOINFER_SWAP_GUARD": env})

    armed = serve("768")
    assert armed.exit_code == 0, armed.output
    line = next(ln for ln in armed.stdout.splitlines() if "swap guard:" in ln).strip()
    assert line.startswith(
        "swap guard: armed, threshold +768 MB over baseline (swap used "
    ) or line.startswith("swap guard: off (no /proc/meminfo"), line
    assert "fit:" not in armed.stderr  # a model that fits changes nothing, so nothing is said
    off = serve("off")
    assert "swap guard: off (GOINFER_SWAP_GUARD=off)" in off.stdout
    bad = serve("lots")
    assert bad.exit_code == 2 and "GOINFER_SWAP_GUARD='lots'" in bad.stderr
