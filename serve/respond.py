"""Sending a generation: as SSE chunks, or folded into one JSON reply. Both read one chunk stream.

While nothing is ready (queued, or a long prefill) the stream sends `: keep-alive` comments so
idle timeouts in clients and proxies do not fire. A client that goes away cancels its run: on a
failed write while streaming, or at the next poll while a whole reply is being collected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from aiohttp import web

from .chunks import Chunk, EventBuilder
from .errors import APIError
from .registry import Generation

log = logging.getLogger("goinfer.serve")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def chunk_stream(run: Generation, builder: EventBuilder) -> AsyncIterator[Chunk | None]:
    """The run's chunks in order; None at each poll with nothing new."""
    for c in builder.start():
        yield c
    async with aclosing(run.ticks()) as ticks:
        async for d in ticks:
            if d is None:
                yield None
                continue
            for c in builder.step(d):
                yield c


def client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def respond(
    request: web.Request,
    run: Generation,
    builder: EventBuilder,
    *,
    stream: bool,
    keepalive_s: float,
) -> web.StreamResponse:
    async with aclosing(chunk_stream(run, builder)) as chunks:
        if stream:
            return await _sse(request, chunks, builder, keepalive_s)
        collected = []
        async for c in chunks:
            if c is not None:
                collected.append(c)
            elif client_gone(request):
                return web.Response(status=499)  # nobody reads this; leaving cancels the run
        return web.json_response(builder.fold(collected))


async def _sse(
    request: web.Request, chunks: AsyncIterator[Chunk | None], builder: EventBuilder, keepalive_s: float
) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)  # headers now, so keep-alives can flow through a long prefill
    loop = asyncio.get_running_loop()
    last = loop.time()
    try:
        async for c in chunks:
            if c is None:
                if client_gone(request):
                    return resp
                if loop.time() - last >= keepalive_s:
                    await resp.write(builder.keepalive)
                    last = loop.time()
                continue
            await resp.write(builder.sse(c))
            last = loop.time()
        if builder.sse_end:
            await resp.write(builder.sse_end)
    except ConnectionError:  # the client hung up mid-stream (aiohttp's reset errors subclass this)
        return resp
    except Exception as e:
        # Headers are gone already: the error travels as an event, in the envelope, without a traceback.
        err = e if isinstance(e, APIError) else APIError(500, f"generation failed ({type(e).__name__})")
        if not isinstance(e, APIError):
            log.exception("stream failed")
        try:
            await resp.write(builder.sse_error(err))
        except ConnectionError:
            return resp
    await resp.write_eof()
    return resp
