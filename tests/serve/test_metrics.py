"""GET /metrics (serve/metrics.py), scraped with prometheus_client's own parser after real requests
on the fake engines: the counts move as the replies' usage says, refusals are counted by reason,
each histogram gets one observation a request, and the route keeps the key (or its own port)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner
from fake_engine import FakeEncoder, ScriptedEngine
from goinfer.cli.main import main
from goinfer.runtime.decode import GenerationRequest, StepEvent
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from goinfer.serve.metrics import metrics_config
from prometheus_client.parser import text_string_to_metric_families
from serve_process import free_port, serving

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
)


class CachingEngine(ScriptedEngine):
    """ScriptedEngine whose events carry cached_tokens as a real scheduler's do: the prompt's shared
    prefix with the previous one (a warm session)."""

    def generate(
        self, request: GenerationRequest, cancel: threading.Event | None = None
    ) -> Iterator[StepEvent]:
        ids = list(request.prompt_ids)
        before = self.prompts[-1] if self.prompts else []
        shared = min(len(before), len(ids))
        cached = next((i for i in range(shared) if before[i] != ids[i]), shared)
        counts = {"prompt_tokens": len(ids), "cached_tokens": cached}
        for ev in super().generate(request, cancel):
            yield StepEvent(ev.token_id, ev.text, ev.logprob, ev.finish_reason, counts, ev.top_logprobs)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape: (sample name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(scrape: dict, name: str, **labels: str) -> float:
    return scrape.get(("goinfer:" + name, tuple(sorted(labels.items()))), 0.0)


async def scrape(client, **headers: str) -> dict:
    resp = await client.get("/metrics", headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/plain")
    return samples(await resp.text())


async def client_for(
    aiohttp_client, engines: dict | None = None, encoders: dict | None = None, **config: Any
):
    engines = {"fake": ScriptedEngine()} if engines is None else engines
    app = create_app(engines, ServeConfig(**{**FAST, **config}), encoders=encoders)
    return await aiohttp_client(app)


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **kw}


@pytest.mark.asyncio
async def test_token_counts_are_the_usage_and_each_request_is_observed_once(aiohttp_client) -> None:
    client = await client_for(aiohttp_client)
    before = await scrape(client)
    assert before[("goinfer:prompt_tokens_total", (("model", "fake"),))] == 0  # there before any request
    usages = []
    resp = await client.post("/v1/chat/completions", json=chat("hi"))
    usages.append((await resp.json())["usage"])
    resp = await client.post(
        "/v1/chat/completions", json=chat("hello there", stream=True, stream_options={"include_usage": True})
    )
    lines = [x for x in (await resp.text()).split("\n\n") if x.startswith("data: {")]
    usages.append(json.loads(lines[-1][6:])["usage"])
    resp = await client.post("/v1/completions", json={"model": "fake", "prompt": "abc", "max_tokens": 3})
    usages.append((await resp.json())["usage"])

    got = await scrape(client)
    assert value(got, "prompt_tokens_total", model="fake") == sum(u["prompt_tokens"] for u in usages)
    assert value(got, "prefix_cache_queries_total", model="fake") == sum(u["prompt_tokens"] for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert value(got, "generation_tokens_total", model="fake") == sum(completion) == 5 + 5 + 3
    for name in HISTOGRAMS:
        assert value(got, name + "_count", model="fake") == 3, name
        assert value(got, name + "_sum", model="fake") >= 0
    assert value(got, "inter_token_latency_seconds_count", model="fake") == sum(c - 1 for c in completion)
    assert value(got, "request_success_total", model="fake", finished_reason="stop") == 2
    assert value(got, "request_success_total", model="fake", finished_reason="length") == 1
    assert value(got, "num_requests_running", model="fake") == 0
    info = [k for k in got if k[0] == "goinfer:build_info"]
    assert len(info) == 1 and dict(info[0][1])["quant"] == "f32" and dict(info[0][1])["model"] == "fake"


@pytest.mark.asyncio
async def test_cached_tokens_after_a_second_turn_are_the_usage_field(aiohttp_client) -> None:
    client = await client_for(aiohttp_client, {"fake": CachingEngine(context_window=256)})
    turn = [{"role": "user", "content": "what is the weather?"}]
    ask = lambda: client.post("/v1/chat/completions", json={"model": "fake", "messages": turn})  # noqa: E731
    first = await (await ask()).json()
    turn += [first["choices"][0]["message"], {"role": "user", "content": "and tomorrow?"}]
    second = await (
        await client.post("/v1/chat/completions", json={"model": "fake", "messages": turn})
    ).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    got = await scrape(client)
    assert value(got, "prefix_cache_hits_total", model="fake") == cached
    prompts = first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    assert value(got, "prefix_cache_queries_total", model="fake") == prompts


@pytest.mark.asyncio
async def test_a_429_is_counted_by_reason_and_the_running_gauge_moves(aiohttp_client) -> None:
    gate = threading.Event()
    engine = ScriptedEngine(gate=gate)
    client = await client_for(aiohttp_client, {"fake": engine}, max_concurrent=1, max_queue=0)
    held = asyncio.ensure_future(client.post("/v1/chat/completions", json=chat("hi")))
    await asyncio.to_thread(engine.started.wait, 10)
    busy = await client.post("/v1/chat/completions", json=chat("hi"))
    assert busy.status == 429
    got = await scrape(client)
    assert value(got, "requests_rejected_total", model="fake", code="429", reason="queue_full") == 1
    assert value(got, "num_requests_running", model="fake") == 1
    assert value(got, "num_requests_waiting", model="fake") == 0
    gate.set()
    assert (await held).status == 200
    got = await scrape(client)
    assert value(got, "num_requests_running", model="fake") == 0
    assert value(got, "e2e_request_latency_seconds_count", model="fake") == 1  # the refused one is not


@pytest.mark.asyncio
async def test_a_halt_is_counted_as_a_503_by_reason(aiohttp_client) -> None:
    client = await client_for(aiohttp_client, allow_admin=True)
    assert (await client.post("/admin/halt", json={"reason": "upgrade"})).status == 200
    assert (await client.post("/v1/chat/completions", json=chat("hi"))).status == 503
    got = await scrape(client)
    assert value(got, "requests_rejected_total", model="*", code="503", reason="halted") == 1


@pytest.mark.asyncio
async def test_embeddings_are_counted_per_encoder(aiohttp_client) -> None:
    enc = FakeEncoder()
    client = await client_for(aiohttp_client, {}, {"enc": enc})
    resp = await client.post("/v1/embeddings", json={"model": "enc", "input": ["one", "three"]})
    assert resp.status == 200
    tokens = (await resp.json())["usage"]["prompt_tokens"]
    got = await scrape(client)
    assert value(got, "embedding_requests_total", model="enc") == 1
    assert value(got, "embedding_inputs_total", model="enc") == 2
    assert value(got, "embedding_tokens_total", model="enc") == tokens == len("one") + len("three") + 4
    assert any(k[0] == "goinfer:build_info" and ("kind", "encoder") in k[1] for k in got)


@pytest.mark.asyncio
async def test_the_key_is_required_and_two_apps_keep_their_own_figures(aiohttp_client) -> None:
    client = await client_for(aiohttp_client, api_key="sekret")
    assert (await client.get("/metrics")).status == 401
    assert (await client.get("/metrics", headers={"Authorization": "Bearer wrong"})).status == 401
    auth = {"Authorization": "Bearer sekret"}
    assert (await client.post("/v1/chat/completions", json=chat("hi"), headers=auth)).status == 200
    other = await client_for(aiohttp_client)  # a second app: its own registry, nothing seen yet
    assert value(await scrape(client, **auth), "e2e_request_latency_seconds_count", model="fake") == 1
    assert value(await scrape(other), "e2e_request_latency_seconds_count", model="fake") == 0


@pytest.mark.asyncio
async def test_metrics_addr_serves_on_its_own_port(aiohttp_client) -> None:
    port = free_port()
    client = await client_for(aiohttp_client, api_key="sekret", metrics_addr=f"127.0.0.1:{port}")
    auth = {"Authorization": "Bearer sekret"}
    assert (await client.get("/metrics", headers=auth)).status == 404  # moved, not doubled
    assert (await client.post("/v1/chat/completions", json=chat("hi"), headers=auth)).status == 200
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as resp:
        assert resp.status == 200  # loopback: a local agent scrapes without the key
        got = samples(await resp.text())
    assert value(got, "generation_tokens_total", model="fake") == 5


def test_metrics_addr_off_loopback_needs_the_key() -> None:
    with pytest.raises(ValueError, match="not loopback"):
        metrics_config(ServeConfig(metrics_addr="0.0.0.0:9464"))
    with pytest.raises(ValueError, match="HOST:PORT"):
        metrics_config(ServeConfig(metrics_addr="nonsense"))
    assert metrics_config(ServeConfig(metrics_addr="0.0.0.0:9464", api_key="k")).api_key == "k"
    assert metrics_config(ServeConfig(metrics_addr="127.0.0.1:9464", api_key="k")).api_key is None


def test_serve_refuses_an_open_metrics_port_off_loopback_before_loading() -> None:
    args = ["serve", "--model", "nowhere.giw", "--metrics-addr", "0.0.0.0:9464"]
    result = CliRunner().invoke(main, args, env={"GOINFER_API_KEY": ""})
    assert result.exit_code != 0 and "--metrics-addr 0.0.0.0:9464 is not loopback" in result.output


@pytest.mark.slow
def test_real_model_second_turn_cache_hits_are_the_usage_field(real_bundle) -> None:
    key = "test-key"
    with serving("qwen", real_bundle("qwen2.5-coder-0.5b", "gguf"), key) as url:

        def post(messages: list[dict[str, Any]]) -> dict[str, Any]:
            body = {"messages": messages, "max_tokens": 8, "temperature": 0}
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
            req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), headers)
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.loads(r.read())

        def metrics() -> dict:
            req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                return samples(r.read().decode())

        turn = [{"role": "user", "content": "Name three colours."}]
        first = post(turn)
        after_first = value(metrics(), "prefix_cache_hits_total", model="qwen")
        turn += [first["choices"][0]["message"], {"role": "user", "content": "And three more?"}]
        second = post(turn)
        got = metrics()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0
        assert value(got, "prefix_cache_hits_total", model="qwen") - after_first == cached
        used = [first["usage"], second["usage"]]
        assert value(got, "prompt_tokens_total", model="qwen") == sum(u["prompt_tokens"] for u in used)
        assert value(got, "generation_tokens_total", model="qwen") == sum(
            u["completion_tokens"] for u in used
        )
        assert value(got, "kv_cache_pages_used", model="qwen") > 0
        assert value(got, "warm_sessions", model="qwen") >= 1
