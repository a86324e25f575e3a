"""``hf:<owner>/<repo>:<QUANT>`` and ``hf:<owner>/<repo>:safetensors``: pulls from the Hugging Face Hub.

A pull is planned before any weight byte moves: one ``model_info`` call (file sizes, LFS sha256s,
``gated``) picks the files, and for a safetensors checkpoint the small ``config.json`` (and the
shard index) are fetched first so an unsupported ``model_type`` or a missing shard is refused
having read only those. The files are then assembled in ``<cache>/hub/<owner>--<repo>/.partial-<sel>/``
and published as ``<sel>/`` by one ``os.replace`` once every file has checked out (size and sha256,
or the git blob id of a small non-LFS file), with a ``.goinfer-pull.json`` marker inside.

* Resume: huggingface_hub 2.x's ``hf_hub_download`` writes each download to a process-unique
  temporary file and deletes it on failure, so it cannot resume across runs. We therefore keep our
  own ``<file>.incomplete`` in the staging folder and hand it to huggingface_hub's ``http_get`` with
  ``resume_size``: a re-run asks for the rest with a ``Range`` request (and ``http_get`` itself
  retries a dropped connection the same way within one run).
* Offline: a published folder whose marker verifies (a ``stat`` per file) is returned without any
  network call, whether or not the Hub is reachable. A pull is pinned to the commit it resolved;
  to take a newer revision, delete the folder (we chose not to ask the Hub on every run).
* Anonymous only (``token=False``): a gated or private repo is refused before any file is read.
* ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are read at call time (huggingface_hub reads them once,
  at import), so a mirror or a test server can be named after import.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from goinfer.artifacts import cache
from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers

from .base import SourceError
from .hf_config import family_of


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's "no network" errors: huggingface_hub 2.x speaks httpx2, 1.x httpx, 0.x requests."""
    for name in ("httpx2", "httpx"):
        try:
            return (__import__(name).TransportError,)
        except (ImportError, AttributeError):
            continue
    import requests  # pragma: no cover - huggingface_hub < 1.0

    return (requests.ConnectionError, requests.Timeout)  # pragma: no cover


_TRANSPORT_ERRORS = _transport_errors()

Progress = Callable[[str], None]

