"""The web page (`goinfer serve --web`, on by default on loopback): a chat tab and a Models tab.

GET /                        the page (serve/web/index.html)
GET /web/assets/{name}       its stylesheet and ES modules, served from the package: no build step,
                             no CDN, so it works offline
GET /web/status              what the page may offer: admin routes on, a puller, a loader
GET /web/models/catalog      the zoo's models, and the quants a checkpoint builds as
GET /web/models/cache        the "On disk" card: what the pull and bundle caches hold (`goinfer cache`)

The page and its files need no key (a browser navigating has no header to send one, and they hold
no data); everything they call does, as any client. The page talks to the same routes as any
client: /v1/models and /v1/chat/completions for the chat, /health and the admin routes
(serve/admin.py, serve/pulls.py) for the Models tab. The /web sub-app answers only its own origin,
as the admin routes do, and the page forbids framing and foreign scripts (its Content-Security-Policy).
"""

from __future__ import annotations

import asyncio
from functools import cache
from pathlib import Path

from aiohttp import web

from .errors import APIError, openai_envelope
from .keys import CONFIG, LOADER
from .middleware import SAME_ORIGIN_ONLY, guards, public
from .pulls import PULLER, PULLS, puller_of

PREFIX = "/web"
FILES = Path(__file__).with_name("web")
TYPES = {
    ".html": "text/html",
    ".css": "text/css",
    ".js": "text/javascript",
    ".svg": "image/svg+xml",
    ".txt": "text/plain",
}
# Everything from this origin, nothing inline, never framed (an admin button under a foreign page's
# overlay is a click the user did not mean).
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated each load: a new version shows at once
}

page_routes = web.RouteTableDef()  # on the root app
routes = web.RouteTableDef()  # on the /web sub-app


@cache
def assets() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, content type): the page's files, read once; only these are ever served."""
    found = {}
    for path in sorted(FILES.iterdir()):
        kind = TYPES.get(path.suffix)
        if kind is not None and path.is_file():
            found[path.name] = (path.read_bytes(), f"{kind}; charset=utf-8")
    return found


def _file(name: str) -> web.Response:
    entry = assets().get(name)
    if entry is None:
        raise APIError(404, f"no file {name!r} in the web page's assets", code="not_found")
    body, kind = entry
    return web.Response(body=body, headers={**HEADERS, "Content-Type": kind})


def app() -> web.Application:
    """The sub-app mounted at PREFIX, with its own error middleware (OpenAI's envelope)."""
    sub = web.Application(middlewares=guards(openai_envelope))
    sub[SAME_ORIGIN_ONLY] = True  # no --cors-origin opens the Models tab's routes to another page
    sub.add_routes(routes)
    return sub


@page_routes.get("/")
@public
async def page(_request: web.Request) -> web.Response:
    return _file("index.html")


@routes.get("/assets/{name}")
@public
async def asset(request: web.Request) -> web.Response:
    return _file(request.match_info["name"])


@routes.get("/status")
async def status(request: web.Request) -> web.Response:
    state = request.config_dict
    return web.json_response(
        {
            "admin": state[CONFIG].allow_admin,  # pull, build, load, unload: --allow-admin
            "puller": state.get(PULLER) is not None,
            "loader": state.get(LOADER) is not None,
            "key": bool(state[CONFIG].api_key),
            "pull": {"ref": job.ref, "done": job.done} if (job := state[PULLS].job) is not None else None,
        }
    )


@routes.get("/models/catalog")
async def catalog(request: web.Request) -> web.Response:
    return web.json_response(await asyncio.to_thread(puller_of(request).catalog))


@routes.get("/models/cache")
async def on_disk(request: web.Request) -> web.Response:
    entries = await asyncio.to_thread(puller_of(request).on_disk)
    return web.json_response({"object": "list", "data": entries})
