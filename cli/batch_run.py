"""The local batch runner: a batch JSONL file through a model with no server
(`goinfer chat MODEL --batch in.jsonl -o out.jsonl` calls `run_batch_file`).

The same format (serve/batch_format.py) and the same path a server's line takes (serve/
batch_exec.py: the route's schema, the pipeline, the model's scheduler, `max_concurrent` lines at
once so their decode steps batch). Durable the same way: each answered line is appended to the
output and fsynced before the next is written; a rerun skips the custom_ids already there and cuts
a torn last line. Failed lines go to OUT.errors.jsonl (this run's only) and are tried again next run.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from goinfer.runtime.thinking import ThinkingConfig
from goinfer.serve.batch_format import (
    Line,
    ResultLog,
    cannot_do,
    error_line,
    new_salt,
    output_line,
    parse_lines,
    prepared,
)

STILL_RUNNING_S = 60.0  # a "still running" line this often while no line finishes
ETA_AFTER = 10  # lines finished this run before an estimate is shown
MODEL_NAME = "model"  # the one model every line runs on (a line's own "model" is not consulted)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def errors_path(output_path: Path) -> Path:
    """out.jsonl -> out.errors.jsonl (anything else: NAME.errors.jsonl)."""
    stem = output_path.name.removesuffix(".jsonl")
    return output_path.with_name(f"{stem}.errors.jsonl")


def run_batch_file(
    model_ref: str,
    input_path: Path,
    output_path: Path,
    *,
    max_concurrent: int,
    overrides: dict[str, Any],
    self_test: bool = True,
    progress: Callable[[str], None] = _stderr,
    thinking: ThinkingConfig = ThinkingConfig(),  # noqa: B008 - frozen
) -> int:
    """Run every line of `input_path` not yet answered in `output_path`; the exit status: 0 every
    line answered, 1 some failed (in OUT.errors.jsonl), 130 interrupted. `overrides` (temperature,
    top_p, top_k, seed, max_tokens, system; None: not given) apply to every line; `thinking` is a
    thinking model's mode and budget (`goinfer chat --thinking`), as a server's. A file that is
    not a batch file raises ValueError (batch_format.FormatError) naming its first bad line;
    a model that cannot load, ValueError with the reason."""
    lines = parse_lines(Path(input_path).read_bytes())
    output_path = Path(output_path)
    out = ResultLog(output_path)
    try:
        done = out.done_ids()
        todo = [line for line in lines if line.custom_id not in done]
        errors = ResultLog(errors_path(output_path), truncate=True)  # only this run's failures
        try:
            if not todo:
                progress(f"nothing to do: all {len(lines)} lines are in {output_path}")
                return 0
            progress(f"{len(todo)} of {len(lines)} lines to run ({len(done)} done); loading {model_ref}")
            engine = _load(model_ref, max_concurrent, self_test)
            info = getattr(engine, "info", None)
            if info is not None:
                progress(f"model: {info.decode_path}; {max_concurrent} lines at once")
            run = _Run(
                engine, max_concurrent, out, errors, len(lines), len(done), progress, overrides, thinking
            )
            try:
                failed = asyncio.run(run.all(todo))
            except KeyboardInterrupt:
                progress(f"interrupted: {run.finished} lines finished this run; rerun to go on")
                return 130
            finally:
                run.close()
            return 1 if failed else 0
        finally:
            errors.close()
    finally:
        out.close()


def _load(model_ref: str, max_concurrent: int, self_test: bool) -> Any:
    """The model as `goinfer serve` loads it (cli/main.py's engine_loader): a .giw, or a checkpoint
    or zoo name built once into the cache."""
    from goinfer.compiler.build import BuildOptions
    from goinfer.runtime.config import SchedulerConfig

    from .main import engine_loader

    config = SchedulerConfig(max_concurrent=max_concurrent)
    return engine_loader(BuildOptions(), self_test, config)(MODEL_NAME, model_ref, None)


class _Run:
    def __init__(
        self,
        engine: Any,
        max_concurrent: int,
        out: ResultLog,
        errors: ResultLog,
        total: int,
        done: int,
        progress: Callable[[str], None],
        overrides: dict[str, Any],
        thinking: ThinkingConfig = ThinkingConfig(),  # noqa: B008 - frozen
    ):
        from goinfer.serve.batch_exec import Gate
        from goinfer.serve.config import ServeConfig
        from goinfer.serve.registry import Registry

        self.registry = Registry(max_queue=0, max_concurrent=max_concurrent)
        self.registry.add(MODEL_NAME, engine)
        self.config = ServeConfig(max_concurrent=max_concurrent, poll_s=0.05, thinking=thinking)
        self.gate = Gate(limit=max_concurrent, reserve=0)  # no interactive requests to make room for
        self.out, self.errors, self.progress, self.overrides = out, errors, progress, overrides
        self.total, self.done, self.finished, self.failed = total, done, 0, 0
        self.salt = new_salt()
        self.started = time.monotonic()
        self.last_finish = self.started
        self.inflight: dict[str, float] = {}

    async def all(self, todo: list[Line]) -> int:
        ticker = asyncio.create_task(self._still_running())
        pending = list(reversed(todo))
        running: set[asyncio.Task] = set()
        try:
            while pending or running:
                while pending and len(running) < self.gate.limit:
                    running.add(asyncio.create_task(self._line(pending.pop())))
                _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ticker.cancel()
            for t in running:
                t.cancel()
            await asyncio.gather(ticker, *running, return_exceptions=True)
        return self.failed

    async def _line(self, line: Line) -> None:
        from goinfer.serve.batch_exec import answer

        start = time.monotonic()
        self.inflight[line.custom_id] = start
        try:
            why = cannot_do(line.url, line.body)
            if why is not None:
                self._failed(line, "unsupported_in_batch", why)
                return
            body = prepared(line, self.salt, self.overrides)
            body.pop("model", None)  # the command line's model answers every line
            try:
                got = await answer(self.registry, self.config, line.url, body, self.gate)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # one line's failure; the others go on
                self._failed(line, "internal_error", f"{type(e).__name__}: {e}")
                return
            if got.status != 200:
                err = got.body.get("error") or {}
                self._failed(line, str(err.get("code") or f"http_{got.status}"), str(err.get("message", "")))
                return
            self.out.append(output_line(line.custom_id, 200, got.body, self.salt))
            seconds = time.monotonic() - start
            rate = got.tokens / seconds if seconds > 0 else 0.0
            self._report(f"{line.custom_id} ok {got.tokens} tok {rate:.1f} tok/s")
        finally:
            self.inflight.pop(line.custom_id, None)

    def _failed(self, line: Line, code: str, message: str) -> None:
        self.errors.append(error_line(line.custom_id, code, message, self.salt))
        self.failed += 1
        self._report(f"{line.custom_id} failed ({code}): {message}")

    def _report(self, what: str) -> None:
        self.finished += 1
        self.last_finish = now = time.monotonic()
        elapsed = now - self.started
        line = f"[{self.done + self.finished}/{self.total}] {what} elapsed {_span(elapsed)}"
        left = self.total - self.done - self.finished
        if self.finished >= ETA_AFTER and left:
            line += f" eta ~{_span(elapsed / self.finished * left)}"  # a mean: lines differ in cost
        self.progress(line)

    async def _still_running(self) -> None:
        while True:
            await asyncio.sleep(STILL_RUNNING_S)
            now = time.monotonic()
            if self.inflight and now - self.last_finish >= STILL_RUNNING_S:
                cid, since = min(self.inflight.items(), key=lambda kv: kv[1])
                self.progress(
                    f"… still running: {len(self.inflight)} in flight, {cid} for {_span(now - since)} "
                    f"(elapsed {_span(now - self.started)})"
                )

    def close(self) -> None:
        for slot in self.registry.slots.values():
            slot.close()


def _span(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
