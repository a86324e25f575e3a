"""Model references -> bundle paths: what `goinfer generate`, `serve` and the admin loader run.

A reference is
- a `.giw`: as given (its own quant and KV dtype);
- `zoo:DIR/NAME`: that entry of a pre-built store (artifacts/zoo_store.py), never built;
- a checkpoint (a .gguf, any shard of a split one, a checkpoint folder, hf:OWNER/REPO:QUANT or a
  zoo name): built once into `<cache>/bundles/`, then reused.

A bundle has one identity, `bundle_key`: what it is built from (the checkpoint's bytes, the build
options, the target as compiled for this host, the compiler's source, TVM). The bundle cache and
the zoo stores (zoo_build.py) both name bundles by it, so a key is the same bundle wherever it is.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

from goinfer.artifacts import cache, zoo_store

from . import build as builder  # its `build` looked up at call time: tests replace it
from .build import BuildOptions
from .fingerprint import code_fingerprint
from .sources import zoo

__all__ = ["bundle_key", "cached_bundle", "model_specs", "resolve", "source_sha256", "zoo_ref"]


Progress = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve(ref: str, options: BuildOptions | None = None, progress: Progress = _stderr) -> Path:
    """The bundle `ref` names; a checkpoint is built with `options` (quant, target, KV dtype) the
    first time, then found in the cache by its key. The pull's and the build's lines go to
    `progress` (the web page's Models tab streams them)."""
    if ref.startswith("zoo:"):
        return zoo_store.find(*zoo_ref(ref))[0]
    path = Path(ref)
    if path.suffix == ".giw":
        if not path.is_file():
            raise FileNotFoundError(f"no such bundle: {ref}")
        return path
    options = options or BuildOptions()
    source = path if path.is_file() else zoo.resolve(ref, progress=progress)
    bundle = cached_bundle(source, options)
    if not bundle.is_file():
        progress(f"goinfer: first use of {ref}: building {bundle.name}")
        bundle.parent.mkdir(parents=True, exist_ok=True)
        # an hf: reference is built as itself (now cached): the bundle records it as its source
        builder.build(ref if ref.startswith("hf:") else source, bundle, options, progress=progress)
    return bundle


def cached_bundle(source: Path, options: BuildOptions, cache_dir: Path | None = None) -> Path:
    """Where the bundle of checkpoint `source` built with `options` is cached: its key, after the
    model's name, quant and target for whoever lists the folder."""
    key = bundle_key(source_sha256(source), options)
    name = f"{_stem(source)}.{options.quant}.{options.target}.{key}.giw"
    return cache.folder("bundles", cache_dir) / name


def bundle_key(source_sha256: str, options: BuildOptions) -> str:
    """The hash of a bundle's inputs: equal keys, equal bundle bytes (builds are reproducible).
    The target is resolved for this host (a CPU target's ISA tiers, mcpu and cores), since that is
    what the code is compiled for."""
    from . import compile_cache  # TVM: only once a checkpoint, not a bundle, is named
    from .tvm.targets import TVM_VERSION

    targets = [compile_cache.tiers_for(k, options.num_cores, options.cuda_arch) for k in options.targets]
    inputs = {
        "source_sha256": source_sha256,
        "quant": options.quant,
        "target": targets,
        "kv_dtype": options.kv_dtype,
        "compiler": code_fingerprint(),
        "tvm": TVM_VERSION,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def source_sha256(path: Path) -> str:
    """A checkpoint's digest: a zoo file's pinned sha256 (the zoo verified it), a GGUF's shards'
    bytes, a folder's over the files its loader reads; remembered by file identity
    (checksum.py), so only the first sight of a checkpoint hashes it."""
    path = Path(path).resolve()
    pinned = next((m.sha256 for m in zoo.ZOO.values() if m.kind == "gguf" and m.filename == path.name), None)
    if pinned is not None:
        return pinned
    if path.is_file():  # no need to parse it (the build will)
        from .checksum import sha256_files
        from .sources.gguf_file import shard_paths

        return sha256_files(shard_paths(path))
    from .sources import load_checkpoint

    return load_checkpoint(path).sha256


# -- naming the models `serve --model` gives ---------------------------------------------------


def model_specs(specs: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """`NAME=REF` or `REF` -> (name, ref). A bare REF is named by its zoo name, its file stem (a
    split GGUF's without the shard number) or its store entry; `zoo:DIR` (a store, no NAME) serves
    every bundle in it, each under its entry's name."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, ref = spec.partition("=")
        if not sep or "/" in name or ":" in name or not name:
            name, ref = "", spec
        for each_name, each_ref in _expand(ref) if not name else [(name, ref)]:
            if each_name in out:
                raise ValueError(f"--model {spec}: the name {each_name!r} is given twice; name them NAME=REF")
            out[each_name] = each_ref
    return list(out.items())


def _expand(ref: str) -> list[tuple[str, str]]:
    """The (name, ref) pairs a bare --model REF serves."""
    if ref.startswith("zoo:"):
        folder, name = zoo_ref(ref)
        if name:
            return [(name, ref)]
        entries = zoo_store.read_index(folder)
        if not entries:
            raise ValueError(f"--model {ref}: no zoo index in {folder}")
        return [(e.name, f"zoo:{folder}/{e.name}") for e in entries]
    if ref.startswith("hf:"):  # pulled here to be named: the GGUF's name, or the repo's
        path = zoo.resolve(ref)
        return [(path.name if path.is_dir() else _stem(path), ref)]
    path = Path(ref)
    if path.is_dir():
        return [(path.name, ref)]
    if path.suffix == ".giw":
        return [(path.stem, ref)]
    return [(_stem(path) if path.suffix == ".gguf" else ref, ref)]


def _stem(path: Path) -> str:
    """A checkpoint's name, a split GGUF's without its shard number."""
    from .sources.gguf_file import model_stem  # the gguf package: only where a name needs it

    return model_stem(path)


def zoo_ref(ref: str) -> tuple[Path, str]:
    """`zoo:DIR/NAME` -> (DIR, NAME); `zoo:DIR` or `zoo:DIR/index.json` -> (DIR, "")."""
    path = Path(ref.removeprefix("zoo:")).expanduser()
    if path.name == zoo_store.INDEX or (path / zoo_store.INDEX).is_file():
        return zoo_store.index_path(path).parent, ""
    return path.parent, path.name
