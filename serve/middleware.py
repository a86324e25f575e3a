"""Cross-cutting request handling: the error envelope catch-all, API-key auth, body caps.

Every app (the root, and the Anthropic and admin sub-apps) gets `guards(its envelope)`. A request
for a sub-app passes through its parents' middlewares first; auth and the body cap act only in
the app that owns the route, inside that app's error middleware, so a refusal comes back in the
envelope of the API that was called.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from .errors import APIError, Envelope
from .keys import CAPS, CONFIG

log = logging.getLogger("goinfer.serve")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_TEXT_ROUTES: set[Handler] = set()  # handlers whose body carries a prompt


def guards(envelope: Envelope) -> list:
    """An app's middlewares: its error envelope outermost, then the API key, then the body cap."""
    return [errors(envelope), auth, body_cap]


def errors(envelope: Envelope):
    @web.middleware
    async def handle(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Whatever goes wrong, the client gets the API's envelope and never a traceback."""
        try:
            return await handler(request)
        except APIError as e:
            return e.response(envelope)
        except web.HTTPException as e:  # the router's 404/405, aiohttp's own 413
            if e.status < 400:
                raise
            return APIError(e.status, _http_message(request, e), headers=_keep_allow(e)).response(envelope)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return APIError(500, "internal server error (the server log has the details)").response(envelope)

    return handle


def _http_message(request: web.Request, e: web.HTTPException) -> str:
    if e.status == 404:
        return f"no route {request.method} {request.path}"
    if e.status == 405:
        return f"method {request.method} is not allowed on {request.path}"
    return e.reason


def _keep_allow(e: web.HTTPException) -> dict[str, str]:
    return {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}


def _owns(request: web.Request) -> bool:
    """Is the app whose middleware runs now the one that owns the route?"""
    return request.app is request.match_info.apps[-1]


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every route needs the key when one is set: `Authorization: Bearer K` or `x-api-key: K`."""
    key = request.config_dict[CONFIG].api_key
    if key and _owns(request):
        header = request.headers.get("Authorization", "")
        given = (
            header[7:].strip() if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        )
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(
                401,
                "missing or wrong API key: send Authorization: Bearer <key> or x-api-key: <key>",
                code="invalid_api_key",
            )
    return await handler(request)


@web.middleware
async def body_cap(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A declared body over the route's cap is a 413 before any of it is read."""
    cap = body_cap_for(request)
    if _owns(request) and request.content_length is not None and request.content_length > cap:
        raise APIError(
            413,
            f"request body of {request.content_length} bytes is over the {cap}-byte cap for {request.path}",
            code="body_too_large",
        )
    return await handler(request)


def text_body(handler: Handler) -> Handler:
    """Marks a route whose body carries a prompt: it gets the text cap (sized to the context window)."""
    _TEXT_ROUTES.add(handler)
    return handler


def body_cap_for(request: web.Request) -> int:
    caps = request.config_dict[CAPS]
    return caps.text if request.match_info.handler in _TEXT_ROUTES else caps.small
