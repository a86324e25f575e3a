"""Pulling and building models from the web page's Models tab.

Pulling a checkpoint (a zoo name or `hf:owner/repo:QUANT`) and building its bundle is the
compiler's work, which serve never imports: the composition root (cli/pulls.py) gives the app a
`Puller`, as it gives the admin routes a Loader. Here are the routes over it:

POST /admin/models/plan {"ref", "quant"?}  -> what a pull would fetch (files, sizes, notes) and what
    the caches already hold; decided before any weight byte moves
POST /admin/models/pull {"ref", "quant"?}  -> server-sent events while the pull and the build run:
    {"type": "stage", "stage": "pull" | "build"}, {"type": "line", "stage", "line"} (the compiler's
    own progress lines), then {"type": "built", "bundle", "name"} or {"type": "error", "error"}
GET  /admin/models/pull                    -> the same events of the pull running now (or the last
    one), from its start: a reloaded page finds its progress again

One pull runs at a time: it writes the shared caches, and two builds would compete for the cores
the models serve on. It runs on a thread of its own and goes on when the page that started it
leaves (what it fetched is kept, and a later pull resumes or reuses it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import Any, Protocol

from aiohttp import web

from .errors import APIError, bad_request
from .events import SSE_HEADERS
from .keys import CONFIG
from .middleware import Body, read_request

log = logging.getLogger("goinfer.serve")

PullProgress = Callable[[str, str], None]  # (stage: "pull" | "build", one progress line)


class BadQuant(ValueError):
    """A quant no checkpoint builds as (a 400 naming `quant`, where other refusals name `ref`)."""


class Puller(Protocol):
    """What the Models tab needs from the compiler side. Blocking methods, called on threads; a
    reason not to go on is one ValueError line (the route passes it to the page)."""

    def catalog(self) -> dict[str, Any]:
        """{"zoo": the zoo's models, each {"name", "description", "size", "kind" ("chat" |
        "embedding"), "pulled"} from the caches alone (no network, no hashing); "quants": what a
        checkpoint may be built as; "default_quant"}."""
        ...

    def check(self, ref: str, quant: str | None) -> None:
        """Refuse what no pull can take (not a zoo name nor an hf: reference, an unknown quant)
        before anything runs; no network."""
        ...

    def plan(self, ref: str, quant: str | None) -> dict[str, Any]:
        """What pulling `ref` would fetch: {"ref", "source" ("zoo" | "hub"), "files": [{"name",
        "size"}], "total_bytes", "notes", "pulled", "bundle" (the built bundle's path, or None)}."""
        ...

    def pull_build(self, ref: str, quant: str | None, progress: PullProgress) -> dict[str, Any]:
        """Pull `ref` unless cached, build its bundle unless built: {"bundle": its path, "name": the
        name `serve --model REF` would give it, "kind": "chat" | "embedding"}."""
        ...

    def on_disk(self) -> list[dict[str, Any]]:
        """Everything the pull and bundle caches hold: {"kind" ("hub" | "zoo" | "bundle"), "name",
        "path", "size", "complete", "detail", "ref" (what Load or Pull takes, or None)}."""
        ...


PULLER: web.AppKey[Puller | None] = web.AppKey("puller")


class PullRequest(Body):
    ref: str
    quant: str | None = None


class PullJob:
    """One pull + build: its events kept in order, so any number of pages can follow it from the
    start. Posted from the worker thread onto the loop; read on the loop."""

    def __init__(self, ref: str, quant: str | None, loop: asyncio.AbstractEventLoop):
        self.ref, self.quant, self.loop = ref, quant, loop
        self.events: list[dict[str, Any]] = []
        self.done = False
        self.stage: str | None = None
        self._tick = asyncio.Event()

    def post(self, event: dict[str, Any], last: bool = False) -> None:
        """From any thread."""
        with suppress(RuntimeError):  # the loop has closed (server shutdown): nobody is listening
            self.loop.call_soon_threadsafe(self._append, event, last)

    def _append(self, event: dict[str, Any], last: bool) -> None:
        self.events.append(event)
        self.done = self.done or last
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    def progress(self, stage: str, line: str) -> None:
        """The Puller's callback, on the worker thread."""
        if stage != self.stage:
            self.stage = stage
            self.post({"type": "stage", "stage": stage})
        self.post({"type": "line", "stage": stage, "line": line})

    async def follow(self, keepalive_s: float) -> AsyncIterator[dict[str, Any] | None]:
        """Every event from the first, then new ones as they come; None when `keepalive_s` passed
        with nothing new."""
        i = 0
        while True:
            tick = self._tick
            while i < len(self.events):
                i += 1
                yield self.events[i - 1]
            if self.done:
                return
            try:
                await asyncio.wait_for(tick.wait(), keepalive_s)
            except asyncio.TimeoutError:
                yield None


class Pulls:
    """The app's pull state: the job running now, or the last one."""

    def __init__(self) -> None:
        self.job: PullJob | None = None

    def start(self, puller: Puller, req: PullRequest) -> PullJob:
        job = self.job
        if job is not None and not job.done:
            if (job.ref, job.quant) == (req.ref, req.quant):
                return job  # the same pull, asked again (a reloaded page): follow it
            raise APIError(
                429,
                f"a pull of {job.ref} is running, and one runs at a time (GET /admin/models/pull follows it)",
                code="pull_running",
                headers={"Retry-After": "5"},
            )
        job = self.job = PullJob(req.ref, req.quant, asyncio.get_running_loop())
        # A daemon thread, not the loop's executor: a download must not hold the server's shutdown
        threading.Thread(target=_run, args=(puller, job), name="goinfer-pull", daemon=True).start()
        return job


PULLS = web.AppKey("pulls", Pulls)


def _run(puller: Puller, job: PullJob) -> None:
    try:
        log.info("pull of %s (quant %s) started from the web page", job.ref, job.quant or "default")
        result = puller.pull_build(job.ref, job.quant, job.progress)
    except ValueError as e:
        log.warning("pull of %s failed: %s", job.ref, e)
        job.post({"type": "error", "error": {"message": str(e), "code": "pull_failed"}}, last=True)
        return
    except Exception:
        log.exception("pull of %s failed", job.ref)
        error = {"message": "the pull failed (the server log has the details)", "code": "internal_error"}
        job.post({"type": "error", "error": error}, last=True)
        return
    log.info("pull of %s built %s", job.ref, result.get("bundle"))
    job.post({"type": "stage", "stage": "built"})
    job.post({"type": "built", **result}, last=True)


def puller_of(request: web.Request) -> Puller:
    puller = request.config_dict.get(PULLER)
    if puller is None:
        raise APIError(503, "this server was started without a model puller", code="no_puller")
    return puller


admin_routes = web.RouteTableDef()  # mounted in the admin sub-app: --allow-admin, same origin only


@admin_routes.post("/models/plan")
async def plan(request: web.Request) -> web.Response:
    req = await _checked(request)
    try:
        return web.json_response(await asyncio.to_thread(puller_of(request).plan, req.ref, req.quant))
    except ValueError as e:  # the Hub refused, or the repo lacks the quant: the compiler's one line
        raise bad_request(str(e), param="ref", code="plan_failed") from None


@admin_routes.post("/models/pull")
async def pull(request: web.Request) -> web.StreamResponse:
    req = await _checked(request)
    job = request.config_dict[PULLS].start(puller_of(request), req)
    return await _stream(request, job)


@admin_routes.get("/models/pull")
async def follow(request: web.Request) -> web.StreamResponse:
    job = request.config_dict[PULLS].job
    if job is None:
        raise APIError(404, "no pull has run on this server", code="no_pull")
    return await _stream(request, job)


async def _checked(request: web.Request) -> PullRequest:
    req: PullRequest = await read_request(request, PullRequest)
    req = PullRequest(ref=req.ref.strip(), quant=req.quant)
    if not req.ref:
        raise bad_request("ref is empty: give a zoo name or hf:owner/repo:QUANT", param="ref")
    try:
        await asyncio.to_thread(puller_of(request).check, req.ref, req.quant)
    except BadQuant as e:
        raise bad_request(str(e), param="quant") from None
    except ValueError as e:
        raise bad_request(str(e), param="ref") from None
    return req


async def _stream(request: web.Request, job: PullJob) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    keepalive = request.config_dict[CONFIG].keepalive_s
    try:
        async for event in job.follow(keepalive):
            if event is None:
                await resp.write(b": keep-alive\n\n")
            else:
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write_eof()
    except ConnectionError:  # the page left; the pull goes on
        pass
    return resp
