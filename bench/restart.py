"""A restart with warm sessions: `python -m bench.restart`.

Fills a --session-dir with N sessions of S tokens each (distinct prompts, each served once), stops
the scheduler (every session saved with its KV), then starts it again and times how long the
restore takes until all of them are warm, by how many came back by KV import and how many were
fed again from their ids. The baseline is the same restore with the KV stripped from the files
(every session fed again: what a restart cost before sessions came back by import), in the same
run. Prints the CPU model beside the figures: ratios differ between this pool's AMD and Intel hosts.

    python -m bench.restart --model qwen2.5-coder-0.5b --sessions 8 --tokens 2048
    python -m bench.restart --model qwen2.5-coder-1.5b --sessions 16 --tokens 4096   # issue 33's case
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.run import MODELS, _ensure_bundle


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _restore(model, config) -> tuple[float, dict[str, int]]:
    """Seconds until the scheduler holds every session warm, and how they came back."""
    from goinfer.runtime.scheduler import Scheduler

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("goinfer.runtime")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        t0 = time.perf_counter()
        sched = Scheduler(model, config)
        seconds = time.perf_counter() - t0
    finally:
        log.removeHandler(handler)
    warm = sched.pool.warm
    sched.stop()
    restored = next((ln for ln in lines if ln.startswith("restored")), "")
    for ln in lines:
        _log(ln)
    imported = int(restored.split("(")[1].split(" by")[0]) if "by KV import" in restored else 0
    return seconds, {"warm": warm, "imported": imported, "fed": warm - imported}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", choices=MODELS)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument(
        "--no-baseline", action="store_true", help="skip the ids-only restore (it re-prefills all)"
    )
    p.add_argument("--dir", help="keep the sessions here, and reuse them if it already holds them")
    a = p.parse_args(argv)

    from goinfer.compiler.sources import zoo
    from goinfer.runtime import session_store as store
    from goinfer.runtime.config import SchedulerConfig
    from goinfer.runtime.decode import GenerationRequest
    from goinfer.runtime.model import Model
    from goinfer.runtime.sampler import SamplingParams
    from goinfer.runtime.scheduler import Scheduler

    bundle = _ensure_bundle(zoo.fetch(a.model), "gguf")
    model = Model.load(bundle, self_test=False)
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="goinfer-restart-"))
    try:
        config = SchedulerConfig(
            kv_sessions=a.sessions, session_dir=str(root), kv_tokens=a.sessions * (a.tokens + 64)
        )
        if len(store.listing(root, model.bundle.header_sha256)) < a.sessions:
            _log(f"serving {a.sessions} sessions of {a.tokens} tokens on {a.model}")
            sched = Scheduler(model, config)
            rng = np.random.default_rng(0)
            once = SamplingParams(temperature=0.0, max_tokens=1)
            for i in range(a.sessions):
                ids = [int(t) for t in rng.integers(100, model.spec.vocab_size - 100, a.tokens)]
                list(sched.generate(GenerationRequest(ids, once)))
                _log(f"  session {i + 1}/{a.sessions} served")
            sched.stop()  # saves every session with its KV
        saved = store.listing(root, model.bundle.header_sha256)
        mib = sum(f.stat().st_size for f in saved) / 2**20
        _log(f"saved {len(saved)} files, {mib:.0f} MiB")

        by_import, got = _restore(model, config)
        if a.no_baseline:
            fed, base = float("nan"), {"warm": 0}
            return _report(a, mib, by_import, got, fed, base)
        stripped = root.parent / (root.name + "-ids")
        shutil.copytree(root, stripped)
        for f in store.listing(stripped, model.bundle.header_sha256):  # the same sessions, ids only
            s = store.load(f, model.bundle.header_sha256)
            store.save(stripped, model.bundle.header_sha256, store.SavedSession(s.key, s.tokens, s.last_used))
        fed, base = _restore(model, dataclasses.replace(config, session_dir=str(stripped)))
        shutil.rmtree(stripped, ignore_errors=True)
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    return _report(a, mib, by_import, got, fed, base)


def _report(a, mib: float, by_import: float, got: dict, fed: float, base: dict) -> int:
    print(f"{a.model} gguf, {a.sessions} sessions x {a.tokens} tokens ({mib:.0f} MiB on disk), {cpu_model()}")
    print(f"  restore with KV:  {by_import:6.2f} s to {got['warm']} warm ({got['imported']} by KV import, "
          f"{got['fed']} fed again)")  # fmt: skip
    if base["warm"]:
        print(f"  ids only (before): {fed:6.2f} s to {base['warm']} warm (all fed again)")
        print(f"  ratio: {by_import / fed:.2f}x the re-prefill restore")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
