"""Anthropic's Message Batches: /v1/messages/batches on the Messages sub-app (its error envelope).

The same record and worker as /v1/batches (batches.py): the inline requests become input lines to
/v1/messages, and the OpenAI status machine is shown as Anthropic's processing_status
(in_progress, canceling, ended) with its request_counts (processing, succeeded, errored, canceled,
expired). /results streams one JSONL line per request, in the order sent, once the batch ended.
"""

from __future__ import annotations

import re
import shutil
from datetime import datetime, timezone
from typing import Annotated, Any

from aiohttp import web
from pydantic import Field

from .batch_format import MESSAGES, dumps, succeeded
from .batch_routes import page
from .batches import BATCHES, CANCELLED, ENDED, EXPIRED, Batches
from .errors import APIError, bad_request
from .middleware import Body, files_body, read_request

routes = web.RouteTableDef()
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_REQUESTS = 100_000
_STATUS = {"cancelling": "canceling", **{s: "ended" for s in ENDED}}


class BatchItem(Body):
    custom_id: str
    params: dict[str, Any]


class CreateRequest(Body):
    requests: Annotated[list[BatchItem], Field(min_length=1, max_length=MAX_REQUESTS)]


def _time(t: int | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _counts(b: Batches, state: dict[str, Any]) -> dict[str, int]:
    log = b.live.get(state["batch"]["id"])
    records = log.records if log is not None else b.results(state)
    codes = [(r.get("error") or {}).get("code") for r in records]
    n = {
        "succeeded": sum(1 for r in records if succeeded(r)),
        "canceled": codes.count(CANCELLED),
        "expired": codes.count(EXPIRED),
    }
    n["errored"] = len(records) - sum(n.values())
    return {"processing": max(0, state["batch"]["request_counts"]["total"] - len(records)), **n}


def message_batch(request: web.Request, b: Batches, state: dict[str, Any]) -> dict[str, Any]:
    batch = state["batch"]
    ended = batch["status"] in ENDED
    results = f"{request.scheme}://{request.host}/v1/messages/batches/{batch['id']}/results"
    end_time = max(
        (batch[k] or 0 for k in ("completed_at", "failed_at", "cancelled_at", "expired_at")), default=0
    )
    return {
        "id": batch["id"],
        "type": "message_batch",
        "processing_status": _STATUS.get(batch["status"], "in_progress"),
        "request_counts": _counts(b, state),
        "ended_at": _time(end_time) if ended else None,
        "created_at": _time(batch["created_at"]),
        "expires_at": _time(batch["expires_at"]),
        "archived_at": None,
        "cancel_initiated_at": _time(batch["cancelling_at"]),
        "results_url": results if ended else None,
    }


def _batches(request: web.Request) -> Batches:
    return request.config_dict[BATCHES]


@routes.post("/batches")
@files_body
async def create(request: web.Request) -> web.Response:
    req = await read_request(request, CreateRequest)
    seen: dict[str, int] = {}
    lines = []
    for i, item in enumerate(req.requests):
        where = f"requests.{i}.custom_id"
        if not CUSTOM_ID.match(item.custom_id):
            raise bad_request(f"{where}: must be 1-64 letters, digits, '_' or '-'", where)
        if item.custom_id in seen:
            raise bad_request(
                f"{where}: {item.custom_id!r} is already used by requests.{seen[item.custom_id]}; "
                "each must be unique",
                where,
            )
        seen[item.custom_id] = i
        lines.append(
            dumps({"custom_id": item.custom_id, "method": "POST", "url": MESSAGES, "body": item.params})
        )
    b = _batches(request)
    state = b.create("anthropic", MESSAGES, b"".join(lines), None, None, "24h")
    state["batch"]["request_counts"]["total"] = len(lines)
    b.save(state)
    return web.json_response(message_batch(request, b, state))


@routes.get("/batches")
async def list_batches(request: web.Request) -> web.Response:
    b = _batches(request)
    listed = page(request, [message_batch(request, b, s) for s in b.all("anthropic")])
    listed.pop("object")
    return web.json_response(listed)


@routes.get("/batches/{batch_id}")
async def retrieve(request: web.Request) -> web.Response:
    b = _batches(request)
    return web.json_response(message_batch(request, b, b.load(request.match_info["batch_id"], "anthropic")))


@routes.post("/batches/{batch_id}/cancel")
async def cancel(request: web.Request) -> web.Response:
    b = _batches(request)
    state = b.cancel(b.load(request.match_info["batch_id"], "anthropic"))
    return web.json_response(message_batch(request, b, state))


@routes.delete("/batches/{batch_id}")
async def delete(request: web.Request) -> web.Response:
    b = _batches(request)
    state = b.load(request.match_info["batch_id"], "anthropic")
    if state["batch"]["status"] not in ENDED:
        raise bad_request("a batch can be deleted once it has ended: cancel it first", "batch_id")
    shutil.rmtree(b.dir / state["batch"]["id"], ignore_errors=True)
    return web.json_response({"id": state["batch"]["id"], "type": "message_batch_deleted"})


@routes.get("/batches/{batch_id}/results")
async def results(request: web.Request) -> web.Response:
    b = _batches(request)
    state = b.load(request.match_info["batch_id"], "anthropic")
    if state["batch"]["status"] not in ENDED:
        raise APIError(404, f"batch {state['batch']['id']!r} has not ended: its results are not ready yet")
    body = b"".join(dumps(_result(r)) for r in b.results(state))
    return web.Response(body=body, content_type="application/x-jsonl")


def _result(record: dict[str, Any]) -> dict[str, Any]:
    """One request's result as Anthropic writes it."""
    cid = record["custom_id"]
    if succeeded(record):
        return {"custom_id": cid, "result": {"type": "succeeded", "message": record["response"]["body"]}}
    err = record.get("error") or {}
    code = err.get("code")
    if code == CANCELLED:
        return {"custom_id": cid, "result": {"type": "canceled"}}
    if code == EXPIRED:
        return {"custom_id": cid, "result": {"type": "expired"}}
    kind = code if isinstance(code, str) and code.endswith("_error") else "invalid_request_error"
    if code == "internal_error":
        kind = "api_error"
    error = {"type": "error", "error": {"type": kind, "message": err.get("message", "")}}
    return {"custom_id": cid, "result": {"type": "errored", "error": error}}