DEFAULT_ENDPOINT = "https://huggingface.co"
MARKER = ".goinfer-pull.json"
STAGING_STATE = ".goinfer-staging.json"
PARTIAL = ".incomplete"
SAFETENSORS = "safetensors"
# Besides config.json and the weights, the files a checkpoint directory is loaded with, if the repo has them.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "preprocessor_config.json",
    # sentence-transformers' (an encoder's pooling and task prompts; hf_encoder.py)
    "modules.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
)
_POOLING_CONFIG = re.compile(r"\d+_Pooling/config\.json")  # the Pooling module's, named in modules.json
Q4_BITS = 4.5  # bits per weight of "a GGUF q4" (q4_0 / q4_K_S-like), for the full-precision estimate
DTYPE_BYTES = {"float32": 4, "F32": 4, "float16": 2, "F16": 2, "bfloat16": 2, "BF16": 2}
FULL_PRECISION_QUANTS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REF = re.compile(
    rf"hf:(?P<repo>{_NAME}/{_NAME})(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]*))?:(?P<sel>[A-Za-z0-9][A-Za-z0-9._-]*)"
)
_SHARD = re.compile(r"^(?P<base>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$", re.IGNORECASE)
# A quant token in a GGUF file name: Q4_K_M, IQ2_XXS, TQ1_0, Q8_0, UD-Q4_K_XL, F16, BF16, MXFP4, ...
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:[IT]?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32|FP16|MXFP4(?:_MOE)?))(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_EXPECTED = (
    "expected hf:<owner>/<repo>:<QUANT> (e.g. hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M), "
    "hf:<owner>/<repo>:safetensors, or either with @<revision> after the repo"
)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- refs


@dataclass(frozen=True)
class HubRef:
    repo_id: str  # "owner/repo"
    selector: str  # "safetensors", or a quant in upper case ("Q4_K_M")
    revision: str = "main"

    @property
    def is_safetensors(self) -> bool:
        return self.selector == SAFETENSORS

    def __str__(self) -> str:
        rev = "" if self.revision == "main" else f"@{self.revision}"
        return f"hf:{self.repo_id}{rev}:{self.selector}"

    @property
    def folder(self) -> str:
        """The repo's folder under ``<cache>/hub/``."""
        return self.repo_id.replace("/", "--")

    @property
    def dirname(self) -> str:
        """The published folder inside the repo's: the selector, and the revision when not main."""
        return (
            self.selector
            if self.revision == "main"
            else f"{self.selector}@{self.revision.replace('/', '--')}"
        )


def parse(ref: str) -> HubRef:
    """``hf:owner/repo[@rev]:QUANT`` or ``hf:owner/repo[@rev]:safetensors`` -> HubRef."""
    m = _REF.fullmatch(ref.strip())
    if m is None:
        raise SourceError(f"{ref!r} is not a Hub reference; {_EXPECTED}")
    sel = m["sel"]
    sel = SAFETENSORS if sel.lower() == SAFETENSORS else sel.upper()
    return HubRef(repo_id=m["repo"], selector=sel, revision=m["rev"] or "main")


# ---------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class PlanFile:
    name: str  # path in the repo (and in the published folder)
    size: int
    sha256: str | None  # the LFS sha256 where the Hub gives one
    blob_id: str | None  # the git blob id (sha1) of a non-LFS file
    weight: bool  # a .gguf / .safetensors file: the bytes a plan is decided before moving


@dataclass(frozen=True)
class Plan:
    ref: HubRef
    commit: str  # the commit `ref.revision` resolved to: every file is fetched at it
    kind: Literal["gguf", "safetensors"]
    files: tuple[PlanFile, ...]
    target: str  # what pull returns, relative to the folder: the (first) .gguf, or "" for the folder
    family: str | None  # safetensors: our family for config.json's model_type
    prefetched: tuple[tuple[str, bytes], ...] = ()  # small files read while planning, not fetched twice
    notes: tuple[str, ...] = ()  # e.g. the full-precision flag

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def weight_bytes(self) -> int:
        return sum(f.size for f in self.files if f.weight)


@dataclass(frozen=True)
class _Sibling:
    name: str
    size: int | None
    sha256: str | None
    blob_id: str | None


@dataclass(frozen=True)
class _RepoInfo:
    commit: str
    siblings: Mapping[str, _Sibling]
    params: int | None  # parameter count, where the Hub reports safetensors metadata


def plan(ref: str | HubRef, *, progress: Progress | None = _stderr) -> Plan:
    """What ``pull`` would fetch, decided with ``model_info`` and (safetensors) config.json and the
    shard index only. Refuses gated/private repos, unknown quants, missing shards and unsupported
    model types here, before any weight byte moves. The plan is printed through ``progress``."""
    hub_ref = parse(ref) if isinstance(ref, str) else ref
    if _offline():
        raise SourceError(f"{hub_ref}: cannot plan a pull: HF_HUB_OFFLINE is set")
    with _hub_errors(hub_ref, "planning"):
        info = _repo_info(hub_ref)
        result = _plan_safetensors(hub_ref, info) if hub_ref.is_safetensors else _plan_gguf(hub_ref, info)
    if progress:
        _print_plan(result, progress)
    return result


def _repo_info(ref: HubRef) -> _RepoInfo:
    api = HfApi(endpoint=_endpoint())
    info = api.model_info(
        ref.repo_id,
        revision=ref.revision,
        files_metadata=True,
        token=False,
        timeout=constants.HF_HUB_ETAG_TIMEOUT,
    )
    if info.gated or info.private:
        raise SourceError(_gated_message(ref, "private" if info.private and not info.gated else "gated"))
    if not info.sha:
        raise SourceError(f"{ref}: the Hub did not say which commit {ref.revision} is")
    siblings = {}
    for s in info.siblings or ():
        lfs = s.lfs
        size = lfs.size if lfs else s.size
        siblings[s.rfilename] = _Sibling(s.rfilename, size, lfs.sha256 if lfs else None, s.blob_id)
    params = info.safetensors.total if info.safetensors else None
    return _RepoInfo(commit=info.sha, siblings=siblings, params=params)


def _gated_message(ref: HubRef, what: str) -> str:
    return (
        f"{ref.repo_id} is {what}: goinfer pulls anonymously only; accept its terms on the Hub, download it "
        "yourself and pass the file or folder to --model"
    )


def _plan_file(ref: HubRef, sib: _Sibling) -> PlanFile:
    if sib.size is None:
        raise SourceError(f"{ref}: the Hub gave no size for {sib.name}")
    weight = sib.name.lower().endswith((".gguf", ".safetensors"))
    return PlanFile(sib.name, sib.size, sib.sha256, None if sib.sha256 else sib.blob_id, weight)


# GGUF ------------------------------------------------------------------------------------------------


def _gguf_names(info: _RepoInfo) -> list[str]:
    """The repo's model GGUFs (vision projectors, mmproj-*.gguf, are not a quant of the model)."""
    names = [n for n in info.siblings if n.lower().endswith(".gguf")]
    return sorted(n for n in names if not n.rsplit("/", 1)[-1].lower().startswith("mmproj"))


def quants_in(names: Sequence[str]) -> list[str]:
    """The quants named by GGUF file names (the last quant-like token of each), sorted, unique."""
    found = set()
    for name in names:
        tokens = _QUANT.findall(name.rsplit("/", 1)[-1])
        if tokens:
            found.add(tokens[-1].upper())
    return sorted(found)


def _has_quant(name: str, quant: str) -> bool:
    # Bounded on both sides: Q4_K must not match Q4_K_M, nor Q4_0 match IQ4_0 or Q4_0_4_4.
    pattern = rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])"
    return re.search(pattern, name, re.IGNORECASE) is not None


