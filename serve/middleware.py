"""Cross-cutting request handling: the error envelope catch-all, the origin check, API-key auth,
body caps.

Every app (the root, and the Anthropic and admin sub-apps) gets `guards(its envelope)`. A request
for a sub-app passes through its parents' middlewares first; the origin check, auth and the body
cap act only in the app that owns the route, inside that app's error middleware, so a refusal
comes back in the envelope of the API that was called.

Cross-site requests: a browser sends `Origin` with every cross-site POST, and a page may send a
`text/plain` body without asking first (no preflight), so with no API key any page open in a
browser could drive this server. A request whose Origin is not the server's own (scheme://Host) is
a 403 unless `--cors-origin` lists it; admin routes refuse every foreign origin. Allowed origins get
CORS answers: a preflight (OPTIONS with Access-Control-Request-Method) is a 204 here, before auth
and routing, and every response carries Access-Control-Allow-Origin (`cors_headers`, run as the
root app's on_response_prepare signal, so SSE streams and errors get it too). Requests without an
Origin (curl, SDKs, other servers) are not affected.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError
from yarl import URL

from .config import is_loopback
from .errors import APIError, Envelope, bad_request
from .keys import CAPS, CONFIG

log = logging.getLogger("goinfer.serve")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Handlers whose body takes a cap other than the small one -> that cap's BodyCaps field
_CAPPED: dict[Handler, str] = {}
# Handlers any client may call without the key: the web page's static files (serve/webpage.py), which a
# browser fetches by navigating, with no header to carry a key, and which hold no data
_PUBLIC: set[Handler] = set()

SAME_ORIGIN_ONLY = web.AppKey("same_origin_only", bool)  # an app (admin) that no --cors-origin opens
CORS_ORIGIN = web.RequestKey("cors_origin", str)  # the foreign origin this request was allowed from
PREFLIGHT_MAX_AGE_S = 600
ALLOWED_HEADERS = (
    "Authorization, x-api-key, Content-Type, anthropic-version, anthropic-beta, "
    "anthropic-dangerous-direct-browser-access, OpenAI-Organization, OpenAI-Project"
)
_HEADER_LIST = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~, -]{1,1000}$")


def guards(envelope: Envelope) -> list:
    """An app's middlewares: its error envelope outermost, then the origin check (a preflight has
    no key to send), then the API key, then the body cap."""
    return [errors(envelope), origins, auth, body_cap]


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


# -- origins ---------------------------------------------------------------------------------------
@web.middleware
async def origins(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A foreign Origin is refused unless allowed; an allowed one's preflight is answered here."""
    origin = request.headers.get("Origin")
    if origin is None or not _owns(request):
        return await handler(request)
    own = _same_origin(request, origin)
    if not own:
        if request.app.get(SAME_ORIGIN_ONLY, False):
            raise APIError(
                403,
                f"Origin {_shown(origin)} is not this server's own: admin routes answer only "
                "same-origin requests and requests without an Origin (curl, scripts)",
                code="origin_not_allowed",
            )
        allowed = request.config_dict[CONFIG].cors_origins
        if _origin_key(origin) not in {_origin_key(o) for o in allowed}:
            raise APIError(
                403,
                f"Origin {_shown(origin)} is not allowed: this server answers browser requests from its "
                "own origin and from those passed with --cors-origin",
                code="origin_not_allowed",
            )
        request[CORS_ORIGIN] = origin
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        return preflight(request, origin)
    return await handler(request)


def preflight(request: web.Request, origin: str) -> web.Response:
    """A CORS preflight's answer: the route's methods, the headers asked for, cached a while."""
    exc = request.match_info.http_exception
    if isinstance(exc, web.HTTPNotFound):
        raise exc
    if isinstance(exc, web.HTTPMethodNotAllowed):
        methods = exc.allowed_methods
    else:  # a route that takes OPTIONS itself
        methods = {request.headers["Access-Control-Request-Method"]}
    asked = request.headers.get("Access-Control-Request-Headers", "")
    headers = {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": ", ".join(sorted(m for m in methods if m != "OPTIONS")),
        "Access-Control-Allow-Headers": asked if _HEADER_LIST.match(asked) else ALLOWED_HEADERS,
        "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        "Vary": "Origin",
    }
    return web.Response(status=204, headers=headers)


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: an allowed foreign origin may read the response (SSE and errors too)."""
    if "Origin" not in request.headers:
        return
    origin = request.get(CORS_ORIGIN)
    if origin is not None and "Access-Control-Allow-Origin" not in response.headers:
        response.headers["Access-Control-Allow-Origin"] = origin
    vary = response.headers.get("Vary", "")
    if "origin" not in vary.lower():
        response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"


def _origin_key(origin: str) -> tuple[str, str, int | None] | None:
    """(scheme, host, port) with the default port filled in; None for `null` or anything else."""
    try:
        url = URL(origin.strip())
        if url.scheme not in ("http", "https") or not url.host or url.path not in ("", "/"):
            return None
        return url.scheme, url.host.lower().rstrip("."), url.port
    except (ValueError, TypeError, UnicodeError):
        return None


def _same_origin(request: web.Request, origin: str) -> bool:
    """Is `origin` scheme://Host of this request? (No Host header: not provably ours.)

    DNS rebinding: a page at evil.example whose name now resolves to 127.0.0.1 sends matching
    Origin and Host headers; a server bound to loopback is its own origin only under a loopback
    name (localhost, 127.0.0.1, [::1])."""
    host = request.headers.get("Host")
    key = _origin_key(origin)
    if host is None or key is None or key != _origin_key(f"{request.scheme}://{host}"):
        return False
    return not request.config_dict[CONFIG].loopback or is_loopback(key[1])


def _shown(origin: str) -> str:
    return repr(origin[:200])


# -- auth ------------------------------------------------------------------------------------------
@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every route needs the key when one is set: `Authorization: Bearer K` or `x-api-key: K`.
    Compared as bytes: a header that is not UTF-8 (aiohttp keeps its bytes as surrogates) or not
    ASCII is a wrong key like any other."""
    key = request.config_dict[CONFIG].api_key
    if key and _owns(request) and request.match_info.handler not in _PUBLIC:
        header = request.headers.get("Authorization", "")
        given = (
            header[7:].strip() if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        )
        if not hmac.compare_digest(_raw(given), _raw(key)):
            raise APIError(
                401,
                "missing or wrong API key: send Authorization: Bearer <key> or x-api-key: <key>",
                code="invalid_api_key",
            )
    return await handler(request)


