"""The served models: each in a slot with its worker threads and a bounded queue.

A slot runs up to `max_concurrent` generations at once, each on a worker thread of its own (the
model's scheduler batches their steps, runtime/scheduler.py); more wait in the executor's queue,
first come first served, up to `max_queue`, and beyond that a request is refused with 429.
Admission is counted on the event loop; a request holds its place until its worker job ends.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import TYPE_CHECKING

from goinfer.runtime.scheduler import Cancelled, KVCacheFull

from .engine import Engine
from .errors import APIError

if TYPE_CHECKING:
    from .events import Delta

log = logging.getLogger("goinfer.serve")
_END = object()


class Generation:
    """One request's run on a slot's worker: deltas out, a cancel flag in.

    Iterate `ticks()` for each Delta, or None whenever `poll_s` passes with nothing new (the caller
    sends a keep-alive or checks its client then). Leaving the iteration early cancels the run.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, poll_s: float):
        self.loop, self.poll_s = loop, poll_s
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.cancelled = threading.Event()

    def _post(self, item: object) -> None:
        with suppress(RuntimeError):  # the loop has closed (server shutdown): nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def work(self, make: Callable[[threading.Event], Iterator[Delta]]) -> None:
        """Runs on the worker thread; `make(cancelled)` starts the generation."""
        if self.cancelled.is_set():  # the client left while this waited in the queue
            self._post(_END)
            return
        try:
            deltas = make(self.cancelled)
            try:
                for d in deltas:
                    if self.cancelled.is_set():
                        break
                    self._post(d)
            finally:
                close = getattr(deltas, "close", None)
                if close is not None:
                    close()
        except Cancelled:
            pass  # the client left mid-prompt: nobody is listening
        except KVCacheFull as e:
            self._post(APIError(503, str(e), code="kv_cache_full", headers={"Retry-After": "1"}))
        except APIError as e:  # the request's fault, found mid-run (a grammar past its first step)
            log.warning("generation stopped: %s", e.message)
            self._post(e)
        except Exception as e:
            log.exception("generation failed")
            self._post(e)
        self._post(_END)

    async def ticks(self) -> AsyncIterator[Delta | None]:
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self.queue.get(), self.poll_s)
                except asyncio.TimeoutError:
                    yield None
                    continue
                if item is _END:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item  # type: ignore[misc]  (a Delta: the worker posts nothing else)
        finally:
            self.cancelled.set()  # harmless once finished; stops the worker if we left early


class ModelSlot:
    def __init__(self, name: str, engine: Engine, max_queue: int, max_concurrent: int = 1):
        self.name, self.engine, self.max_queue = name, engine, max_queue
        self.max_concurrent = max(1, max_concurrent)
        self.executor = ThreadPoolExecutor(
            max_workers=self.max_concurrent, thread_name_prefix=f"goinfer-{name}"
        )
        self.admitted = 0  # running + waiting
        self.runs: set[Generation] = set()
        self.idle = asyncio.Event()
        self.idle.set()

    def submit(
        self, make: Callable[[threading.Event], Iterator[Delta]], poll_s: float, retry_after_s: int = 1
    ) -> Generation:
        """Queue a run, or refuse with 429 when `max_concurrent` run and `max_queue` already wait."""
        if self.admitted >= self.max_queue + self.max_concurrent:
            raise APIError(
                429,
                f"model {self.name!r} is busy: {self.admitted} requests running or queued "
                f"(--max-concurrent {self.max_concurrent}, --max-queue {self.max_queue}); retry later",
                code="queue_full",
                headers={"Retry-After": str(retry_after_s)},
            )
        loop = asyncio.get_running_loop()
        run = Generation(loop, poll_s)
        self.admitted += 1
        self.runs.add(run)
        self.idle.clear()
        future = loop.run_in_executor(self.executor, run.work, make)
        future.add_done_callback(lambda _f: self._finished(run))
        return run

    def _finished(self, run: Generation) -> None:
        self.admitted -= 1
        self.runs.discard(run)
        if self.admitted == 0:
            self.idle.set()

    def cancel_all(self) -> None:
        for run in list(self.runs):
            run.cancelled.set()

    def close(self) -> None:
        self.cancel_all()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.engine.close()


class Registry:
    """Name -> slot. A name being loaded by an admin request answers 503 until it is ready."""

    def __init__(self, max_queue: int, max_concurrent: int = 1):
        self.max_queue, self.max_concurrent = max_queue, max_concurrent
        self.slots: dict[str, ModelSlot] = {}
        self.loading: set[str] = set()

    def add(self, name: str, engine: Engine) -> ModelSlot:
        slot = ModelSlot(name, engine, self.max_queue, self.max_concurrent)
        self.slots[name] = slot
        return slot

    def route(self, name: str | None) -> ModelSlot:
        if name is None:
            if len(self.slots) == 1:
                return next(iter(self.slots.values()))  # one model served: `model` may be left out
            raise APIError(400, "model is required: this server serves several", param="model")
        if name in self.slots:
            return self.slots[name]
        if name in self.loading:
            raise APIError(503, f"model {name!r} is still loading", param="model", code="model_loading")
        served = ", ".join(sorted(self.slots)) or "none"
        raise APIError(
            404,
            f"model {name!r} is not served here (served: {served})",
            param="model",
            code="model_not_found",
        )

    def remove(self, name: str) -> ModelSlot:
        """Make the model unroutable at once; the caller frees it when its runs are done."""
        if name not in self.slots:
            raise APIError(404, f"model {name!r} is not loaded", param="name", code="model_not_found")
        return self.slots.pop(name)