def _group_key(name: str) -> str:
    m = _SHARD.match(name)
    return m["base"] if m else name


def _plan_gguf(ref: HubRef, info: _RepoInfo) -> Plan:
    names = _gguf_names(info)
    if not names:
        hint = f"; try hf:{ref.repo_id}:safetensors" if "config.json" in info.siblings else ""
        raise SourceError(f"{ref}: {ref.repo_id} has no GGUF files{hint}")
    groups: dict[str, list[str]] = {}
    for name in names:
        if _has_quant(name, ref.selector):
            groups.setdefault(_group_key(name), []).append(name)
    if not groups:
        have = ", ".join(quants_in(names)) or "none recognisable"
        raise SourceError(f"{ref}: no GGUF for quant {ref.selector}; the repo has {have}")
    if len(groups) > 1:
        listed = ", ".join(sorted(groups))
        raise SourceError(f"{ref}: quant {ref.selector} matches several GGUFs ({listed}); cannot choose")
    ((key, members),) = groups.items()
    ordered = _complete_shards(ref, key, members) if _SHARD.match(members[0]) else members
    files = tuple(_plan_file(ref, info.siblings[n]) for n in ordered)
    notes = _gguf_notes(ref, files)
    return Plan(ref, info.commit, "gguf", files, target=ordered[0], family=None, notes=notes)


def _complete_shards(ref: HubRef, base: str, members: list[str]) -> list[str]:
    """Every shard of a split GGUF in order, or a SourceError naming the first one the repo lacks."""
    counts = {int(m["n"]) for m in map(_SHARD.match, members) if m}
    if len(counts) != 1:
        raise SourceError(f"{ref}: the shards of {base} disagree on their count ({sorted(counts)})")
    (n,) = counts
    by_index = {int(m["i"]): name for name in members if (m := _SHARD.match(name))}
    for i in range(1, n + 1):
        if i not in by_index:
            raise SourceError(
                f"{ref}: missing shard {base}-{i:05d}-of-{n:05d}.gguf (the repo lists {len(by_index)} of {n})"
            )
    return [by_index[i] for i in range(1, n + 1)]


def _gguf_notes(ref: HubRef, files: Sequence[PlanFile]) -> tuple[str, ...]:
    dtype = FULL_PRECISION_QUANTS.get(ref.selector)
    if dtype is None:
        return ()
    total = sum(f.size for f in files)
    return (_full_precision_note(ref, total, DTYPE_BYTES[dtype], dtype, params=None),)


# safetensors -----------------------------------------------------------------------------------------


