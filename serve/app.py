"""The aiohttp application: `create_app(engines, config, encoders=...)`.

Engines (decoders) and encoders are given already loaded, keyed by the name requests route on;
tests pass fake ones. Either may be empty: a server may only generate, or only embed.
The root app serves the OpenAI routes; the Anthropic routes and the admin routes are sub-apps,
each with its own error middleware (the envelope its clients expect).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping

from aiohttp import web

from . import (
    admin,
    batch_anthropic,
    batch_routes,
    batches,
    decisions,
    embeddings,
    files,
    messages,
    metrics,
    pulls,
    responses,
    routes,
    webpage,
)
from .config import BodyCaps, ServeConfig
from .engine import Embedder, Engine
from .errors import openai_envelope
from .guards import HALT, Halt, SwapGuard, monitor
from .keys import CALIBRATION, CAPS, CONFIG, LOADER, REGISTRY, RESPONSES, STARTED, Loader
from .kserve import rest as kserve_rest
from .middleware import SAME_ORIGIN_ONLY, cors_headers, embedding_routes, guards, text_routes
from .registry import Registry

log = logging.getLogger("goinfer.serve")


def create_app(
    engines: Mapping[str, Engine],
    config: ServeConfig | None = None,
    loader: Loader | None = None,
    encoders: Mapping[str, Embedder] | None = None,
    puller: pulls.Puller | None = None,
) -> web.Application:
    config = config or ServeConfig()
    caps = BodyCaps.resolve(config.max_body_bytes, [e.info.context_window for e in engines.values()])
    # aiohttp's own cap sits above ours, so ours (with its clearer message) is the one that fires.
    app = web.Application(
        middlewares=guards(openai_envelope),
        client_max_size=caps.largest + 1,
    )
    registry = Registry(config.max_queue, config.max_concurrent)
    for name, engine in engines.items():
        registry.add(name, engine)
    for name, encoder in (encoders or {}).items():
        registry.add_encoder(name, encoder, config.embeddings)
    app[CONFIG], app[REGISTRY] = config, registry
    app[HALT] = halt = Halt(SwapGuard(config.swap_guard))
    registry.check_halt = halt.check  # every generation route routes through the registry
    app[LOADER] = loader
    app[pulls.PULLER], app[pulls.PULLS] = puller, pulls.Pulls()  # the Models tab's pulls and builds
    app[STARTED] = int(time.time())
    app[RESPONSES] = responses.ResponseStore(config.responses_store)
    app[CALIBRATION] = decisions.load_calibration(config.decisions_calibration, config.decisions_template)
    app.add_routes(routes.routes)
    app.add_routes(responses.routes)
    app.add_routes(decisions.routes)
    app.add_routes(embeddings.routes)
    app.add_routes(kserve_rest.routes)  # /v2: KServe v2 REST and Triton's generate extension
    metrics.install(app, config)  # GET /metrics here, or on --metrics-addr
    # /v1/files, /v1/batches, /v1/messages/batches: on disk under --batch-dir, run by one worker task
    app[batches.BATCHES], tmp = batches.make(config, registry)
    app.add_routes(batch_routes.routes)
    anthropic = messages.app()
    anthropic.add_routes(batch_anthropic.routes)
    app.add_subapp(messages.PREFIX, anthropic)
    if config.allow_admin:
        sub = admin.app()
        sub[SAME_ORIGIN_ONLY] = True  # no --cors-origin opens loading and unloading to a web page
        sub.add_routes(pulls.admin_routes)  # plan, pull and build (serve/pulls.py)
        app.add_subapp(admin.PREFIX, sub)
    if config.serves_web:  # the chat page and its Models tab (serve/webpage.py)
        app.add_routes(webpage.page_routes)
        app.add_subapp(webpage.PREFIX, webpage.app())
    capped = {"text_routes": text_routes(app), "embedding_routes": embedding_routes(app)}
    capped["files"] = config.batch.max_file_bytes + files.ENVELOPE_SLACK
    app[CAPS] = dataclasses.replace(caps, **capped)  # the banner names them
    app.on_response_prepare.append(cors_headers)  # every app's responses pass the root's signal
    app.cleanup_ctx.append(_close_models)
    app.cleanup_ctx.append(monitor)  # the swap guard's poll loop
    app.cleanup_ctx.append(batches.remove_later(tmp))
    app.cleanup_ctx.append(batches.running)  # stopped first: no batch line outlives the models
    return app


async def _close_models(app: web.Application) -> AsyncIterator[None]:
    yield
    for slot in app[REGISTRY].slots.values():
        await asyncio.to_thread(slot.close)  # stopping a scheduler may write its sessions to disk
    for encoder in app[REGISTRY].encoders.values():
        await asyncio.to_thread(encoder.close)  # waits for the forward it may be running
