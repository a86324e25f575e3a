"""REST v2 on the HTTP server: KServe's health, metadata, readiness and infer routes, and Triton's
generate extension (`generate`, and `generate_stream` as SSE), with the same tensor convention as
gRPC. Errors are the v2 shape, `{"error": "..."}`, with the status the OpenAI routes would give.
Triton's binary tensor extension (tritonclient's default) is read: an `Inference-Header-Content-
Length` header splits the body into the JSON header and the tensors' bytes."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from functools import wraps
from typing import Any

from aiohttp import web

from ..errors import APIError, bad_request
from ..events import SSE_HEADERS
from ..middleware import body_cap_for, read_body, text_body
from . import grpc_server, llm, run, tensors

routes = web.RouteTableDef()
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def v2_errors(handler: Handler) -> Handler:
    @wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            # exactly application/json, no charset: the kserve SDK reads the error's text only then
            headers = {**e.headers, "Content-Type": "application/json"}
            return web.Response(
                body=json.dumps({"error": e.message}).encode(), status=e.status, headers=headers
            )

    return wrapped


@routes.get("/v2/health/live")
async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


@routes.get("/v2/health/ready")
async def ready(request: web.Request) -> web.Response:
    ok = run.ready(request.app)
    return web.json_response({"ready": ok}, status=200 if ok else 503)


@routes.get("/v2")
async def server_metadata(request: web.Request) -> web.Response:
    body = {"name": "goinfer", "version": grpc_server.server_version(), "extensions": grpc_server.EXTENSIONS}
    return web.json_response(body)


@routes.get("/v2/models/{model}")
@routes.get("/v2/models/{model}/versions/{version}")
@v2_errors
async def model_metadata(request: web.Request) -> web.Response:
    slot = _slot(request)
    return web.json_response(grpc_server.model_metadata(slot.name, slot.engine.info.target))


@routes.get("/v2/models/{model}/ready")
@routes.get("/v2/models/{model}/versions/{version}/ready")
@v2_errors
async def model_ready(request: web.Request) -> web.Response:
    try:
        _slot(request)
    except APIError as e:
        if e.status != 503:  # loading or halted: not ready, and no error
            raise
        return web.json_response({"name": request.match_info["model"], "ready": False}, status=503)
    return web.json_response({"name": request.match_info["model"], "ready": True})


@routes.post("/v2/models/{model}/infer")
@routes.post("/v2/models/{model}/versions/{version}/infer")
@text_body  # outermost: the body cap is looked up by the route's handler
@v2_errors
async def infer(request: web.Request) -> web.Response:
    body, binary = await _body(request)
    inputs, params, outputs, ident = tensors.json_inputs(body, binary)
    tensors.check_outputs(outputs)
    req = llm.llm_request(inputs, params)
    if req.stream:
        raise bad_request("stream: true needs generate_stream or gRPC ModelStreamInfer", "stream")
    model, version = _names(request)
    done = await run.collect(request.app, model, version, req)
    reply = {
        "model_name": model,
        "model_version": run.VERSION,
        "id": ident,
        "parameters": _finish(done),
        "outputs": [{"name": llm.TEXT_OUTPUT, "datatype": "BYTES", "shape": [1], "data": [done.text]}],
    }
    return web.json_response(reply)


@routes.post("/v2/models/{model}/generate")
@routes.post("/v2/models/{model}/versions/{version}/generate")
@text_body  # outermost: the body cap is looked up by the route's handler
@v2_errors
async def generate(request: web.Request) -> web.Response:
    req = await _generate_request(request, stream=False)
    model, version = _names(request)
    done = await run.collect(request.app, model, version, req)
    out = {"model_name": model, "model_version": run.VERSION, llm.TEXT_OUTPUT: done.text, **_finish(done)}
    return web.json_response(out)


@routes.post("/v2/models/{model}/generate_stream")
@routes.post("/v2/models/{model}/versions/{version}/generate_stream")
@text_body  # outermost: the body cap is looked up by the route's handler
@v2_errors
async def generate_stream(request: web.Request) -> web.StreamResponse:
    """One `data: {...text_output}` event per delta; an error after the headers is an event too."""
    req = await _generate_request(request, stream=True)
    model, version = _names(request)
    deltas = run.deltas(request.app, model, version, req)
    first = await anext(deltas, None)  # checks and queueing before the headers: a refusal keeps its status
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    head = {"model_name": model, "model_version": run.VERSION}
    try:
        async with aclosing(deltas):
            d = first
            while d is not None:
                event = {**head, llm.TEXT_OUTPUT: d.text}
                if d.finish_reason is not None:
                    event["finish_reason"] = d.finish_reason
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                d = await anext(deltas, None)
    except APIError as e:
        await resp.write(f"data: {json.dumps({'error': e.message})}\n\n".encode())
    except ConnectionError:
        return resp
    await resp.write_eof()
    return resp


async def _generate_request(request: web.Request, stream: bool) -> llm.LLMRequest:
    """Triton's generate body: the inputs by name at the top level, `parameters` beside them."""
    body, _ = await _body(request)
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object with text_input")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise bad_request("parameters must be an object", "parameters")
    inputs = {k: v for k, v in body.items() if k not in ("parameters", "id")}
    for name in ("sampling_parameters",):
        if isinstance(inputs.get(name), dict):
            inputs[name] = json.dumps(inputs[name])  # an object where a JSON string was meant
    for name, (dtype, _opt) in llm.INPUTS.items():
        v = inputs.get(name)
        if v is not None and (dtype == "BYTES") != isinstance(v, str):
            raise bad_request(f"{name} must be a {'string' if dtype == 'BYTES' else 'boolean'}", name)
    params = {**params, "stream": stream}
    inputs.pop("stream", None)  # the route says whether it streams
    return llm.llm_request(inputs, params)


async def _body(request: web.Request) -> tuple[Any, bytes]:
    raw = await read_body(request, body_cap_for(request))
    head = request.headers.get("Inference-Header-Content-Length")
    binary = b""
    if head is not None:
        if not head.isdigit() or int(head) > len(raw):
            raise bad_request("Inference-Header-Content-Length is not a length within the body")
        raw, binary = raw[: int(head)], raw[int(head) :]
    try:
        return json.loads(raw), binary
    except ValueError as e:
        raise bad_request(f"the body is not JSON: {e}") from None


def _names(request: web.Request) -> tuple[str, str]:
    return request.match_info["model"], request.match_info.get("version", "")


def _slot(request: web.Request):
    model, version = _names(request)
    return run.slot_for(request.app, model, version)


def _finish(done: run.Outcome) -> dict[str, Any]:
    out: dict[str, Any] = {"finish_reason": done.finish_reason} if done.finish_reason else {}
    if done.usage is not None:
        out |= {"prompt_tokens": done.usage.prompt_tokens, "completion_tokens": done.usage.completion_tokens}
    return out