def _plan_safetensors(ref: HubRef, info: _RepoInfo) -> Plan:
    sibs = info.siblings
    if "config.json" not in sibs:
        raise SourceError(f"{ref}: {ref.repo_id} has no config.json, so it is not a checkpoint folder")
    config_bytes = _fetch_small(ref, info.commit, _plan_file(ref, sibs["config.json"]))
    config = _json(ref, "config.json", config_bytes)
    try:
        family = family_of(config)
    except SourceError as e:
        raise SourceError(f"{ref}: {e}") from None
    if "tokenizer.json" not in sibs:  # what the checkpoint-folder loader reads the tokenizer from
        raise SourceError(
            f"{ref}: {ref.repo_id} has no tokenizer.json (only fast-tokenizer checkpoints are supported)"
        )
    prefetched = [("config.json", config_bytes)]
    if "model.safetensors" in sibs:
        weights = ["model.safetensors"]
    elif "model.safetensors.index.json" in sibs:
        index_bytes = _fetch_small(ref, info.commit, _plan_file(ref, sibs["model.safetensors.index.json"]))
        prefetched.append(("model.safetensors.index.json", index_bytes))
        weights = _index_shards(ref, _json(ref, "model.safetensors.index.json", index_bytes), sibs)
    else:
        raise SourceError(
            f"{ref}: {ref.repo_id} has neither model.safetensors nor model.safetensors.index.json"
        )
    names = ["config.json", *(n for n in SIDE_FILES if n in sibs)]
    names += sorted(n for n in sibs if _POOLING_CONFIG.fullmatch(n))
    names += [n for n in ("model.safetensors.index.json",) if n in sibs and n not in weights]
    files = tuple(_plan_file(ref, sibs[n]) for n in [*names, *weights])
    note = _safetensors_note(ref, config, files, info.params)
    notes = (note,) if note else ()
    return Plan(ref, info.commit, "safetensors", files, "", family, tuple(prefetched), notes)


