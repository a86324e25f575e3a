"""The served models: each in a slot with its worker threads and a bounded queue.

Two kinds: decoders (Engine, in `slots`: the chat, completions, messages, responses and systemone
routes) and encoders (Embedder, in `encoders`: /v1/embeddings, with a queue of its own,
embed_queue.py). A request that names a model of the other kind is a 400 naming those that can.

A slot runs up to `max_concurrent` generations at once, each on a worker thread of its own (the
model's scheduler batches their steps, runtime/scheduler.py); more wait in the executor's queue,
first come first served, up to `max_queue`, and beyond that a request is refused with 429.
Admission is counted on the event loop; a request holds its place until its worker job ends.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import TYPE_CHECKING

from goinfer.runtime.scheduler import Cancelled, KVCacheFull

from .config import EmbeddingsConfig
from .embed_queue import EncoderSlot
from .engine import Embedder, Engine
from .errors import APIError, queue_full

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
        self.kv_full = False  # refused mid-run for want of KV room: its slot counts the 503

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
            self.kv_full = True
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
        # 429s and 503s by (model, status, reason), for /metrics; the registry shares its own
        self.refusals: Counter[tuple[str, int, str]] = Counter()

    def submit(
        self, make: Callable[[threading.Event], Iterator[Delta]], poll_s: float, retry_after_s: int = 1
    ) -> Generation:
        """Queue a run, or refuse with 429 when `max_concurrent` run and `max_queue` already wait."""
        if self.admitted >= self.max_queue + self.max_concurrent:
            self.refusals[(self.name, 429, "queue_full")] += 1
            raise queue_full(
                f"model {self.name!r} is busy: {self.admitted} requests running or queued "
                f"(--max-concurrent {self.max_concurrent}, --max-queue {self.max_queue}); retry later",
                retry_after_s,
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
        if run.kv_full:
            self.refusals[(self.name, 503, "kv_cache_full")] += 1
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
        self.encoders: dict[str, EncoderSlot] = {}
        self.loading: set[str] = set()
        self.refusals: Counter[tuple[str, int, str]] = Counter()  # every slot's, and loading's (/metrics)
        # Raises the 503 while new generations are halted (guards.py's Halt.check; none in bare tests)
        self.check_halt: Callable[[], None] = lambda: None

    def add(self, name: str, engine: Engine) -> ModelSlot:
        if name in self.encoders:
            raise ValueError(f"model name {name!r} is given twice (an embedding model has it)")
        slot = ModelSlot(name, engine, self.max_queue, self.max_concurrent)
        slot.refusals = self.refusals
        self.slots[name] = slot
        return slot

    def add_encoder(self, name: str, encoder: Embedder, config: EmbeddingsConfig) -> EncoderSlot:
        if name in self.slots:
            raise ValueError(f"model name {name!r} is given twice (a chat model has it)")
        slot = EncoderSlot(name, encoder, config)
        slot.refusals = self.refusals
        self.encoders[name] = slot
        return slot

    def route(self, name: str | None) -> ModelSlot:
        """The decoder a generation (or decision) request names."""
        self.check_halt()
        if name is None:
            if len(self.slots) == 1:
                return next(iter(self.slots.values()))  # one model served: `model` may be left out
            if not self.slots and self.encoders:
                raise self._wrong_kind(None, "embedding")
            raise APIError(400, "model is required: this server serves several", param="model")
        if name in self.slots:
            return self.slots[name]
        if name in self.encoders:
            raise self._wrong_kind(name, "embedding")
        raise self._unknown(name)

    def route_encoder(self, name: str | None) -> EncoderSlot:
        """The encoder an embeddings request names."""
        self.check_halt()
        if name is None:
            if len(self.encoders) == 1:
                return next(iter(self.encoders.values()))
            if not self.encoders:
                raise self._wrong_kind(None, "chat")
            raise APIError(400, "model is required: this server serves several embedding models", "model")
        if name in self.encoders:
            return self.encoders[name]
        if name in self.slots:
            raise self._wrong_kind(name, "chat")
        raise self._unknown(name)

    def _wrong_kind(self, name: str | None, kind: str) -> APIError:
        """`name` (None: every model served) is of `kind`; the request needs the other kind."""
        chat, embedding = ", ".join(sorted(self.slots)), ", ".join(sorted(self.encoders))
        if kind == "embedding":
            what = f"model {name!r} is an embedding model" if name else "this server serves no chat model"
            why = f"{what}: use POST /v1/embeddings for it; chat models here: {chat or 'none'}"
        else:
            what = f"model {name!r} is a chat model" if name else "this server serves no embedding model"
            embedding = embedding or "none (serve one with --embed-model)"
            why = f"{what}: it does not embed; embedding models here: {embedding}"
        return APIError(400, why, param="model", code="wrong_model_kind")

    def _unknown(self, name: str) -> APIError:
        if name in self.loading:
            self.refusals[(name, 503, "model_loading")] += 1
            return APIError(503, f"model {name!r} is still loading", param="model", code="model_loading")
        served = ", ".join(sorted({*self.slots, *self.encoders})) or "none"
        return APIError(
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
