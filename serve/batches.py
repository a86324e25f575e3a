"""Batches on disk, and the task that runs them: OpenAI's /v1/batches and Anthropic's
/v1/messages/batches are two views of one record (batch_routes.py, batch_anthropic.py).

    <batch dir>/batches/<id>/batch.json     the state: OpenAI's Batch object, and ours beside it
    <batch dir>/batches/<id>/input.jsonl    the requests (the input file's copy, or the inline ones)
    <batch dir>/batches/<id>/results.jsonl  a line per finished request, fsynced one by one

The status machine is OpenAI's:

    validating -> in_progress -> finalizing -> completed
         \\-> failed       \\-> cancelling -> (finalizing) -> cancelled
                           \\-> (window passed) -> (finalizing) -> expired

Each transition is written atomically before it acts; results.jsonl is the progress, so a process
killed anywhere resumes the batch where it was: lines with a result are not run again, a torn last
result is cut and its line runs again (batch_format.ResultLog). Finalizing writes the output and
error files under ids fixed by the batch's, so doing it twice writes the same files.
Batches run one at a time, oldest first, their lines concurrently at batch priority (batch_exec.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from . import batch_exec
from .batch_format import (
    FormatError,
    Line,
    ResultLog,
    cannot_do,
    error_line,
    new_salt,
    output_line,
    parse_lines,
    prepared,
    succeeded,
    write_atomic,
)
from .config import ServeConfig
from .errors import APIError
from .files import FileStore, new_id
from .registry import Registry

log = logging.getLogger("goinfer.serve")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "cancelled", "expired")
CANCELLED, EXPIRED = "batch_cancelled", "batch_expired"  # the error codes of lines never run


class Batches:
    """The record of every batch, and the worker that runs the active ones."""

    def __init__(self, root: Path, registry: Registry, config: ServeConfig):
        self.root, self.registry, self.config = root, registry, config
        self.dir = root / "batches"
        self.files = FileStore(root)
        self.wake = asyncio.Event()
        self.cancels: dict[str, asyncio.Event] = {}
        self.live: dict[str, ResultLog] = {}  # the running batch's results, for its counts
        self.gate = batch_exec.Gate(limit=max(1, config.max_concurrent), reserve=1)

    # -- the record ------------------------------------------------------------------------------
    def _path(self, batch_id: str) -> Path:
        return self.dir / batch_id / "batch.json"

    def load(self, batch_id: str, kind: str | None = None) -> dict[str, Any]:
        """The stored state; a 404 for an id not here (or another API's batch)."""
        ok = batch_id.replace("_", "").replace("-", "").isalnum() and len(batch_id) < 100
        try:
            state = json.loads(self._path(batch_id).read_text()) if ok else None
        except (OSError, ValueError):
            state = None
        if state is None or (kind is not None and state["kind"] != kind):
            raise APIError(
                404, f"no batch with id {batch_id[:100]!r}", param="batch_id", code="batch_not_found"
            )
        return state

    def save(self, state: dict[str, Any]) -> None:
        write_atomic(self._path(state["batch"]["id"]), json.dumps(state).encode())

    def all(self, kind: str) -> list[dict[str, Any]]:
        out = []
        for path in self.dir.glob("*/batch.json") if self.dir.is_dir() else ():
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if state.get("kind") == kind:
                out.append(state)
        return sorted(out, key=lambda s: (s["batch"]["created_at"], s["batch"]["id"]), reverse=True)

    def create(
        self,
        kind: str,
        endpoint: str,
        input_lines: bytes,
        input_file_id: str | None,
        metadata: Any,
        window: str,
    ) -> dict[str, Any]:
        prefix = "msgbatch" if kind == "anthropic" else "batch"
        batch_id = new_id(prefix).replace("-", "_")
        now = int(time.time())
        folder = self.dir / batch_id
        write_atomic(folder / "input.jsonl", input_lines)
        batch = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + self.config.batch.completion_window_s,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        state = {"kind": kind, "salt": new_salt(), "batch": batch, "ended_by": None}
        self.save(state)
        self.wake.set()
        return state

    def cancel(self, state: dict[str, Any]) -> dict[str, Any]:
        b = state["batch"]
        if b["status"] in ("validating", "in_progress"):
            b["status"], b["cancelling_at"] = "cancelling", int(time.time())
            self.save(state)
            self.cancels.setdefault(b["id"], asyncio.Event()).set()
            self.wake.set()
        return state

    def results(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        """Every line's result, in the input's order (an ended batch's)."""
        folder = self.dir / state["batch"]["id"]
        path = folder / "results.jsonl"
        records = {r["custom_id"]: r for r in ResultLog.read(path)} if path.exists() else {}
        try:
            lines = parse_lines((folder / "input.jsonl").read_bytes(), state["batch"]["endpoint"])
        except FormatError:
            lines = []
        return [records[line.custom_id] for line in lines if line.custom_id in records]

    def counts(self, state: dict[str, Any]) -> dict[str, int]:
        """OpenAI's request_counts, live while the batch runs."""
        b = state["batch"]
        log_ = self.live.get(b["id"])
        if log_ is None:
            return b["request_counts"]
        ok = sum(1 for r in log_.records if succeeded(r))
        return {"total": b["request_counts"]["total"], "completed": ok, "failed": len(log_.records) - ok}

    # -- the worker ------------------------------------------------------------------------------
    async def run_forever(self) -> None:
        while True:
            self.wake.clear()
            active = [
                s
                for s in reversed(self.all("openai") + self.all("anthropic"))
                if s["batch"]["status"] in ACTIVE
            ]
            active.sort(key=lambda s: (s["batch"]["created_at"], s["batch"]["id"]))
            if not active:
                await self.wake.wait()
                continue
            try:
                await self.step(active[0])
            except asyncio.CancelledError:
                raise
            except Exception:  # a batch must not take the worker down with it
                log.exception("batch %s failed", active[0]["batch"]["id"])
                self._fail(active[0], "internal_error", "the batch failed (the server log has the details)")

    async def step(self, state: dict[str, Any]) -> None:
        """Move the batch one status on (each persisted before the next begins)."""
        b = state["batch"]
        status = b["status"]
        if status == "validating":
            self._validate(state)
        elif status in ("in_progress", "cancelling"):
            await self._run(state)
        elif status == "finalizing":
            self._finalize(state)

    def _validate(self, state: dict[str, Any]) -> None:
        b = state["batch"]
        try:
            lines = self._lines(state)
        except FormatError as e:
            self._fail(state, e.code, str(e), e.line)
            return
        b["request_counts"]["total"] = len(lines)
        b["status"], b["in_progress_at"] = "in_progress", int(time.time())
        self.save(state)
        log.info("batch %s: %d requests to %s", b["id"], len(lines), b["endpoint"])

    def _lines(self, state: dict[str, Any]) -> list[Line]:
        data = (self.dir / state["batch"]["id"] / "input.jsonl").read_bytes()
        return parse_lines(data, state["batch"]["endpoint"], self.config.batch.max_lines)

    def _fail(self, state: dict[str, Any], code: str, message: str, line: int | None = None) -> None:
        b = state["batch"]
        b["errors"] = {
            "object": "list",
            "data": [{"code": code, "message": message, "param": None, "line": line}],
        }
        b["status"], b["failed_at"] = "failed", int(time.time())
        self.save(state)

    async def _run(self, state: dict[str, Any]) -> None:
        b = state["batch"]
        results = ResultLog(self.dir / b["id"] / "results.jsonl")
        self.live[b["id"]] = results
        cancel = self.cancels.setdefault(b["id"], asyncio.Event())
        if b["status"] == "cancelling":
            cancel.set()
        try:
            done = results.done_ids()
            todo = [line for line in self._lines(state) if line.custom_id not in done]
            ended = await self._lines_run(state, todo, results, cancel)
            finished = results.done_ids()
            for line in todo if ended != "completed" else ():  # never ran: cancelled, or too late
                if line.custom_id not in finished:
                    code = CANCELLED if ended == "cancelled" else EXPIRED
                    why = "the batch was cancelled" if ended == "cancelled" else "the batch's window passed"
                    results.append(
                        error_line(line.custom_id, code, f"{why} before this request ran", state["salt"])
                    )
            b["request_counts"] = self.counts(state)
            state["ended_by"] = ended
            b["status"], b["finalizing_at"] = "finalizing", int(time.time())
            self.save(state)
        finally:
            results.close()
            self.live.pop(b["id"], None)

    async def _lines_run(
        self, state: dict[str, Any], todo: list[Line], results: ResultLog, cancel: asyncio.Event
    ) -> str:
        """Run the lines, `gate.limit` at once; how the run ended: completed, cancelled or expired."""
        b, salt = state["batch"], state["salt"]
        running: set[asyncio.Task] = set()
        pending = list(reversed(todo))
        ended = "completed"
        while pending or running:
            if cancel.is_set():
                ended = "cancelled"
            elif time.time() > b["expires_at"]:
                ended = "expired"
            if ended != "completed":
                for t in running:
                    t.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                return ended
            while pending and len(running) < self.gate.limit:
                running.add(asyncio.create_task(self._line(pending.pop(), salt, results)))
            waiter = asyncio.create_task(cancel.wait())
            done, _ = await asyncio.wait({*running, waiter}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            running -= done
        return ended

    async def _line(self, line: Line, salt: str, results: ResultLog) -> None:
        why = cannot_do(line.url, line.body)
        if why is not None:
            results.append(error_line(line.custom_id, "unsupported_in_batch", why, salt))
            return
        try:
            body = prepared(line, salt)
            out = await batch_exec.answer(self.registry, self.config, line.url, body, self.gate)
        except asyncio.CancelledError:
            raise
        except Exception:  # the line's failure, not the batch's: recorded, the rest go on
            log.exception("batch line %r failed", line.custom_id)
            results.append(error_line(line.custom_id, "internal_error", "the request failed", salt))
            return
        if out.status == 200:
            results.append(output_line(line.custom_id, 200, out.body, salt))
        else:
            err = out.body.get("error") or {}
            code = err.get("code") or err.get("type") or f"http_{out.status}"
            results.append(error_line(line.custom_id, str(code), str(err.get("message", "")), salt))

    def _finalize(self, state: dict[str, Any]) -> None:
        b = state["batch"]
        results = self.results(state)
        if state["kind"] == "openai":
            ok = [r for r in results if succeeded(r)]
            bad = [r for r in results if not succeeded(r)]
            body = b"".join(_dumps(r) for r in ok)
            errs = b"".join(_dumps(r) for r in bad)
            stem = b["id"].removeprefix("batch_")
            if ok:
                b["output_file_id"] = f"file-{stem}-output"
                self.files.put(b["output_file_id"], f"{b['id']}_output.jsonl", "batch_output", body)
            if bad:
                b["error_file_id"] = f"file-{stem}-errors"
                self.files.put(b["error_file_id"], f"{b['id']}_error.jsonl", "batch_output", errs)
        ended = state.get("ended_by") or "completed"
        now = int(time.time())
        b["status"] = ended
        b[{"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[ended]] = now
        self.save(state)
        log.info("batch %s %s: %s", b["id"], ended, b["request_counts"])


def _dumps(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False).encode() + b"\n"


BATCHES = web.AppKey("batches", Batches)


async def running(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the worker runs while the app does (stopped before the models close)."""
    task = asyncio.create_task(app[BATCHES].run_forever(), name="batches")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def make(config: ServeConfig, registry: Registry) -> tuple[Batches, Path | None]:
    """The batch record for an app, and the temporary folder to remove with it (or None)."""
    if config.batch.dir:
        return Batches(Path(config.batch.dir).expanduser(), registry, config), None
    tmp = Path(tempfile.mkdtemp(prefix="goinfer-batches-"))
    return Batches(tmp, registry, config), tmp


def remove_later(tmp: Path | None) -> Any:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    return ctx
