"""GET /metrics: Prometheus figures per model, named like vLLM's (`goinfer:` for `vllm:`).

Where each number comes from:
- per request (histograms, token counters, finish reasons): `Metrics.watch` wraps the engine's
  token events on the model's worker thread (pipeline.py), so a request is seen whichever API spelled
  it; its prompt, cached and generated counts are the very ones its usage reports.
- at scrape time (`_Scraped`): requests running and waiting from the registry's slots, 429s and 503s
  from `Registry.refusals`, the KV cache's pages and warm sessions from `Engine.stats()`, preemptions
  and speculative drafts from the scheduler's read-only totals, embeddings from each EncoderSlot.

Each app has its own CollectorRegistry (never prometheus_client's global one), so apps made side by
side in tests do not collide. The route sits behind --api-key like every route; `--metrics-addr`
serves it on a port of its own instead (`apart`): open there when that port is bound to loopback
(a local agent scrapes it), behind the key otherwise.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from importlib import metadata

from aiohttp import web
from goinfer.runtime.decode import StepEvent
from goinfer.runtime.scheduler import Cancelled
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .config import ServeConfig, is_loopback, parse_addr
from .errors import APIError
from .keys import CAPS, CONFIG, REGISTRY
from .registry import Registry

PREFIX = "goinfer:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets, so dashboards built for it read these the same way
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


# A generation's observer: (the engine's events, prompt tokens, the run's cancel flag) -> the same events
Watch = Callable[[Iterator[StepEvent], int, "threading.Event | None"], Iterator[StepEvent]]


def version() -> str:
    try:
        return metadata.version("goinfer")
    except metadata.PackageNotFoundError:
        return "unknown"


class Metrics:
    """One app's metrics: the per-request families, and a collector that reads the rest at scrape."""

    def __init__(self, registry: Registry):
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, m, registry=r, buckets=buckets)

        def count(name: str, doc: str, labels: list[str] = m) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "From arrival to the first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Between consecutive tokens of a reply.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "From arrival to the last token.", REQUEST_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds", "From admission to the model's worker taking it.", REQUEST_BUCKETS
        )
        self.prefill = hist(
            "request_prefill_time_seconds", "From the worker taking it to the first token.", REQUEST_BUCKETS
        )
        self.decode = hist("request_decode_time_seconds", "First token to last.", REQUEST_BUCKETS)
        self.prompt = count("prompt_tokens", "Prompt tokens of prefilled requests (usage.prompt_tokens).")
        self.generated = count("generation_tokens", "Tokens generated (usage.completion_tokens).")
        self.queries = count("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.hits = count("prefix_cache_hits", "Prompt tokens found in the prefix cache (cached_tokens).")
        self.finished = count(
            "request_success", "Generations ended, by finish reason (stop, length, abort, error).",
            ["model", "finished_reason"],
        )  # fmt: skip
        self.scraped = _Scraped(registry)
        r.register(self.scraped)

    def add(self, model: str) -> None:
        """Zero the served model's counters, so rate() has a start before its first request."""
        for family in (self.prompt, self.generated, self.queries, self.hits):
            family.labels(model)

    def watch(self, model: str, arrived: float) -> Watch:
        """A generation's observer, made as it is admitted; `arrived`: perf_counter at the request."""
        admitted = time.perf_counter()
        return lambda events, prompt_tokens, cancel=None: self._watched(
            events, model, arrived, admitted, prompt_tokens, cancel
        )

    def _watched(
        self,
        events: Iterator[StepEvent],
        model: str,
        arrived: float,
        admitted: float,
        prompt_tokens: int,
        cancel: threading.Event | None,
    ) -> Iterator[StepEvent]:
        """The engine's events, passed through (on the model's worker thread) and timed."""
        start = time.perf_counter()
        self.queue.labels(model).observe(start - admitted)
        first = last = None
        n = cached = 0
        prefilled = False
        finish = "stop"  # closed early by the reply: a stop string or a tool call's end
        try:
            for ev in events:
                cached = int(ev.timings.get("cached_tokens", cached))
                if ev.token_id is None:
                    finish, prefilled = ev.finish_reason or "stop", True
                else:
                    t = time.perf_counter()
                    if last is None:
                        first, prefilled = t, True
                        self.ttft.labels(model).observe(t - arrived)
                        self.prefill.labels(model).observe(t - start)
                    else:
                        self.itl.labels(model).observe(t - last)
                    last, n = t, n + 1
                yield ev
        except Cancelled:
            finish = "abort"
            raise
        except Exception:  # KVCacheFull (counted as a 503 by the registry too), a failed forward
            finish = "error"
            raise
        except GeneratorExit:
            if cancel is not None and cancel.is_set():
                finish = "abort"  # the client left
            raise
        finally:
            end = time.perf_counter()
            if prefilled:
                self.prompt.labels(model).inc(prompt_tokens)
                self.queries.labels(model).inc(prompt_tokens)
                self.hits.labels(model).inc(cached)
            self.generated.labels(model).inc(n)
            if first is not None and last is not None:
                self.decode.labels(model).observe(last - first)
            self.e2e.labels(model).observe(end - arrived)
            self.finished.labels(model, finish).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Scraped(Collector):
    """What is read at scrape time from the registry, the engines and the encoders."""

    def __init__(self, registry: Registry):
        self.r = registry

    def describe(self) -> list[Metric]:
        return []  # families vary with what is loaded; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        slots, encoders = dict(self.r.slots), dict(self.r.encoders)  # admin may load or unload meanwhile

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ("model",)) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))

        def counter(name: str, doc: str, labels: tuple[str, ...] = ("model",)) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, labels=list(labels))

        running = gauge("num_requests_running", "Generations running on the model's workers.")
        waiting = gauge("num_requests_waiting", "Generations admitted and waiting for a worker.")
        used = gauge("kv_cache_pages_used", "KV cache pages in use (running and warm sequences).")
        free = gauge("kv_cache_pages_free", "KV cache pages free.")
        usage = gauge("kv_cache_usage_perc", "KV cache pages in use, as a fraction (0 to 1).")
        warm = gauge("warm_sessions", "Finished conversations kept warm in the KV cache for reuse.")
        preempt = counter("num_preemptions", "Generations preempted (KV dropped, recomputed) for room.")
        drafted = counter("spec_decode_num_draft_tokens", "Tokens drafted by speculation (--spec/--drafter).")
        accepted = counter("spec_decode_num_accepted_tokens", "Drafted tokens the model accepted.")
        for name, slot in slots.items():
            running.add_metric([name], min(slot.admitted, slot.max_concurrent))
            waiting.add_metric([name], max(0, slot.admitted - slot.max_concurrent))
            stats = slot.engine.stats()
            if "pages_used" in stats:
                total = stats["pages_used"] + stats["pages_free"]
                used.add_metric([name], stats["pages_used"])
                free.add_metric([name], stats["pages_free"])
                usage.add_metric([name], stats["pages_used"] / total if total else 0.0)
                warm.add_metric([name], stats.get("sessions_warm", 0))
            scheduler = getattr(slot.engine, "scheduler", None)  # real engines; the tests' fakes have none
            if scheduler is not None:
                preempt.add_metric([name], getattr(scheduler, "preemptions", 0))
                if scheduler.config.spec != "off" or scheduler.draft is not None:
                    drafted.add_metric([name], getattr(scheduler, "drafted", 0))
                    accepted.add_metric([name], getattr(scheduler, "accepted", 0))
        yield from (running, waiting, used, free, usage, warm, preempt, drafted, accepted)

        refused = counter(
            "requests_rejected", "Requests refused: 429 (queue full), 503 (KV cache full, loading, ...).",
            ("model", "code", "reason"),
        )  # fmt: skip
        for (model, code, reason), n in list(self.r.refusals.items()):
            refused.add_metric([model, str(code), reason], n)
        yield refused

        emb_requests = counter("embedding_requests", "Embeddings requests answered.")
        emb_inputs = counter("embedding_inputs", "Inputs embedded.")
        emb_tokens = counter("embedding_tokens", "Tokens embedded (special tokens included).")
        for name, enc in encoders.items():
            emb_requests.add_metric([name], enc.answered)
            emb_inputs.add_metric([name], enc.inputs_embedded)
            emb_tokens.add_metric([name], enc.tokens_embedded)
        yield from (emb_requests, emb_inputs, emb_tokens)

        info = gauge(
            "build_info", "1 per model: goinfer's version, the bundle's target and quant, the CPU tier.",
            ("version", "model", "kind", "target", "quant", "cpu_tier"),
        )  # fmt: skip
        v = version()
        for name, slot in slots.items():
            i = slot.engine.info
            info.add_metric([v, name, "decoder", i.target, i.quant, _tier(i.target)], 1)
        for name, enc in encoders.items():
            e = enc.encoder
            target = f"llvm/{e.tier}" if e.device in ("cpu", "llvm") and e.tier else str(e.device)
            info.add_metric([v, name, "encoder", target, str(e.manifest.quant), _tier(target)], 1)
        yield info


