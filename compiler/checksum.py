"""Checkpoint checksums remembered by file identity, so a rebuild does not rehash the checkpoint.

A manifest records its checkpoint's sha256 (`source.sha256`): half a second of hashing for the
0.5B Qwen, two for a 1.5B, on every build. The digest is kept under `<cache>/checksums/`, named
for the files' identity: path, size, mtime, ctime, device and inode, each of which a rewrite
changes (ctime cannot be set back), as the zoo's verify markers and the bundles' `verified/`
markers are keyed. A stale or unreadable entry only costs the hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from goinfer.artifacts import cache


def _identity(path: str | os.PathLike[str]) -> list[object]:
    st = os.stat(path)
    return [str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]


def sha256_files(paths: Iterable[str | os.PathLike[str]]) -> str:
    """The hex sha256 of the files' bytes end to end (cache.sha256_files), hashed only the first
    time these exact files are seen."""
    paths = list(paths)
    key = hashlib.sha256(json.dumps([_identity(p) for p in paths]).encode()).hexdigest()
    entry = cache.folder("checksums") / key
    with contextlib.suppress(OSError, UnicodeDecodeError):
        known = entry.read_text().strip()
        if len(known) == 64 and not known.strip("0123456789abcdef"):
            return known
    digest = cache.sha256_files(paths)
    with contextlib.suppress(OSError):  # an unwritable cache only costs the hash next time
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".sum.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(digest + "\n")
            os.replace(tmp, entry)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return digest
