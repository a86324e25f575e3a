"""`goinfer zoo`: build a model x target x quant matrix into a content-addressed store, for CI.

A cell's key is its bundle's one identity (resolve.py's `bundle_key`, which names the bundle
cache's files too): the checkpoint's sha256, the quant, target and KV dtype, the compiler's
fingerprint and the TVM version. Builds are byte-reproducible, so a key names one bundle's bytes
wherever it is built: a cell already in the store (and whose file verifies) is skipped, and a CI
cache keyed on it restores it instead of rebuilding.

`plan` prints the cells for a CI job matrix, each cell builds on its own runner into its own
store, and `merge` joins those stores into one (artifacts/zoo_store.py is the store's format).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from goinfer.artifacts import zoo_store
from goinfer.artifacts.manifest import DEFAULT_KV_DTYPE

from .build import BuildOptions, build
from .resolve import bundle_key, source_sha256
from .sources import zoo

Progress = Callable[[str], None]
# The decoder models of the zoo: the matrix's quants are theirs (all-minilm-l6-v2, an encoder,
# builds in f32 or q8_0 only: `goinfer build all-minilm-l6-v2 --quant q8_0`).
DEFAULT_MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m", "smollm2-135m")


@dataclass(frozen=True)
class Cell:
    model: str  # a zoo name, a checkpoint path or an hf: reference
    quant: str
    target: str  # "llvm", "cuda", or several joined by "+" ("llvm+cuda": one bundle for both)
    kv_dtype: str = DEFAULT_KV_DTYPE

    @property
    def build_target(self) -> str:
        return self.target.replace("+", ",")

    @property
    def options(self) -> BuildOptions:
        return BuildOptions(target=self.build_target, quant=self.quant, kv_dtype=self.kv_dtype)

    @property
    def name(self) -> str:
        return zoo_store.entry_name(_model_name(self.model), self.quant, self.build_target)


def plan(models: Sequence[str], targets: Sequence[str], quants: Sequence[str], kv_dtype: str) -> list[Cell]:
    """Every (model, target, quant) cell, in the order given; an option checked before any build."""
    from .build import _check_options

    cells = [Cell(m, q, t, kv_dtype) for m in models for t in targets for q in quants]
    for cell in cells:
        _check_options(BuildOptions(target=cell.build_target, quant=cell.quant, kv_dtype=kv_dtype))
    return cells


def github_matrix(cells: Sequence[Cell]) -> str:
    """The cells as GitHub Actions' `strategy.matrix` (`fromJSON` of it): one job per cell. Keys
    are left to each job, which computes its own on its runner's CPU (`zoo plan --format key`)."""
    include = [{"model": c.model, "quant": c.quant, "target": c.target, "name": c.name} for c in cells]
    return json.dumps({"include": include}, separators=(",", ":"))


def planned_key(cell: Cell) -> str:
    """The key before building: a zoo model's from its pinned sha256 (nothing fetched), any other
    checkpoint's from its bytes (an hf: reference is pulled first)."""
    model = zoo.ZOO.get(cell.model)
    if model is not None and model.kind == "gguf":
        return bundle_key(model.sha256, cell.options)
    return bundle_key(source_sha256(zoo.resolve(cell.model)), cell.options)


def build_store(cells: Sequence[Cell], store: Path, progress: Progress) -> tuple[list[str], list[str]]:
    """Build every cell not already in ``store`` (by key, its file verified); the index is written
    after each cell, so an interrupted run keeps what it finished. Returns (built, reused) names."""
    store.mkdir(parents=True, exist_ok=True)
    entries = {e.name: e for e in zoo_store.read_index(store)}
    built, reused = [], []
    for i, cell in enumerate(cells, 1):
        progress(f"zoo [{i}/{len(cells)}] {cell.name}")
        source = zoo.resolve(cell.model, progress=progress)
        source_sha = source_sha256(source)
        cell_key = bundle_key(source_sha, cell.options)
        have = entries.get(cell.name)
        if have is not None and have.key == cell_key and zoo_store.verified(store, have):
            progress(f"      already built: {have.path} ({have.size / 2**20:.1f} MiB, key {cell_key})")
            reused.append(cell.name)
            continue
        rel = zoo_store.bundle_relpath(cell_key)
        (store / rel).parent.mkdir(parents=True, exist_ok=True)
        origin = cell.model if cell.model.startswith("hf:") else source  # recorded as given
        result = build(origin, store / rel, cell.options, progress)
        entries[cell.name] = zoo_store.Entry(
            name=cell.name,
            model=_model_name(cell.model),
            quant=cell.quant,
            target=cell.build_target,
            kv_dtype=cell.kv_dtype,
            key=cell_key,
            path=rel,
            sha256=result.sha256,
            size=result.size,
            source=cell.model,
            source_sha256=source_sha,
        )
        zoo_store.write_index(store, entries.values())
        built.append(cell.name)
    zoo_store.write_index(store, entries.values())
    return built, reused


def merge(stores: Sequence[Path], out: Path, progress: Progress) -> list[zoo_store.Entry]:
    """Join the cells' stores into ``out``: each bundle moved (or copied) in and verified. Two
    stores holding one name must agree on its key and bytes."""
    merged = {e.name: e for e in zoo_store.read_index(out)}
    for store in stores:
        folder = zoo_store.index_path(store).parent
        entries = zoo_store.read_index(store)
        if not entries:
            raise zoo_store.StoreError(f"{folder}: no zoo index to merge")
        for e in entries:
            same = merged.get(e.name)
            if same is not None and (same.key, same.sha256) != (e.key, e.sha256):
                raise zoo_store.StoreError(
                    f"{e.name}: {folder} has key {e.key} sha256 {e.sha256[:12]}, "
                    f"the merge has key {same.key} sha256 {same.sha256[:12]}"
                )
            if not zoo_store.verified(folder, e):
                raise zoo_store.StoreError(f"{folder}/{e.path}: missing, or not the bytes its index records")
            _bring(folder / e.path, out / e.path, e)
            merged[e.name] = e
        progress(f"merged {len(entries)} bundles from {folder}")
    zoo_store.write_index(out, merged.values())
    return [merged[n] for n in sorted(merged)]


def _bring(src: Path, dst: Path, entry: zoo_store.Entry) -> None:
    if dst.exists() and zoo_store.verified(dst.parent.parent, entry):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.part")
    try:
        os.link(src, tmp)  # same filesystem: no copy
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _model_name(ref: str) -> str:
    """A cell's model as a name: a zoo name as is, a path by its stem (shard number dropped), an
    hf: reference by its repo and selector."""
    from .sources.gguf_file import model_stem

    if ref in zoo.ZOO:
        return ref
    if ref.startswith("hf:"):
        return ref[3:].replace("/", "--").replace(":", ".")
    return model_stem(ref) if Path(ref).suffix == ".gguf" else Path(ref).name


def describe(built: Sequence[str], reused: Sequence[str], store: Path, seconds: float) -> str:
    if not built:
        return f"nothing to build: all {len(reused)} bundles are in {store} and verify ({seconds:.1f}s)"
    index = store / zoo_store.INDEX
    return f"built {len(built)}, {len(reused)} already there; index {index} ({seconds:.1f}s)"
