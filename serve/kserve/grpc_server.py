"""`inference.GRPCInferenceService` (KServe v2 + Triton's ModelStreamInfer) and gRPC health, on
grpc.aio in the aiohttp app's own event loop: one process, one loop, the same slots.

The key (`authorization: Bearer K` or `x-api-key: K` metadata), TLS (the server's cert and key)
and limits (the prompt routes' body cap as the largest message; each slot's queue) are the HTTP
server's. A request's fault is an APIError mapped to its gRPC code, never UNKNOWN; in
ModelStreamInfer it travels as the response's error_message (Triton's way) and the stream goes on.
The health service answers without the key: Kubernetes' gRPC probes send no metadata.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..errors import APIError
from ..keys import CAPS, CONFIG
from . import grpc_predict_v2_pb2 as pb
from . import grpc_predict_v2_pb2_grpc as pb_grpc
from . import llm, run, tensors

log = logging.getLogger("goinfer.serve")
SERVICE = "inference.GRPCInferenceService"
CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
EXTENSIONS = ["generate", "model_stream_infer"]


def server_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("goinfer")
    except PackageNotFoundError:  # a source tree never installed
        return "0"


def code_of(err: APIError) -> grpc.StatusCode:
    return CODES.get(err.status, grpc.StatusCode.INTERNAL)


class Inference(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, app: web.Application):
        self.app = app

    # -- guards -------------------------------------------------------------------------------
    async def _authorized(self, context: grpc.aio.ServicerContext) -> None:
        key = self.app[CONFIG].api_key
        if not key:
            return
        md = {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        header = md.get("authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else md.get("x-api-key", "")
        if not hmac.compare_digest(given.encode("utf-8", "replace"), key.encode()):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong API key: send metadata authorization: Bearer <key> or x-api-key: <key>",
            )

    # -- health and metadata ------------------------------------------------------------------
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._authorized(context)
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._authorized(context)
        return pb.ServerReadyResponse(ready=run.ready(self.app))

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._authorized(context)
        try:
            run.slot_for(self.app, request.name, request.version)
        except APIError as e:
            if e.status == 503:  # loading or halted: not ready, and no error
                return pb.ModelReadyResponse(ready=False)
            await context.abort(code_of(e), e.message)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._authorized(context)
        return pb.ServerMetadataResponse(name="goinfer", version=server_version(), extensions=EXTENSIONS)

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._authorized(context)
        try:
            slot = run.slot_for(self.app, request.name, request.version)
        except APIError as e:
            await context.abort(code_of(e), e.message)
        meta = model_metadata(slot.name, slot.engine.info.target)
        out = pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"]
        )
        for t in meta["inputs"]:
            out.inputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        for t in meta["outputs"]:
            out.outputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return out

    # -- inference ----------------------------------------------------------------------------
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._authorized(context)
        try:
            req = _read(request)
            if req.stream:
                raise APIError(400, "stream: true needs ModelStreamInfer (ModelInfer returns one reply)")
            done = await run.collect(self.app, request.model_name, request.model_version, req)
        except APIError as e:
            await context.abort(code_of(e), e.message)
        except Exception as e:  # the server's fault: INTERNAL, with no traceback or path in it
            log.exception("ModelInfer failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"generation failed ({type(e).__name__})")
        return _response(request, done.text, done.finish_reason, final=True, usage=done.usage)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Each request in the stream runs at once, beside the others; its replies (one per delta
        when `stream`, else one) come back tagged with its id, the last with triton_final_response."""
        await self._authorized(context)
        out: asyncio.Queue[Any] = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        reading = asyncio.create_task(self._spawn(request_iterator, out, tasks))
        try:
            while not (reading.done() and not tasks and out.empty()):
                getter = asyncio.ensure_future(out.get())
                await asyncio.wait({getter, reading}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    item = getter.result()
                    if item is not None:
                        yield item
                else:
                    getter.cancel()
        finally:
            reading.cancel()
            for t in list(tasks):
                t.cancel()

    async def _spawn(
        self, requests: AsyncIterator[Any], out: asyncio.Queue, tasks: set[asyncio.Task]
    ) -> None:
        try:
            async for request in requests:
                task = asyncio.create_task(self._one(request, out))
                tasks.add(task)
                task.add_done_callback(lambda t: (tasks.discard(t), out.put_nowait(None)))
        except (grpc.RpcError, asyncio.CancelledError):
            pass  # the client went away
        while tasks:  # the stream stays open until every reply has gone
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, request: Any, out: asyncio.Queue) -> None:
        try:
            req = _read(request)
            if not req.stream:
                done = await run.collect(self.app, request.model_name, request.model_version, req)
                out.put_nowait(_streamed(request, done.text, done.finish_reason, True))
                return
            async with aclosing(run.deltas(self.app, request.model_name, request.model_version, req)) as ds:
                async for d in ds:
                    final = d.finish_reason is not None
                    if d.text or final:
                        out.put_nowait(_streamed(request, d.text, d.finish_reason, final))
        except APIError as e:
            out.put_nowait(pb.ModelStreamInferResponse(error_message=f"{code_of(e).name}: {e.message}"))
        except Exception as e:
            log.exception("ModelStreamInfer failed")
            out.put_nowait(
                pb.ModelStreamInferResponse(error_message=f"INTERNAL: generation failed ({type(e).__name__})")
            )


