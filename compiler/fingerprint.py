"""A hash of the compiler's own source: what a built module or bundle depends on beyond its inputs.

Keying caches on it means editing a kernel or a family file can never reuse a stale build.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_COMPILER_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    h = hashlib.sha256()
    for path in sorted(_COMPILER_DIR.rglob("*")):
        if path.suffix in (".py", ".jinja") and "__pycache__" not in path.parts:
            h.update(path.relative_to(_COMPILER_DIR).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()
