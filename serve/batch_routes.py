"""OpenAI's Files and Batch routes: /v1/files (upload, list, get, content, delete) and
/v1/batches (create, get, list, cancel), over the record in batches.py and the files in files.py."""

from __future__ import annotations

from typing import Annotated, Any

from aiohttp import web
from pydantic import Field

from .batch_format import ENDPOINTS
from .batches import BATCHES, Batches
from .errors import APIError, bad_request
from .files import ENVELOPE_SLACK
from .keys import CAPS
from .middleware import Body, files_body, read_request

routes = web.RouteTableDef()
WINDOWS = ("24h",)  # OpenAI's only completion window
MAX_LIMIT = 100


def _batches(request: web.Request) -> Batches:
    return request.config_dict[BATCHES]


def page(request: web.Request, items: list[dict[str, Any]], id_key: str = "id") -> dict[str, Any]:
    """A list page, newest first: `?after=ID&limit=N` as OpenAI pages (`before_id`/`after_id` too)."""
    q = request.query
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise bad_request(f"limit {q.get('limit')[:20]!r} is not an integer", "limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit {limit} is not between 1 and {MAX_LIMIT}", "limit")
    ids = [i[id_key] for i in items]
    after, before = q.get("after") or q.get("after_id"), q.get("before_id")
    start, end = 0, len(items)
    if after is not None:
        start = ids.index(after) + 1 if after in ids else len(items)
    if before is not None:
        end = ids.index(before) if before in ids else 0
    data = items[start:end]
    if before is not None:
        data = data[-limit:]
        more = len(items[start:end]) > limit
    else:
        more, data = len(data) > limit, data[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0][id_key] if data else None,
        "last_id": data[-1][id_key] if data else None,
        "has_more": more,
    }


# -- files ---------------------------------------------------------------------------------------
@routes.post("/v1/files")
@files_body
async def upload(request: web.Request) -> web.Response:
    store = _batches(request).files
    return web.json_response(await store.upload(request, request.config_dict[CAPS].files - ENVELOPE_SLACK))


@routes.get("/v1/files")
async def list_files(request: web.Request) -> web.Response:
    files = _batches(request).files.list(request.query.get("purpose"))
    if request.query.get("order") == "asc":
        files.reverse()
    return web.json_response(page(request, files))


@routes.get("/v1/files/{file_id}")
async def get_file(request: web.Request) -> web.Response:
    return web.json_response(_batches(request).files.get(request.match_info["file_id"]))


@routes.get("/v1/files/{file_id}/content")
async def file_content(request: web.Request) -> web.StreamResponse:
    store = _batches(request).files
    meta = store.get(request.match_info["file_id"])
    path = store.content_path(meta["id"])
    if not path.exists():
        raise APIError(404, f"file {meta['id']!r} has no content", code="file_not_found")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


@routes.delete("/v1/files/{file_id}")
async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    _batches(request).files.delete(file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


# -- batches -------------------------------------------------------------------------------------
class BatchRequest(Body):
    input_file_id: Annotated[str, Field(min_length=1, max_length=200)]
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def batch_object(b: Batches, state: dict[str, Any]) -> dict[str, Any]:
    return {**state["batch"], "request_counts": b.counts(state)}


@routes.post("/v1/batches")
async def create_batch(request: web.Request) -> web.Response:
    req = await read_request(request, BatchRequest)
    if req.endpoint not in ENDPOINTS:
        raise bad_request(
            f"endpoint {req.endpoint[:100]!r}: batches run {' and '.join(ENDPOINTS)}",
            "endpoint",
            "invalid_endpoint",
        )
    if req.completion_window not in WINDOWS:
        raise bad_request(
            f"completion_window {req.completion_window[:20]!r}: only '24h' is offered", "completion_window"
        )
    if req.metadata is not None and len(req.metadata) > 16:
        raise bad_request("metadata holds at most 16 pairs", "metadata")
    b = _batches(request)
    try:
        meta = b.files.get(req.input_file_id)
    except APIError as e:
        raise APIError(400, e.message, param="input_file_id", code="invalid_input_file") from None
    if meta["purpose"] != "batch":
        raise bad_request(
            f"file {meta['id']!r} has purpose {meta['purpose']!r}, not 'batch'", "input_file_id"
        )
    data = b.files.content_path(meta["id"]).read_bytes()
    state = b.create("openai", req.endpoint, data, meta["id"], req.metadata, req.completion_window)
    return web.json_response(batch_object(b, state))


@routes.get("/v1/batches")
async def list_batches(request: web.Request) -> web.Response:
    b = _batches(request)
    return web.json_response(page(request, [batch_object(b, s) for s in b.all("openai")]))


@routes.get("/v1/batches/{batch_id}")
async def get_batch(request: web.Request) -> web.Response:
    b = _batches(request)
    return web.json_response(batch_object(b, b.load(request.match_info["batch_id"], "openai")))


@routes.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: web.Request) -> web.Response:
    b = _batches(request)
    state = b.load(request.match_info["batch_id"], "openai")
    return web.json_response(batch_object(b, b.cancel(state)))