def _read(request: Any) -> llm.LLMRequest:
    tensors.check_outputs([o.name for o in request.outputs])
    return llm.llm_request(tensors.grpc_inputs(request), tensors.grpc_params(request.parameters))


def _response(request: Any, text: str, finish: str | None, final: bool, usage: Any = None) -> Any:
    resp = pb.ModelInferResponse(model_name=request.model_name, model_version=run.VERSION, id=request.id)
    resp.outputs.add(name=llm.TEXT_OUTPUT, datatype="BYTES", shape=[1])
    resp.raw_output_contents.append(tensors.raw_bytes(text))
    params: dict[str, Any] = {"triton_final_response": final}
    if finish is not None:
        params["finish_reason"] = finish
    if usage is not None:
        params |= {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}
    tensors.set_params(resp.parameters, params)
    return resp


def _streamed(request: Any, text: str, finish: str | None, final: bool) -> Any:
    return pb.ModelStreamInferResponse(infer_response=_response(request, text, finish, final))


def model_metadata(name: str, target: str) -> dict[str, Any]:
    """The v2 model metadata (REST's JSON; gRPC's message is built from it)."""
    inputs = [{"name": n, "datatype": dt, "shape": [1]} for n, (dt, _opt) in llm.INPUTS.items()]
    return {
        "name": name,
        "versions": [run.VERSION],
        "platform": f"goinfer/{target}",
        "inputs": inputs,
        "outputs": [{"name": llm.TEXT_OUTPUT, "datatype": "BYTES", "shape": [-1]}],
    }


def build(
    app: web.Application, addr: str, tls: tuple[bytes, bytes] | None
) -> tuple[grpc.aio.Server, int, Any]:
    """The server, bound (port 0: any free one) but not started; returns it and its port.
    `tls`: (private key, certificate chain) PEM bytes, as grpc takes them. Also returns the health
    servicer, which `start` marks serving."""
    cap = app[CAPS].text
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", cap), ("grpc.max_send_message_length", -1)]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Inference(app), server)
    checks = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    if tls is None:
        port = server.add_insecure_port(addr)
    else:
        port = server.add_secure_port(addr, grpc.ssl_server_credentials([tls]))
    return server, port, checks


async def start(server: grpc.aio.Server, checks: Any) -> None:
    await server.start()
    status = health_pb2.HealthCheckResponse.SERVING
    for name in ("", SERVICE):
        result = checks.set(name, status)
        if asyncio.iscoroutine(result):
            await result


def lifetime(addr: str, tls_files: tuple[str, str] | None):
    """An aiohttp cleanup_ctx: the gRPC server starts with the app (same loop) and stops before
    the models close, letting running calls end for a moment."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        tls = None
        if tls_files is not None:
            cert, key = (open(p, "rb").read() for p in tls_files)  # noqa: SIM115 (small files, read once)
            tls = (key, cert)
        server, port, checks = build(app, addr, tls)
        if port == 0:
            raise OSError(f"--grpc-addr {addr}: cannot bind")
        await start(server, checks)
        log.info("KServe v2 gRPC on %s (port %d, %s)", addr, port, "TLS" if tls else "plaintext")
        yield
        await server.stop(grace=2.0)

    return ctx