def _index_shards(ref: HubRef, index: Mapping[str, Any], sibs: Mapping[str, _Sibling]) -> list[str]:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise SourceError(f"{ref}: model.safetensors.index.json has no weight_map")
    shards = sorted(set(map(str, weight_map.values())))
    missing = [s for s in shards if s not in sibs]
    if missing:
        raise SourceError(
            f"{ref}: missing shard {missing[0]}: model.safetensors.index.json names it but the repo lacks it"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return shards


def _json(ref: HubRef, name: str, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as e:
        raise SourceError(f"{ref}: {name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise SourceError(f"{ref}: {name} is not a JSON object")
    return value


def _safetensors_note(
    ref: HubRef, config: Mapping[str, Any], files: Sequence[PlanFile], params: int | None
) -> str | None:
    """The full-precision flag, unless config.json says the weights are already quantized."""
    if config.get("quantization_config"):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    dtype = str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "bfloat16")
    weights = sum(f.size for f in files if f.weight)
    return _full_precision_note(ref, weights, DTYPE_BYTES.get(dtype, 2), dtype, params)


def _full_precision_note(ref: HubRef, total: int, bytes_per: int, dtype: str, params: int | None) -> str:
    params = params or total // bytes_per
    q4 = params * Q4_BITS / 8
    return (
        f"{ref}: a full-precision original ({dtype}): the weights total {total / 1e9:.2f} GB, about "
        f"{total / q4:.0f}x a GGUF q4 of the same model (~{q4 / 1e9:.2f} GB)"
    )


def _print_plan(p: Plan, progress: Progress) -> None:
    what = f"{len(p.files)} files" if len(p.files) > 1 else "1 file"
    progress(f"{p.ref}: plan at commit {p.commit[:12]}: {what}, {p.total_bytes / 1e6:.1f} MB")
    for f in p.files:
        progress(f"  {f.name}  {f.size / 1e6:.1f} MB")
    for note in p.notes:
        progress(note)


# ---------------------------------------------------------------------------------------------- pull


def pull(
    ref: str | HubRef, cache_dir: str | os.PathLike[str] | None = None, progress: Progress | None = _stderr
) -> Path:
    """The local copy of a Hub reference: the .gguf file (the first shard of a split one, its other
    shards beside it) or the checkpoint folder. A complete copy in the cache is returned without
    touching the network; otherwise the plan is fetched into a staging folder (resuming whatever an
    earlier run left there), verified, and published by one rename."""
    hub_ref = parse(ref) if isinstance(ref, str) else ref
    repo_dir = cache.folder("hub", cache_dir) / hub_ref.folder
    out = repo_dir / hub_ref.dirname
    hit = _published(hub_ref, out)
    if hit is not None:
        return hit
    if _offline():
        raise SourceError(
            f"{hub_ref}: cannot reach the Hub (HF_HUB_OFFLINE is set) and no complete copy is cached"
        )
    repo_dir.mkdir(parents=True, exist_ok=True)
    with _lock(repo_dir / f".{hub_ref.dirname}.lock", hub_ref, progress):
        hit = _published(hub_ref, out)  # another process may have finished it while we waited
        if hit is not None:
            return hit
        p = plan(hub_ref, progress=progress)
        t0 = time.monotonic()
        staging = repo_dir / f".partial-{hub_ref.dirname}"
        _assemble(p, staging, progress)
        _publish(p, staging, out)
    if progress:
        progress(f"pulled {hub_ref} -> {out} ({time.monotonic() - t0:.1f} s)")
    return out / p.target if p.target else out


def cached(ref: str | HubRef, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """What ``pull`` would return from the cache alone, or None: no network, no writes."""
    hub_ref = parse(ref) if isinstance(ref, str) else ref
    return _published(hub_ref, cache.folder("hub", cache_dir) / hub_ref.folder / hub_ref.dirname)


def _published(ref: HubRef, out: Path) -> Path | None:
    """The pull's result when ``out`` holds a complete pull of ``ref``: the marker names the repo and
    selector, and every file it lists is there with its size (a stat, not a rehash)."""
    try:
        marker = json.loads((out / MARKER).read_text())
        if marker["repo"] != ref.repo_id or marker["selector"] != ref.selector:
            return None
        for f in marker["files"]:
            if (out / f["name"]).stat().st_size != f["size"]:
                return None
        target = str(marker["target"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return out / target if target else out


def _assemble(p: Plan, staging: Path, progress: Progress | None) -> None:
    """Every file of the plan, verified, in ``staging``; files a previous run of the same commit
    completed are kept, and a partial one is resumed."""
    _prepare_staging(p, staging)
    prefetched = dict(p.prefetched)
    headers = build_hf_headers(token=False)
    for i, f in enumerate(p.files, 1):
        dest = staging / f.name
        if dest.is_file() and dest.stat().st_size == f.size:
            if progress:
                progress(f"  [{i}/{len(p.files)}] {f.name}: already fetched")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + PARTIAL)
        if f.name in prefetched:
            part.write_bytes(prefetched[f.name])
        else:
            with _hub_errors(p.ref, f"fetching {f.name}", resumable=True):
                _download(p, f, part, headers, f"[{i}/{len(p.files)}]", progress)
        _verify(p.ref, f, part)
        os.replace(part, dest)


def _prepare_staging(p: Plan, staging: Path) -> None:
    """Reuse a staging folder only if an earlier run was fetching the same commit; else start afresh."""
    state = {"repo": p.ref.repo_id, "selector": p.ref.selector, "commit": p.commit}
    try:
        if json.loads((staging / STAGING_STATE).read_text()) != state:
            shutil.rmtree(staging)
    except (OSError, ValueError):
        shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True, exist_ok=True)
    (staging / STAGING_STATE).write_text(json.dumps(state) + "\n")


def _download(
    p: Plan, f: PlanFile, part: Path, headers: dict[str, str], tag: str, progress: Progress | None
) -> None:
    have = part.stat().st_size if part.is_file() else 0
    if have > f.size:  # cannot be a prefix of this file
        part.unlink()
        have = 0
    if progress:
        at = f" at {have / 1e6:.1f} /" if have else ""
        progress(f"  {tag} {'resuming' if have else 'fetching'} {f.name}{at} {f.size / 1e6:.1f} MB")
    url = hf_hub_url(p.ref.repo_id, f.name, revision=p.commit, endpoint=_endpoint())
    bar = _progress_bar(f.name, f.size, progress)
    with part.open("ab") as fh:  # append: http_get writes from the current end, asking for Range: bytes=have-
        http_get(
            url,
            fh,
            resume_size=have,
            headers=headers,
            expected_size=f.size,
            displayed_filename=f.name,
            tqdm_class=bar,
        )


def _verify(ref: HubRef, f: PlanFile, part: Path) -> None:
    """Size, then the LFS sha256 or the git blob id; a file that fails is deleted (never resumed)."""
    size = part.stat().st_size
    why = None
    if size != f.size:
        why = f"size {size}, expected {f.size}"
    elif f.sha256 and (got := cache.sha256_file(part)) != f.sha256:
        why = f"sha256 {got}, expected {f.sha256}"
    elif f.blob_id and (got := _git_blob_id(part)) != f.blob_id:
        why = f"git blob id {got}, expected {f.blob_id}"
    if why:
        part.unlink(missing_ok=True)
        raise SourceError(f"{ref}: {f.name} failed verification ({why}); nothing was published")


def _git_blob_id(path: Path) -> str:
    """The git object id of a file (sha1 of "blob <size>\\0" + bytes): the Hub's blobId for non-LFS files."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _publish(p: Plan, staging: Path, out: Path) -> None:
    """Write the marker into ``staging`` and make it ``out`` with one rename."""
    (staging / STAGING_STATE).unlink(missing_ok=True)
    for f in p.files:  # record what the loader will read; sha256 for the non-LFS files too
        if not (staging / f.name).is_file():
            raise SourceError(f"{p.ref}: {f.name} is missing from the staging folder; nothing was published")
    marker = {
        "repo": p.ref.repo_id,
        "revision": p.ref.revision,
        "commit": p.commit,
        "selector": p.ref.selector,
        "kind": p.kind,
        "family": p.family,
        "target": p.target,
        "files": [
            {"name": f.name, "size": f.size, "sha256": f.sha256 or cache.sha256_file(staging / f.name)}
            for f in p.files
        ],
    }
    (staging / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    if out.exists():  # an older or damaged copy that did not verify: out of the way first
        stale = out.with_name(f".stale-{out.name}-{os.getpid()}")
        os.replace(out, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(staging, out)


# ------------------------------------------------------------------------------------------- helpers


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _offline() -> bool:
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return env.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _fetch_small(ref: HubRef, commit: str, f: PlanFile) -> bytes:
    """A small file read into memory (config.json, the shard index) while planning, verified."""
    buf = io.BytesIO()
    url = hf_hub_url(ref.repo_id, f.name, revision=commit, endpoint=_endpoint())
    with _hub_errors(ref, f"fetching {f.name}"):
        http_get(url, buf, headers=build_hf_headers(token=False), expected_size=f.size, tqdm_class=_SilentBar)
    data = buf.getvalue()
    got = hashlib.sha256(data).hexdigest() if f.sha256 else _git_blob_bytes(data)
    want = f.sha256 or f.blob_id
    if want and got != want:
        raise SourceError(f"{ref}: {f.name} failed verification (got {got}, expected {want})")
    return data


def _git_blob_bytes(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class _SilentBar:
    """A stand-in for tqdm that http_get can drive: huggingface_hub's own bars stay off."""

    def __init__(self, **_: Any) -> None:
        pass

    def __enter__(self) -> _SilentBar:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def update(self, n: float | None = 1) -> None:
        pass


def _progress_bar(name: str, size: int, progress: Progress | None, every_s: float = 5.0) -> type[Any]:
    """A tqdm stand-in for http_get that prints "name: done / total MB" through ``progress`` every
    ``every_s`` seconds, and once at the end."""

    class _Bar(_SilentBar):
        def __init__(self, *, initial: int = 0, **_: Any) -> None:
            self.n = initial
            self.last = time.monotonic()

        def update(self, n: float | None = 1) -> None:
            self.n += int(n or 0)
            now = time.monotonic()
            if progress and (now - self.last >= every_s or self.n >= size):
                self.last = now
                progress(f"    {name}: {self.n / 1e6:.1f} / {size / 1e6:.1f} MB")

    return _Bar


@contextlib.contextmanager
def _lock(path: Path, ref: HubRef, progress: Progress | None) -> Iterator[None]:
    """One pull of a given ref at a time (two would write the same partial files)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no lock, as before
        yield
        return
    with path.open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                progress(f"{ref}: waiting for another pull of it to finish ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextlib.contextmanager
def _hub_errors(ref: HubRef, doing: str, resumable: bool = False) -> Iterator[None]:
    """huggingface_hub's and the network's exceptions as one-line SourceErrors."""
    again = "; run again to resume" if resumable else ""
    try:
        yield
    except SourceError:
        raise
    except GatedRepoError:
        raise SourceError(_gated_message(ref, "gated")) from None
    except RepositoryNotFoundError:
        raise SourceError(
            f"{ref}: no repo {ref.repo_id} on the Hub (or it is private: goinfer pulls anonymously only)"
        ) from None
    except RevisionNotFoundError:
        raise SourceError(f"{ref}: {ref.repo_id} has no revision {ref.revision!r}") from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError, *_TRANSPORT_ERRORS) as e:
        if resumable:
            raise SourceError(f"{ref}: lost the Hub while {doing} ({_first_line(e)}){again}") from None
        raise SourceError(
            f"{ref}: cannot reach the Hub ({_first_line(e)}) and no complete copy is cached"
        ) from None
    except EntryNotFoundError as e:
        raise SourceError(f"{ref}: the Hub has no such file while {doing}: {_first_line(e)}") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise SourceError(
            f"{ref}: the Hub answered {status} while {doing}: {_first_line(e)}{again}"
        ) from None
    except OSError as e:  # http_get's consistency check (a short body), a full disk, ...
        raise SourceError(f"{ref}: {doing} failed: {_first_line(e)}{again}") from None
