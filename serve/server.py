"""Starting the server: the exposure rule, TLS, the startup banner, and the run loop."""

from __future__ import annotations

import logging
import ssl
import sys
from collections.abc import Mapping

from aiohttp import web

from .config import BodyCaps, ServeConfig
from .engine import Engine


class ExposureError(ValueError):
    pass


def check_exposure(config: ServeConfig) -> None:
    """Refuse what would put an open API on the network; called before any model loads."""
    if not config.loopback and not config.api_key:
        raise ExposureError(
            f"--addr {config.host}:{config.port} is not loopback: pass --api-key (or set GOINFER_API_KEY) "
            "to serve off this machine"
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


def banner(config: ServeConfig, caps: BodyCaps, engines: Mapping[str, Engine]) -> list[str]:
    lines = [f"goinfer serve: OpenAI base URL {config.base_url}"]
    for name, engine in engines.items():
        i = engine.info
        where = f"quant {i.quant}, target {i.target}, context window {i.context_window}"
        lines.append(f"  model {name}: {i.path} ({where})")
        memory = getattr(engine, "memory_line", None)  # real models; the tests' fakes have no cache
        if memory is not None:
            lines.append(f"    {memory()}")
    lines.append(f"  body caps: {caps.describe()}")
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
            "no API key: any local process or web page can call this server "
            "(pass --api-key or set GOINFER_API_KEY)"
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


def run(app: web.Application, config: ServeConfig, context: ssl.SSLContext | None) -> None:
    web.run_app(app, host=config.host, port=config.port, ssl_context=context, print=None, access_log=None)
