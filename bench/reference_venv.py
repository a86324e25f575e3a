"""Throwaway venvs for reference tools that cannot live in the project's venv:
`python -m bench.reference_venv [st-venv|kserve-venv]`.

torch is never the project's dependency: the embeddings' reference (sentence-transformers' own
output) and llama.cpp's GGUF converter (which imports torch and transformers) run in
``<cache>/st-venv``. The kserve SDK pins protobuf 6 while our checked-in gRPC code is protobuf 7's,
so its clients and models (tests/kserve_sdk.py) run in ``<cache>/kserve-venv``. Each is created
here once and reused. A stamp inside it records the pins it was made with; a changed pin installs
again. A lock keeps a bench and a test from building it at once.

torch==2.13.0 is the CPU wheel that lies on this kind of machine's disk (/opt/wheels, on pip's
find-links); an unpinned torch would pull a CUDA build of several GB from PyPI. transformers is held
at the converter's own pin (vendor/llama.cpp/requirements), and sentence-transformers at the newest
release that pip resolves beside it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from goinfer.artifacts import cache

REQUIREMENTS = (
    "torch==2.13.0",
    "transformers==4.57.6",
    "sentence-transformers==5.7.0",
    "sentencepiece==0.2.2",  # the converter imports it for some vocabularies
)
STAMP = "goinfer-reference.json"
REPO = Path(__file__).resolve().parents[1]  # bench.st_embed runs from here, as `python -m`


@dataclass(frozen=True)
class Spec:
    """One reference venv: its folder under the cache and the pins pip installs into it."""

    name: str
    requirements: tuple[str, ...]


SENTENCE_TRANSFORMERS = Spec("st-venv", REQUIREMENTS)
# kserve pins protobuf<7 (and brings pandas, fastapi and the Kubernetes client): about a minute and
# 450 MB on first use.
KSERVE = Spec("kserve-venv", ("kserve==0.21.0",))
SPECS = {s.name: s for s in (SENTENCE_TRANSFORMERS, KSERVE)}


def _log(msg: str) -> None:
    print(f"reference venv: {msg}", file=sys.stderr, flush=True)


def venv_dir(cache_root: Path | None = None, spec: Spec = SENTENCE_TRANSFORMERS) -> Path:
    return (Path(cache_root) if cache_root is not None else cache.root()) / spec.name


def python_path(cache_root: Path | None = None, spec: Spec = SENTENCE_TRANSFORMERS) -> Path:
    return venv_dir(cache_root, spec) / "bin" / "python"


def _base_python() -> str:
    """The interpreter to make the venv from: torch's wheel on disk is for CPython 3.11."""
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    return shutil.which("python3.11") or sys.executable


def ready(cache_root: Path | None = None, spec: Spec = SENTENCE_TRANSFORMERS) -> bool:
    """True when the venv exists with these pins (a stat and a small read)."""
    try:
        stamp = json.loads((venv_dir(cache_root, spec) / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("requirements") == list(spec.requirements) and python_path(cache_root, spec).is_file()


def _run(cmd: list[str]) -> None:
    _log("$ " + " ".join(cmd))
    # pip's own lines go through: installing torch takes a minute, and shows what it is doing.
    rc = subprocess.run(cmd, stdout=sys.stderr).returncode
    if rc != 0:
        raise SystemExit(f"reference venv: step failed (exit {rc}): {' '.join(cmd)}")


def ensure(cache_root: Path | None = None, spec: Spec = SENTENCE_TRANSFORMERS) -> Path:
    """The reference venv's python, creating or updating the venv first when needed."""
    python = python_path(cache_root, spec)
    if ready(cache_root, spec):
        return python
    vdir = venv_dir(cache_root, spec)
    vdir.parent.mkdir(parents=True, exist_ok=True)
    with open(vdir.parent / f"{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if ready(cache_root, spec):
            return python
        t0 = time.monotonic()
        (vdir / STAMP).unlink(missing_ok=True)
        if not python.is_file():
            _log(f"creating {vdir}")
            _run([_base_python(), "-m", "venv", str(vdir)])
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
        _log(f"installing {', '.join(spec.requirements)} into {spec.name} (a minute or two)")
        _run([*pip, "--progress-bar", "off", *spec.requirements])
        stamp = {"requirements": list(spec.requirements), "seconds": round(time.monotonic() - t0)}
        (vdir / STAMP).write_text(json.dumps(stamp) + "\n")
        _log(f"ready in {time.monotonic() - t0:.0f} s: {python}")
    return python


def env(threads: int | None = None) -> dict[str, str]:
    """The environment to run the venv's python in: offline (the checkpoints are local folders and
    no hub is reachable), and torch's threads pinned where `threads` is given."""
    out = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    out.pop("PYTHONPATH", None)  # the project's venv must not leak into this one
    if threads is not None:
        out["OMP_NUM_THREADS"] = out["MKL_NUM_THREADS"] = str(threads)
    return out


def embeddings(texts: Sequence[str], model: str = "all-minilm-l6-v2") -> np.ndarray:
    """sentence-transformers' own vectors for `texts` (float32, L2-normalized, one row a text) from
    the zoo model `model`, computed once in the reference venv and cached under
    ``<cache>/st-reference/``, keyed by the texts, the checkpoint's sha256 and the venv's pins."""
    from goinfer.compiler.sources import zoo

    key = json.dumps(
        {"texts": list(texts), "model_sha256": zoo.ZOO[model].sha256, "requirements": list(REQUIREMENTS)}
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    out = cache.root() / "st-reference" / f"{model}-{digest}.npy"
    if out.is_file():
        return np.load(out)
    model_dir = zoo.resolve(model)
    python = ensure()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="st-reference-", dir=out.parent) as tmp:
        texts_json, vectors = Path(tmp) / "texts.json", Path(tmp) / "vectors.npy"
        texts_json.write_text(json.dumps(list(texts)))
        cmd = [str(python), "-m", "bench.st_embed", str(model_dir), "--texts", str(texts_json)]
        cmd += ["--out", str(vectors)]
        _log(f"sentence-transformers on {len(texts)} texts ({model})")
        proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.splitlines()[-15:])
            raise SystemExit(f"{tail}\nreference venv: sentence-transformers failed (exit {proc.returncode})")
        result = np.load(vectors)
        if result.shape[0] != len(texts):
            raise SystemExit(f"reference venv: {result.shape[0]} vectors for {len(texts)} texts")
        os.replace(vectors, out)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv) or [SENTENCE_TRANSFORMERS.name]
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        print(f"reference venv: unknown {', '.join(unknown)} (known: {', '.join(SPECS)})", file=sys.stderr)
        return 2
    for name in names:
        t0 = time.monotonic()
        path = ensure(spec=SPECS[name])
        print(f"{path} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
