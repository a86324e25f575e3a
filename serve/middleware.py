"""Cross-cutting request handling: the error envelope catch-all, API-key auth, body caps."""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from .errors import APIError, anthropic_path
from .keys import CAPS, CONFIG

log = logging.getLogger("goinfer.serve")
TEXT_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"}
)


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    """Outermost: whatever goes wrong, the client gets the API's envelope and never a traceback."""
    anthropic = anthropic_path(request.path)
    try:
        return await handler(request)
    except APIError as e:
        return e.response(anthropic)
    except web.HTTPException as e:  # the router's 404/405, aiohttp's own 413
        if e.status < 400:
            raise
        return APIError(e.status, _http_message(request, e), headers=_keep_allow(e)).response(anthropic)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return APIError(500, "internal server error (the server log has the details)").response(anthropic)


def _http_message(request: web.Request, e: web.HTTPException) -> str:
    if e.status == 404:
        return f"no route {request.method} {request.path}"
    if e.status == 405:
        return f"method {request.method} is not allowed on {request.path}"
    return e.reason


def _keep_allow(e: web.HTTPException) -> dict[str, str]:
    return {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}


@web.middleware
async def auth(request: web.Request, handler) -> web.StreamResponse:
    """Every route needs the key when one is set: `Authorization: Bearer K` or `x-api-key: K`."""
    key = request.app[CONFIG].api_key
    if key:
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
async def body_cap(request: web.Request, handler) -> web.StreamResponse:
    """A declared body over the route's cap is a 413 before any of it is read."""
    cap = body_cap_for(request)
    if request.content_length is not None and request.content_length > cap:
        raise APIError(
            413,
            f"request body of {request.content_length} bytes is over the {cap}-byte cap for {request.path}",
            code="body_too_large",
        )
    return await handler(request)


def body_cap_for(request: web.Request) -> int:
    caps = request.app[CAPS]
    return caps.text if request.path in TEXT_ROUTES else caps.small
