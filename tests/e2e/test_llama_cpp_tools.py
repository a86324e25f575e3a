"""bench.llama_cpp's cache layout: lookup, adoption and the run environment (nothing is compiled here)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# `bench` is not installed: import it from the repo, wherever pytest was started.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import llama_cpp


def _fake_build(d: Path) -> Path:
    d.mkdir(parents=True)
    for name in llama_cpp.TARGETS:
        (d / name).write_text("#!/bin/sh\n")
        (d / name).chmod(0o755)
    (d / "libggml.so.0.1").write_bytes(b"\x7fELF")
    os.symlink("libggml.so.0.1", d / "libggml.so.0")
    (d / "unrelated.txt").write_text("x")
    return d


def test_adopt_then_find(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / "cache"))
    assert llama_cpp.find_llama_binary("llama-server") is None
    bin_dir = llama_cpp.adopt(_fake_build(tmp_path / "build" / "bin"))
    assert bin_dir == tmp_path / "cache" / "llama.cpp" / llama_cpp.VERSION / "bin"
    assert llama_cpp.find_llama_binary("llama-server") == bin_dir / "llama-server"
    assert (bin_dir / "libggml.so.0").is_symlink()  # library links stay links
    assert not (bin_dir / "unrelated.txt").exists()
    assert (bin_dir.parent / "build-info.json").is_file()
    # An adopted build counts as built: no compile.
    assert llama_cpp.build() == bin_dir


def test_adopt_refuses_an_incomplete_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / "cache"))
    src = _fake_build(tmp_path / "bin")
    (src / "llama-bench").unlink()
    with pytest.raises(SystemExit, match="lacks some of"):
        llama_cpp.adopt(src)
    assert llama_cpp.find_llama_binary("llama-server") is None


def test_llama_env_puts_the_binary_folder_first(tmp_path: Path) -> None:
    env = llama_cpp.llama_env(tmp_path / "bin" / "llama-server", {"LD_LIBRARY_PATH": "/x"})
    assert env["LD_LIBRARY_PATH"] == f"{tmp_path / 'bin'}{os.pathsep}/x"
    assert llama_cpp.llama_env(tmp_path / "llama-server", {})["LD_LIBRARY_PATH"] == str(tmp_path)


def test_cmake_flags_keep_amx_off() -> None:
    flags = " ".join(llama_cpp.CMAKE_FLAGS)
    assert "-DGGML_NATIVE=ON" in flags and "-DGGML_AMX_INT8=OFF" in flags
    if os.uname().machine == "x86_64":
        assert "-mno-amx-int8" in flags  # -march=native would turn AMX back on (see CMAKE_FLAGS)
