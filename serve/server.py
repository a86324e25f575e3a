"""Starting the server: the exposure rule, TLS, the startup banner, and the run loop."""

from __future__ import annotations

import logging
import ssl
import sys
from collections.abc import Mapping

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from . import embeddings
from .config import BodyCaps, ServeConfig, is_loopback, parse_addr
from .engine import Embedder, Engine


class ExposureError(ValueError):
    pass


def check_exposure(config: ServeConfig) -> None:
    """Refuse what would put an open API on the network; called before any model loads."""
    if not config.loopback and not config.api_key:
        raise ExposureError(
            f"--addr {config.host}:{config.port} is not loopback: pass --api-key (or set GOINFER_API_KEY) "
            "to serve off this machine"
        )
    if config.grpc_addr and not config.api_key and not is_loopback(parse_addr(config.grpc_addr)[0]):
        raise ExposureError(
            f"--grpc-addr {config.grpc_addr} is not loopback: pass --api-key to serve off this machine"
        )
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ExposureError("TLS needs both --tls-cert and --tls-key")


def ssl_context(config: ServeConfig) -> ssl.SSLContext | None:
    if not config.tls:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)  # type: ignore[arg-type]
    except (OSError, ssl.SSLError) as e:
        raise ExposureError(f"cannot load --tls-cert/--tls-key: {e}") from None
    return ctx


def banner(
    config: ServeConfig,
    caps: BodyCaps,
    engines: Mapping[str, Engine],
    encoders: Mapping[str, Embedder] | None = None,
) -> list[str]:
    lines = [f"goinfer serve: OpenAI base URL {config.base_url}"]
    for name, engine in engines.items():
        i = engine.info
        where = f"quant {i.quant}, target {i.target}, context window {i.context_window}"
        lines.append(f"  model {name}: {i.path} ({where})")
        memory = getattr(engine, "memory_line", None)  # real models; the tests' fakes have no cache
        if memory is not None:
            lines.append(f"    {memory()}")
        if i.thinking is not None:  # a thinking model: how --thinking and --reasoning-budget apply to it
            t = config.thinking
            how = f"--thinking {t.mode}, --reasoning-budget {t.budget}"
            lines.append(f"    thinking: {i.thinking.describe()}; {how}")
    for name, e in (encoders or {}).items():
        prompts = ", ".join(f"{k} {v!r}" for k, v in e.prompts.items()) or "none"
        lines.append(
            f"  embedding model {name}: {e.dimensions} dimensions, {e.max_tokens} tokens an input, "
            f"{e.pooling} pooling (quant {e.manifest.quant}, target {embeddings.target(e)}); "
            f"prompts: {prompts}"
        )
    if encoders:
        m = config.embeddings
        lines.append(
            f"  embeddings: a queue of their own, up to {m.max_batch_tokens} tokens a forward across "
            f"requests, {m.max_queue} requests at most"
        )
    if config.grpc_addr:
        lines.append(f"  KServe v2 gRPC on {config.grpc_addr} (REST v2 under /v2 on the HTTP port)")
    lines.append(f"  body caps: {caps.describe()}")
    where = config.batch.dir or "a temporary folder"
    lines.append(
        f"  batches: uploads and batch state under {where} (uploads up to {caps.files // (1 << 20)} MiB); "
        "batch lines run in the room interactive requests leave"
    )
    if config.serves_web:
        lines.append(f"  web page: {config.base_url.removesuffix('/v1')}/ (chat and models; --no-web: off)")
    origins = ", ".join(config.cors_origins) if config.cors_origins else "none"
    lines.append(f"  browser origins allowed besides this server's own: {origins} (admin routes: none)")
    admin = f"on (unload drain wait {config.unload_drain_wait_s:g}s)" if config.allow_admin else "off"
    lines.append(
        f"  concurrency: {config.max_concurrent} generations per model at once, {config.max_queue} waiting; "
        f"admin routes {admin}"
    )
    d = config.sampling
    lines.append(
        f"  sampling where a request sets none: temperature {d.temperature:g}, top_p {d.top_p:g}, "
        f"top_k {d.top_k}, min_p {d.min_p:g}"
    )
    lines += [f"WARNING: {w}" for w in warnings(config)]
    return lines


def warnings(config: ServeConfig) -> list[str]:
    out = []
    if not config.api_key:
        out.append(
            "no API key: any local process can call this server, and so can web pages from the origins "
            "--cors-origin allows (pass --api-key or set GOINFER_API_KEY)"
        )
    if not config.loopback and not config.tls:
        out.append(
            "serving off loopback without TLS: the key and every prompt travel in plaintext "
            "(pass --tls-cert/--tls-key or put a TLS proxy in front)"
        )
    return out


def log_to_stderr() -> None:
    """goinfer's own log lines (one per finished request, loads, warnings) on stderr, timestamped;
    other libraries' stay at Python's default (warnings only)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("goinfer")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


class HTTPLog(logging.LoggerAdapter):
    """aiohttp's server logger, with a request that is not valid HTTP (a control byte in a header,
    an 8 KiB line, a body its Content-Encoding does not decode) logged as one line: aiohttp has
    answered it 400 (or the route has, and aiohttp meets the bad body again draining it), and it
    is the client's error, not a traceback's worth."""

    def exception(self, msg: object, *args: object, exc_info: object = True, **kw: object) -> None:
        if isinstance(exc_info, (HttpProcessingError, web.RequestPayloadError)):
            text = getattr(exc_info, "message", None) or str(exc_info)  # RequestPayloadError has none
            why = " ".join(line.strip() for line in str(text).splitlines() if line.strip())
            self.warning(
                "%s: %s: %s", msg % args, type(exc_info).__name__, why.removeprefix("400, message: ")[:300]
            )
        else:
            super().exception(msg, *args, exc_info=exc_info, **kw)


def http_log() -> HTTPLog:
    return HTTPLog(logging.getLogger("aiohttp.server"))


def run(app: web.Application, config: ServeConfig, context: ssl.SSLContext | None) -> None:
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        ssl_context=context,
        print=None,
        access_log=None,
        logger=http_log(),
    )