def _raw(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")  # total and one-to-one: no str raises here


# -- body caps -------------------------------------------------------------------------------------
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


def public(handler: Handler) -> Handler:
    """Marks a route that needs no API key (a static file of the web page)."""
    _PUBLIC.add(handler)
    return handler


def text_body(handler: Handler) -> Handler:
    """Marks a route whose body carries a prompt: it gets the text cap (sized to the context window)."""
    _CAPPED[handler] = "text"
    return handler


def embeddings_body(handler: Handler) -> Handler:
    """Marks a route whose body carries inputs to embed: it gets the embeddings cap (its own)."""
    _CAPPED[handler] = "embeddings"
    return handler


def files_body(handler: Handler) -> Handler:
    """Marks a route whose body may be as large as an upload (BodyCaps.files, --max-file-bytes)."""
    _CAPPED[handler] = "files"
    return handler


def text_routes(app: web.Application) -> tuple[str, ...]:
    """The paths of the app's text routes, sub-apps' included: what the banner names."""
    return _routes_capped(app, "text")


def embedding_routes(app: web.Application) -> tuple[str, ...]:
    return _routes_capped(app, "embeddings")


def _routes_capped(app: web.Application, cap: str) -> tuple[str, ...]:
    paths = {
        r.resource.canonical for r in app.router.routes() if r.resource and _CAPPED.get(r.handler) == cap
    }
    return tuple(sorted(paths))


def body_cap_for(request: web.Request) -> int:
    caps = request.config_dict[CAPS]
    return getattr(caps, _CAPPED.get(request.match_info.handler, "small"))


# -- reading a body --------------------------------------------------------------------------------
# Request bodies are validated by pydantic: strict types, ranges from the APIs' references. Unknown
# fields are ignored, as clients send fields an older server does not know; fields we know but
# cannot honour are refused by the routes (422) rather than silently dropped.
class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


async def read_request(request: web.Request, model: type[Body]) -> Any:
    """The body, read under the route's cap and validated as `model`."""
    return parse(model, await read_body(request, body_cap_for(request)))


async def read_body(request: web.Request, cap: int) -> bytes:
    """The body, refusing past `cap` bytes (Content-Length was checked before; this covers chunked)."""
    parts, size = [], 0
    while chunk := await _read(request):
        size += len(chunk)
        if size > cap:
            raise APIError(
                413, f"request body is over the {cap}-byte cap for {request.path}", code="body_too_large"
            )
        parts.append(chunk)
    return b"".join(parts)


async def _read(request: web.Request) -> bytes:
    try:
        return await request.content.read(64 * 1024)
    except web.RequestPayloadError as e:  # a body its Content-Encoding (gzip, deflate) does not decode
        why = (str(e.__cause__ or e).strip().splitlines() or ["it does not decode"])[-1].strip()
        raise bad_request(f"request body cannot be read: {why}", code="invalid_body") from None


def parse(model: type[Body], body: bytes) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming its field."""
    if not body.strip():
        raise bad_request("request body is empty: expected a JSON object", code="missing_body")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        # Under a union, the telling error is the deepest, and one where the type matched but a
        # constraint failed (five stop strings) over "should be a valid string".
        err = max(errs, key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
        if err["type"] == "json_invalid":
            raise bad_request(f"request body is not valid JSON: {err['msg']}", code="invalid_json") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise bad_request("request body must be a JSON object", code="invalid_json") from None
        # Union members repeat the path with their type names; keep the field's own path.
        path = [str(p) for p in err["loc"] if not _is_type_tag(p)]
        param = ".".join(path) or None
        msg = "Input should be an object" if err["type"] == "model_type" else err["msg"]
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from None


def _is_type_tag(p: object) -> bool:
    return isinstance(p, str) and (
        p in ("str", "int", "float", "bool")
        or p.startswith(("list[", "dict[", "constrained-"))
        or p[0].isupper()
    )
