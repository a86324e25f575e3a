"""How long `goinfer build` takes, cold and warm, and its peak memory: each zoo model, default options.

    python -m bench.build_speed                       # the four zoo LLMs: one cold build, two warm
    python -m bench.build_speed --models qwen2.5-coder-0.5b --warm 3 --json build.json

Cold: a fresh goinfer cache root whose models/ links to the real one (nothing is downloaded) and
whose module cache is empty, so every module and self-test library is compiled. Warm: the same
root again, as after a change to the weights alone: the modules come from the cache, and only the
checkpoint is read and its weights packed and written. Each build is its own process (the CLI, as
a user runs it); its wall time and peak RSS (wait4's, of that process alone) are recorded, with
the load average beside them: on a shared host other work moves both. A warm bundle must be byte
for byte the cold one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import llama_cpp

MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m", "smollm2-135m")


@dataclass(frozen=True)
class Run:
    model: str
    kind: str  # "cold" | "warm"
    seconds: float  # wall, the process's whole life
    peak_rss_mb: float
    bundle_mb: float
    sha256: str
    load_before: float  # 1-minute load average as the build started


@dataclass(frozen=True)
class Row:
    model: str
    cold_s: float
    cold_rss_mb: float
    warm_s: float  # median of the warm runs
    warm_rss_mb: float  # the largest of the warm runs
    bundle_mb: float
    identical: bool  # every warm bundle byte for byte the cold one


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def build_once(model: str, root: Path, out: Path, kind: str) -> Run:
    """One `goinfer build` in a child process with `root` as its cache; wall seconds and its peak RSS."""
    env = {**os.environ, "GOINFER_CACHE": str(root)}
    cmd = [sys.executable, "-m", "goinfer.cli.main", "build", model, "-o", str(out)]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()  # the build's progress lines: kept for a failure's message
    _pid, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-5:]
        raise SystemExit(f"bench: {model} {kind} build failed ({proc.returncode}):\n" + "\n".join(tail))
    rss_mb = usage.ru_maxrss / 1024 if sys.platform != "darwin" else usage.ru_maxrss / 2**20
    return Run(model, kind, seconds, rss_mb, out.stat().st_size / 2**20, _sha256(out), load)


def fresh_root(parent: Path | None) -> Path:
    """A cache root with an empty module cache, its models/ the real cache's (no download)."""
    from goinfer.artifacts import cache

    root = Path(tempfile.mkdtemp(prefix="goinfer-build-speed-", dir=parent))
    (root / "models").symlink_to(cache.folder("models").resolve(), target_is_directory=True)
    return root


def measure(model: str, warm: int, parent: Path | None, keep: bool) -> tuple[Row, list[Run]]:
    root = fresh_root(parent)
    try:
        runs = [build_once(model, root, root / "cold.giw", "cold")]
        _log(f"{model} cold: {runs[0].seconds:.1f} s, {runs[0].peak_rss_mb:.0f} MB")
        for i in range(warm):
            runs.append(build_once(model, root, root / f"warm{i}.giw", "warm"))
            _log(f"{model} warm {i + 1}/{warm}: {runs[-1].seconds:.1f} s, {runs[-1].peak_rss_mb:.0f} MB")
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            _log(f"kept {root}")
    cold, warms = runs[0], runs[1:]
    row = Row(
        model,
        cold.seconds,
        cold.peak_rss_mb,
        statistics.median(r.seconds for r in warms) if warms else float("nan"),
        max((r.peak_rss_mb for r in warms), default=float("nan")),
        cold.bundle_mb,
        all(r.sha256 == cold.sha256 for r in warms),
    )
    return row, runs


def table(rows: list[Row]) -> str:
    head = (
        f"{'model':20} {'cold s':>7} {'cold RSS MB':>11} {'warm s':>7} {'warm RSS MB':>11} "
        f"{'bundle MiB':>10} {'identical':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.model:20} {r.cold_s:7.1f} {r.cold_rss_mb:11.0f} {r.warm_s:7.1f} {r.warm_rss_mb:11.0f} "
            f"{r.bundle_mb:10.1f} {'yes' if r.identical else 'NO':>9}"
        )
    return "\n".join(lines)


def parse_models(value: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in MODELS]
    if unknown or not items:
        raise SystemExit(
            f"bench: unknown model {', '.join(unknown) or '(none)'}; choose from {', '.join(MODELS)}"
        )
    return items


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.build_speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--warm", type=int, default=2, help="warm builds after the cold one (default 2)")
    ap.add_argument("--root", type=Path, default=None, help="where the fresh cache roots go (default: tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the cache roots and bundles")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    models = parse_models(a.models)

    from goinfer.compiler.sources import zoo

    for name in models:  # fetched (and verified) into the real cache first, not timed
        zoo.resolve(name)
    rows, runs = [], []
    for name in models:
        row, model_runs = measure(name, a.warm, a.root, a.keep)
        rows.append(row)
        runs += model_runs
    print(
        f"{os.cpu_count()} cores; cold: empty module cache; warm: median of {a.warm} rebuilds;"
        " seconds: wall of the build process; RSS: its peak"
    )
    print(table(rows))
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "cpu": llama_cpp.cpu_name(),
                    "cores": os.cpu_count(),
                    "rows": [asdict(r) for r in rows],
                    "runs": [asdict(r) for r in runs],
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if all(r.identical for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
