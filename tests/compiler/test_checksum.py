"""compiler/checksum.py: a checkpoint's sha256 is computed once per file identity; any rewrite of
the file, even one that keeps its size and mtime, is hashed again."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from goinfer.artifacts import cache
from goinfer.compiler import checksum


def test_a_file_is_hashed_once_until_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / "cache"))
    calls = []
    real = cache.sha256_files
    monkeypatch.setattr(cache, "sha256_files", lambda paths: calls.append(1) or real(paths))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"first" * 1000)
    b.write_bytes(b"second")
    want = hashlib.sha256(a.read_bytes() + b.read_bytes()).hexdigest()
    assert checksum.sha256_files([a, b]) == want and len(calls) == 1
    assert checksum.sha256_files([a, b]) == want and len(calls) == 1  # remembered
    assert checksum.sha256_files([a]) == hashlib.sha256(a.read_bytes()).hexdigest() and len(calls) == 2

    st = a.stat()
    a.write_bytes(b"FIRST" * 1000)  # same size; mtime set back: the ctime still moves
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert checksum.sha256_files([a]) == hashlib.sha256(a.read_bytes()).hexdigest() and len(calls) == 3


def test_a_damaged_entry_only_costs_the_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cache"
    monkeypatch.setenv("GOINFER_CACHE", str(root))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 100)
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert checksum.sha256_files([f]) == want
    (entry,) = (root / "checksums").iterdir()
    entry.write_text("not a digest\n")
    assert checksum.sha256_files([f]) == want  # hashed again, and the entry mended
    assert entry.read_text().strip() == want
