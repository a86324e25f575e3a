"""Admin routes, an aiohttp sub-app mounted at /admin only with --allow-admin (a load reads a path
the caller names).

POST /admin/models/load   {"path", "name"?, "quant"?}  -> 200 once the model serves
POST /admin/models/unload {"name"}                     -> 200 drained and freed within
    --unload-drain-wait, else 202 (unroutable already; freed when its last request ends)
POST /admin/halt {"reason"?}  -> 200: generation routes answer 503 `halted` (guards.py) until
POST /admin/resume            -> 200; running requests finish either way
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from aiohttp import web

from .errors import APIError, bad_request, openai_envelope
from .guards import HALT
from .keys import CONFIG, LOADER, REGISTRY, STARTED
from .middleware import Body, body_cap_for, guards, parse, read_body, read_request
from .registry import ModelSlot
from .routes import model_entry

PREFIX = "/admin"
log = logging.getLogger("goinfer.serve")
routes = web.RouteTableDef()
DRAINING = web.AppKey("draining", set)  # background frees, kept referenced until done


def app() -> web.Application:
    """The sub-app, mounted at PREFIX, with its own error middleware (OpenAI's envelope)."""
    sub = web.Application(middlewares=guards(openai_envelope))
    sub[DRAINING] = set()
    sub.add_routes(routes)
    return sub


class LoadRequest(Body):
    name: str | None = None
    path: str
    quant: str | None = None


class UnloadRequest(Body):
    name: str


class HaltRequest(Body):
    reason: str | None = None


@routes.post("/models/load")
async def load(request: web.Request) -> web.Response:
    state = request.config_dict  # the root app's, seen from this sub-app
    req: LoadRequest = await read_request(request, LoadRequest)
    reg, loader = state[REGISTRY], state[LOADER]
    if loader is None:
        raise APIError(503, "this server was started without a model loader", code="no_loader")
    name = req.name or Path(req.path).stem
    if name in reg.slots or name in reg.encoders or name in reg.loading:
        raise bad_request(f"model {name!r} is already loaded or loading; unload it first", param="name")
    reg.loading.add(name)
    try:
        engine = await asyncio.to_thread(loader, name, req.path, req.quant)
    except (OSError, ValueError) as e:  # bad path, bad bundle, refused build: the loader's one-line reason
        raise bad_request(f"cannot load {req.path!r}: {e}", param="path", code="load_failed") from None
    finally:
        reg.loading.discard(name)
    slot = reg.add(name, engine)
    log.info("loaded %s from %s", name, req.path)
    return web.json_response({"loaded": model_entry(slot, state[STARTED])})


@routes.post("/models/unload")
async def unload(request: web.Request) -> web.Response:
    req: UnloadRequest = await read_request(request, UnloadRequest)
    slot = request.config_dict[REGISTRY].remove(req.name)
    try:
        await asyncio.wait_for(slot.idle.wait(), request.config_dict[CONFIG].unload_drain_wait_s)
    except asyncio.TimeoutError:
        task = asyncio.create_task(_free_when_idle(slot))
        draining = request.app[DRAINING]
        draining.add(task)
        task.add_done_callback(draining.discard)
        return web.json_response(
            {"unloaded": req.name, "freed": False, "in_flight": slot.admitted}, status=202
        )
    await asyncio.to_thread(slot.close)  # stopping the scheduler may write its sessions to disk
    return web.json_response({"unloaded": req.name, "freed": True})


async def _free_when_idle(slot: ModelSlot) -> None:
    await slot.idle.wait()
    await asyncio.to_thread(slot.close)
    log.info("freed %s after its last request", slot.name)


@routes.post("/halt")
async def halt(request: web.Request) -> web.Response:
    raw = await read_body(request, body_cap_for(request))  # optional: no body is no reason
    req = parse(HaltRequest, raw) if raw.strip() else HaltRequest()
    state = request.config_dict[HALT]
    state.admin = f"halted by an admin: {req.reason or 'no reason given'}"
    log.warning("%s", state.admin)
    return web.json_response({"halted": state.health()})


@routes.post("/resume")
async def resume(request: web.Request) -> web.Response:
    state = request.config_dict[HALT]
    was, state.admin = state.admin, None
    if was is not None:
        log.info("resumed by an admin")
    # a tripped swap guard still holds: the answer says so
    return web.json_response({"resumed": was is not None, "halted": state.health()})
