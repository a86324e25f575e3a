"""`goinfer build` from every kind of source, and each bad one refused in one line with exit 2 and
nothing written: checkpoint folders and `hf:` pulls (from a local server that speaks the Hub's
protocol, tests/hub_server.py, through HF_ENDPOINT)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from goinfer.artifacts import giw
from goinfer.cli.main import main
from hub_server import HubServer
from tiny_hf import write_tiny_hf_dir


def _run(*args: str | Path):
    return CliRunner().invoke(main, [str(a) for a in args])


def _refused(result, out: Path, *needles: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert line.startswith("goinfer: error: ") and all(n in line for n in needles), line
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "a temp file was left behind"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_hf_dir(tmp_path_factory.mktemp("hf") / "tiny-qwen2", "qwen2", shards=2)


@pytest.fixture
def hub(folder: Path, tiny_gguf, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    repos = {
        "o/tiny-GGUF": {"tiny-F32.gguf": tiny_gguf("qwen2").read_bytes(), "README.md": b"card\n"},
        "o/tiny": {p.name: p.read_bytes() for p in folder.iterdir()},
        "o/gated": {"m-Q4_K_M.gguf": b"GGUF" + bytes(64)},
    }
    server = HubServer(repos, gated={"o/gated"}).start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.stop()


def test_a_checkpoint_folder_builds_to_the_gguf_bundle(folder: Path, tiny_bundle, tmp_path: Path) -> None:
    out = tmp_path / "folder.giw"
    result = _run("build", folder, "--quant", "f32", "--kv-dtype", "f32", "-o", out)
    assert result.exit_code == 0, (result.output, result.exception)
    with giw.open_bundle(out) as built, giw.open_bundle(tiny_bundle("qwen2")) as twin:
        assert built.manifest["model"] == twin.manifest["model"]
        for name in twin.tensor_names():
            if name.startswith("selftest") or name == "tokenizer.json":
                continue
            assert np.array_equal(built.tensor(name), twin.tensor(name)), name


def test_hf_pulls_build_and_record_their_reference(hub: HubServer, tmp_path: Path) -> None:
    for ref in ("hf:o/tiny-GGUF:F32", "hf:o/tiny:safetensors"):
        out = tmp_path / f"{ref.split(':')[-1]}.giw"
        result = _run("build", ref, "--quant", "f32", "--kv-dtype", "f32", "-o", out)
        assert result.exit_code == 0, (result.output, result.exception)
        assert "plan at commit" in result.stderr  # the plan is shown before the pull
        with giw.open_bundle(out) as b:
            assert b.manifest["source"]["ref"] == ref
    # Both pulls are cached now: a second build asks the Hub nothing.
    before = len(hub.requests)
    assert (
        _run(
            "build", "hf:o/tiny-GGUF:F32", "--quant", "f32", "--kv-dtype", "f32", "-o", tmp_path / "again.giw"
        ).exit_code
        == 0
    )
    assert len(hub.requests) == before


@pytest.fixture
def bad_folders(folder: Path, tmp_path: Path) -> dict[str, Path]:
    def copy(name: str) -> Path:
        dst = tmp_path / name
        dst.mkdir()
        for p in folder.iterdir():
            (dst / p.name).write_bytes(p.read_bytes())
        return dst

    no_config = copy("no-config")
    (no_config / "config.json").unlink()
    unknown = copy("unknown-type")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    missing = copy("missing-shard")
    (missing / "model-00002-of-00002.safetensors").unlink()
    truncated = copy("truncated")
    shard = truncated / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    return {"no_config": no_config, "unknown": unknown, "missing": missing, "truncated": truncated}


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("no_config", ["no config.json"]),
        ("unknown", ["unsupported model_type 'mamba'", "qwen2"]),
        ("missing", ["missing shard model-00002-of-00002.safetensors"]),
        ("truncated", ["truncated"]),
    ],
)
def test_bad_checkpoint_folders_are_refused(case, needles, bad_folders, tmp_path: Path) -> None:
    out = tmp_path / "out" / "m.giw"
    out.parent.mkdir()
    _refused(_run("build", bad_folders[case], "-o", out), out, *needles)


def test_bad_hf_references_are_refused_before_any_weight_moves(hub: HubServer, tmp_path: Path) -> None:
    out = tmp_path / "out" / "m.giw"
    out.parent.mkdir()
    _refused(
        _run("build", "hf:o/tiny-GGUF:Q4_K_M", "-o", out), out, "no GGUF for quant Q4_K_M", "the repo has F32"
    )
    _refused(_run("build", "hf:o/gated:Q4_K_M", "-o", out), out, "o/gated is gated")
    assert not hub.weight_gets()


def test_no_network_and_no_cached_copy_is_refused(hub: HubServer, monkeypatch, tmp_path: Path) -> None:
    with socket.socket() as s:  # an address nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    out = tmp_path / "out" / "m.giw"
    out.parent.mkdir()
    _refused(_run("build", "hf:o/tiny-GGUF:F32", "-o", out), out, "cannot reach the Hub", "no complete copy")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _refused(_run("build", "hf:o/tiny-GGUF:F32", "-o", out), out, "no complete copy is cached")
