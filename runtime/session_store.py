"""Warm sessions on disk: one file per session, keyed by the bundle, written atomically.

A session file holds a warm sequence's token ids and, where TVM can export it, its KV pages
(TVM's checkpoint: a JSON description plus one array per layer group). Layout:

    MAGIC (8 bytes) | header length (u32, little-endian) | header (JSON, UTF-8)
    | token ids (int32 x n) | each KV group's bytes, in order | sha256 of all before (32 bytes)

The header names the bundle (its header sha256, which commits to every blob), the token count,
when the session was last used, how many leading tokens are exact (as a cold run computes them:
KVPool) and in which granule they count, and the KV checkpoint's metadata (null when only ids are kept).
A file is written to a temporary name, flushed to disk and renamed over the old one, so a crash
leaves the old file or the new one, never half of one. On reading, anything that is not exactly
such a file for this bundle (torn, truncated, edited, another bundle's, another format) is
refused with the reason; the caller logs it and never loads it.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GISESS1\n"
SUFFIX = ".session"
_DIGEST = 32


class SessionFileError(ValueError):
    pass


@dataclass(frozen=True)
class SavedSession:
    key: str  # the file's stem: stable across the turns of one conversation
    tokens: list[int]
    last_used: float  # wall-clock seconds
    exact: int = 0  # leading tokens computed as a cold run computes them (Seq.exact)
    kv_metadata: str | None = None  # TVM's checkpoint JSON; None: ids only (re-prefilled)
    kv_groups: tuple[np.ndarray, ...] = ()  # one array per group, as the metadata describes
    chunk: int = 0  # the granule `exact` counts in (KVPool.granule; another: nothing is exact)


def folder(root: str | Path, bundle_id: str) -> Path:
    """The sessions of one bundle: another bundle's files are never even looked at."""
    return Path(root) / bundle_id[:16]


def save(root: str | Path, bundle_id: str, s: SavedSession) -> Path:
    d = folder(root, bundle_id)
    d.mkdir(parents=True, exist_ok=True)
    header = json.dumps(
        {
            "bundle": bundle_id,
            "tokens": len(s.tokens),
            "last_used": s.last_used,
            "exact": s.exact if s.kv_metadata is not None else 0,
            "chunk": s.chunk,
            "kv": s.kv_metadata,
            "groups": [[str(g.dtype), list(g.shape)] for g in s.kv_groups],
        }
    ).encode()
    path, tmp = d / f"{s.key}{SUFFIX}", d / f".{s.key}{SUFFIX}.tmp"
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        for part in (
            MAGIC,
            struct.pack("<I", len(header)),
            header,
            np.asarray(s.tokens, np.int32).tobytes(),
            *(np.ascontiguousarray(g).data for g in s.kv_groups),
        ):
            h.update(part)
            f.write(part)
        f.write(h.digest())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load(path: str | Path, bundle_id: str) -> SavedSession:
    """One session file, checked whole; SessionFileError says why it is refused. The file is mapped,
    not read: its KV groups are views of the mapping (the import copies them into the cache), so a
    restore reads each byte once, and hashes it with the GIL released."""
    with open(path, "rb") as f:
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise SessionFileError("not a goinfer session file") from None
    view = memoryview(data)
    if len(view) < len(MAGIC) + 4 + _DIGEST or bytes(view[: len(MAGIC)]) != MAGIC:
        raise SessionFileError("not a goinfer session file")
    body, digest = view[:-_DIGEST], bytes(view[-_DIGEST:])
    if hashlib.sha256(body).digest() != digest:
        raise SessionFileError("checksum mismatch (torn or edited)")
    (n,) = struct.unpack_from("<I", body, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(bytes(body[start : start + n]))
        if header["bundle"] != bundle_id:
            raise SessionFileError("written for another bundle")
        at = start + n
        count = int(header["tokens"])
        last_used, exact = float(header["last_used"]), int(header["exact"])
        chunk = int(header.get("chunk", 0))
        tokens = np.frombuffer(body, np.int32, count, at).tolist()
        at += 4 * count
        groups = []
        for dtype, shape in header["groups"]:
            g = np.frombuffer(body, np.dtype(dtype), int(np.prod(shape)), at).reshape(shape)
            groups.append(g)
            at += g.nbytes
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, SessionFileError):
            raise
        raise SessionFileError(f"malformed header or body ({e})") from None
    if at != len(body):
        raise SessionFileError(f"{len(body) - at} bytes past the described content")
    return SavedSession(Path(path).stem, tokens, last_used, exact, header["kv"], tuple(groups), chunk)


def remove(root: str | Path, bundle_id: str, key: str) -> None:
    (folder(root, bundle_id) / f"{key}{SUFFIX}").unlink(missing_ok=True)


def listing(root: str | Path, bundle_id: str) -> list[Path]:
    d = folder(root, bundle_id)
    return sorted(d.glob(f"*{SUFFIX}")) if d.is_dir() else []