def _tier(target: str) -> str:
    """'llvm/avx512' -> 'avx512'; '' for a GPU target."""
    kind, _, tier = target.partition("/")
    return tier if kind == "llvm" else ""


# -- the route, on the API's port or on its own ---------------------------------------------------
METRICS = web.AppKey("metrics", Metrics)


async def scrape(request: web.Request) -> web.Response:
    body = request.config_dict[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def install(app: web.Application, config: ServeConfig) -> None:
    """/metrics on the API's port, or (--metrics-addr) on a port of its own started with the app."""
    registry = app[REGISTRY]
    metrics = Metrics(registry)
    for name in registry.slots:
        metrics.add(name)
    app[METRICS] = metrics
    registry.check_halt = _counted(registry.check_halt, registry)
    if config.metrics_addr is None:
        app.router.add_get("/metrics", scrape)
    else:
        app.cleanup_ctx.append(apart)


def _counted(check: Callable[[], None], registry: Registry) -> Callable[[], None]:
    """The halt check (guards.py), its 503s counted; a halt is the server's, so model="*"."""

    def counted() -> None:
        try:
            check()
        except APIError as e:
            registry.refusals[("*", e.status, e.code or "halted")] += 1
            raise

    return counted


def describe(config: ServeConfig) -> str:
    """The banner's line."""
    if config.metrics_addr is None:
        key = " (behind the API key)" if config.api_key else ""
        return f"metrics: GET /metrics on this port{key}"
    own = metrics_config(config)
    key = "behind the API key" if own.api_key else "open on loopback"
    return f"metrics: GET /metrics on {own.host}:{own.port} only ({key})"


def metrics_config(config: ServeConfig) -> ServeConfig:
    """The metrics port's own settings: its address, and no key when it is bound to loopback.
    A ValueError (for the CLI, before any model loads) when it is not loopback and has no key."""
    assert config.metrics_addr is not None
    try:
        host, port = parse_addr(config.metrics_addr)
    except ValueError:
        raise ValueError(
            f"--metrics-addr {config.metrics_addr!r}: expected HOST:PORT, e.g. 127.0.0.1:9464"
        ) from None
    if not is_loopback(host) and not config.api_key:
        raise ValueError(
            f"--metrics-addr {host}:{port} is not loopback: pass --api-key (Prometheus sends it as a "
            "bearer token) or bind it to 127.0.0.1"
        )
    key = None if is_loopback(host) else config.api_key
    return dataclasses.replace(config, host=host, port=port, api_key=key, cors_origins=())


async def apart(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: /metrics on --metrics-addr for as long as the app runs, with the same guards
    (error envelope, origin check, key where one applies) as the API's routes."""
    from .errors import openai_envelope
    from .middleware import guards
    from .server import ssl_context

    config = app[CONFIG]
    own = metrics_config(config)
    side = web.Application(middlewares=guards(openai_envelope))
    side[CONFIG], side[CAPS], side[METRICS] = own, app[CAPS], app[METRICS]
    side.router.add_get("/metrics", scrape)
    runner = web.AppRunner(side, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, own.host, own.port, ssl_context=ssl_context(config)).start()
    try:
        yield
    finally:
        await runner.cleanup()
