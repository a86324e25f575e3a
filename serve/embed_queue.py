"""An encoder's own queue and worker thread: /v1/embeddings never waits behind a generation.

Each served encoder has one worker thread of its own (the decoders' generations run on their
slots' threads, registry.py). Requests queue here as tokenized inputs; the worker takes inputs
from the head of the queue until `max_batch_tokens`, across requests, and embeds them in one
`embed_ids` call, so requests that arrive while a forward runs share the next one. A request
larger than the cap is split over several forwards; each request gets its own rows back.

A request whose client has gone (its await cancelled) is skipped where it has not run yet. A
forward that fails is retried one request at a time, so one bad request fails alone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter, deque
from contextlib import suppress
from dataclasses import dataclass, field

import numpy as np

from .config import EmbeddingsConfig
from .engine import Embedder
from .errors import APIError, queue_full

log = logging.getLogger("goinfer.serve")


@dataclass(eq=False)
class _Job:
    """One request's inputs; the worker fills `rows` as forwards finish."""

    inputs: list[list[int]]
    future: asyncio.Future[np.ndarray]
    loop: asyncio.AbstractEventLoop
    rows: np.ndarray | None = None
    taken: int = 0  # inputs handed to a forward so far
    filled: int = 0  # inputs whose rows are in
    gone: threading.Event = field(default_factory=threading.Event)  # cancelled, failed or answered

    def post(self, result: np.ndarray | BaseException) -> None:
        """Answer the waiting request from the worker thread (once)."""
        if self.gone.is_set():
            return
        self.gone.set()
        with suppress(RuntimeError):  # the loop has closed (server shutdown): nobody is listening
            self.loop.call_soon_threadsafe(_settle, self.future, result)


def _settle(future: asyncio.Future[np.ndarray], result: np.ndarray | BaseException) -> None:
    if future.done():  # cancelled meanwhile
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


_Piece = tuple[_Job, int, int]  # a job's inputs [start, end) in one forward


class EncoderSlot:
    def __init__(self, name: str, encoder: Embedder, config: EmbeddingsConfig | None = None):
        self.name, self.encoder = name, encoder
        self.config = config or EmbeddingsConfig()
        self.admitted = 0  # requests running or waiting (counted on the event loop)
        self.forwards = 0  # embed_ids calls made
        # For /metrics: requests answered, their inputs and tokens; refusals by (model, status, reason)
        self.answered = self.inputs_embedded = self.tokens_embedded = 0
        self.refusals: Counter[tuple[str, int, str]] = Counter()
        self._pending: deque[_Job] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"goinfer-embed-{name}", daemon=True)
        self._thread.start()

    async def embed(self, inputs: list[list[int]], retry_after_s: int = 1) -> np.ndarray:
        """The inputs' vectors, (len(inputs), dimensions), in order; a 429 when the queue is full."""
        if self.admitted >= self.config.max_queue:
            self.refusals[(self.name, 429, "queue_full")] += 1
            raise queue_full(
                f"embedding model {self.name!r} is busy: {self.admitted} requests running or queued "
                f"(at most {self.config.max_queue}); retry later",
                retry_after_s,
            )
        loop = asyncio.get_running_loop()
        job = _Job(inputs, loop.create_future(), loop)
        self.admitted += 1
        try:
            with self._wake:
                if self._closed:
                    self.refusals[(self.name, 503, "closed")] += 1
                    raise APIError(503, f"embedding model {self.name!r} is shutting down", code="closed")
                self._pending.append(job)
                self._wake.notify()
            rows = await job.future
            self.answered += 1
            self.inputs_embedded += len(inputs)
            self.tokens_embedded += sum(map(len, inputs))
            return rows
        finally:
            self.admitted -= 1
            job.gone.set()  # the client left (or the answer is in): the worker skips what is left

    # -- the worker thread -----------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                pieces = self._take()
            if pieces:
                self._run(pieces)

    def _take(self) -> list[_Piece]:
        """Inputs from the queue's head up to the token cap (one at least), across requests."""
        cap, tokens, pieces = self.config.max_batch_tokens, 0, []
        while self._pending:
            job = self._pending[0]
            if job.gone.is_set():
                self._pending.popleft()
                continue
            start = job.taken
            while job.taken < len(job.inputs):
                n = len(job.inputs[job.taken])
                if tokens and tokens + n > cap:
                    break
                tokens += n
                job.taken += 1
            if job.taken > start:
                pieces.append((job, start, job.taken))
            if job.taken < len(job.inputs):
                break  # the cap is reached: the rest of this job goes in the next forward
            self._pending.popleft()
        return pieces

    def _run(self, pieces: list[_Piece]) -> None:
        try:
            self._forward(pieces)
        except Exception as e:
            if len({job for job, _, _ in pieces}) == 1:
                self._fail(pieces[0][0], e)
                return
            log.warning("embedding forward of several requests failed (%s); running them one by one", e)
            for piece in pieces:
                try:
                    self._forward([piece])
                except Exception as e1:
                    self._fail(piece[0], e1)

    def _forward(self, pieces: list[_Piece]) -> None:
        live = [(job, s, e) for job, s, e in pieces if not job.gone.is_set()]
        if not live:
            return
        vectors = self.encoder.embed_ids([ids for job, s, e in live for ids in job.inputs[s:e]])
        self.forwards += 1
        row = 0
        for job, s, e in live:
            if job.rows is None:
                job.rows = np.empty((len(job.inputs), vectors.shape[1]), np.float32)
            job.rows[s:e] = vectors[row : row + e - s]
            row += e - s
            job.filled += e - s
            if job.filled == len(job.inputs):
                job.post(job.rows)

    def _fail(self, job: _Job, e: Exception) -> None:
        if isinstance(e, ValueError):  # the encoder refused an input: the request's own fault
            job.post(APIError(400, f"model {self.name!r} cannot embed this input: {e}", param="input"))
            return
        log.error("embedding failed on %s", self.name, exc_info=e)
        job.post(e)

    def close(self) -> None:
        """Stop the worker, answering 503 to requests still waiting; once the forward it may be
        running is done, free the encoder (its weights are a mapping the forward reads)."""
        with self._wake:
            self._closed = True
            waiting = list(self._pending)
            self._pending.clear()
            self._wake.notify_all()
        for job in waiting:
            job.post(APIError(503, f"embedding model {self.name!r} is shutting down", code="closed"))
        self._thread.join()
        self.encoder.close()
