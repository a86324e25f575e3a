"""The goinfer cache: one root, and one named folder under it for each kind of thing kept there.

    $GOINFER_CACHE (with ~ expanded; unset or empty: ~/.cache/goinfer)
      models/    zoo checkpoints, each beside its verify marker   (compiler.sources.zoo)
      hub/       hf: pulls, each published by one rename          (compiler.sources.hub)
      checksums/ checkpoint sha256s by file identity               (compiler.checksum)
      bundles/   bundles built for a checkpoint and options        (compiler.sources.zoo)
      modules/   compiled modules keyed by graph and target, and the
                 self-test kernels' libraries                      (compiler.compile_cache)
      libs/      module blobs extracted from bundles for TVM       (runtime)
      verified/  markers of bundles hashed once in full            (artifacts.giw)
      llama.cpp/, dl/  the peer built for benchmarks, and its source (bench.llama_cpp)

The compiler and the runtime both resolve it here, so they can never disagree about where it is.
Standard library only, like the rest of artifacts/.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

Folder = Literal["models", "hub", "checksums", "bundles", "modules", "libs", "verified", "llama.cpp", "dl"]


def root() -> Path:
    env = os.environ.get("GOINFER_CACHE", "")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "goinfer"


def folder(name: Folder, cache_root: str | os.PathLike[str] | None = None) -> Path:
    """`<root>/<name>`, not created: writers make it when they first write."""
    return (Path(cache_root).expanduser() if cache_root is not None else root()) / name


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB pieces (checkpoints run to gigabytes)."""
    return sha256_files([path])


def sha256_files(paths: Iterable[str | os.PathLike[str]]) -> str:
    """The hex sha256 of the files' bytes end to end (the shards of a split checkpoint, in order)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()
