"""The Models tab's Puller over the real compiler (cli/pulls.py): plan, pull and build from a local
server that speaks the Hub's protocol (tests/hub_server.py), and `goinfer cache` / the "On disk"
card listing what the caches hold, finished or not."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from goinfer.artifacts import cache
from goinfer.cli import cache as cache_list
from goinfer.cli.main import main
from goinfer.cli.pulls import ModelPuller
from goinfer.compiler.build import BuildOptions
from goinfer.compiler.sources import hub as hub_source
from goinfer.compiler.sources import zoo
from goinfer.serve.pulls import BadQuant
from hub_server import HubServer

REF = "hf:o/tiny-GGUF:F32"
# serve's build options but the tests' KV dtype (conftest's tiny_bundle): on a 2-core host its
# compiled module is in the compile cache already
OPTIONS = BuildOptions(kv_dtype="float32")


def shared_compile_cache(root: Path) -> None:
    """A fresh cache root whose compiled modules are the user's (keyed by graph and target, so
    sharing them changes no build): a test pull builds without compiling again."""
    modules = cache.folder("modules")
    modules.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / "modules").symlink_to(modules, target_is_directory=True)


@pytest.fixture
def hub(tiny_gguf, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    shared_compile_cache(tmp_path / "cache")
    monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    gguf = tiny_gguf("qwen2").read_bytes()
    server = HubServer({"o/tiny-GGUF": {"tiny-F32.gguf": gguf, "README.md": b"card\n"}}).start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.stop()


def test_plan_then_pull_and_build_then_the_cache_lists_them(hub: HubServer) -> None:
    puller = ModelPuller(OPTIONS)
    size = len(hub.repos["o/tiny-GGUF"].files["tiny-F32.gguf"])
    plan = puller.plan(REF, None)
    assert plan["files"] == [{"name": "tiny-F32.gguf", "size": size}]
    assert plan["total_bytes"] == size and plan["pulled"] is False and plan["bundle"] is None
    assert hub.file_requests() == []  # planned from the model info alone: no byte of a file moved

    lines: list[tuple[str, str]] = []
    built = puller.pull_build(REF, None, lambda stage, line: lines.append((stage, line)))
    stages = [s for s, _ in lines]
    assert stages == sorted(stages, key=["pull", "build"].index), "the pull's lines, then the build's"
    assert any("plan at commit" in line for s, line in lines if s == "pull")
    assert any(line.startswith("[1/6]") for s, line in lines if s == "build")
    assert built["name"] == "tiny-F32" and built["kind"] == "chat" and Path(built["bundle"]).is_file()

    again = puller.plan(REF, None)
    assert again["pulled"] is True and again["bundle"] == built["bundle"]
    weights = len(hub.weight_gets())
    assert puller.pull_build(REF, None, lambda *_: None) == built
    assert len(hub.weight_gets()) == weights  # pulled and built once

    entries = {(e["kind"], e["name"]): e for e in puller.on_disk()}
    pulled = entries[("hub", REF)]
    assert pulled["complete"] and pulled["ref"] == REF and pulled["size"] >= size
    bundle = entries[("bundle", Path(built["bundle"]).name)]
    assert bundle["complete"] and not bundle["stale"] and bundle["ref"] == built["bundle"]
    assert "qwen2 decoder" in bundle["detail"] and f"from {REF}" in bundle["detail"]


def test_unfinished_pulls_and_builds_are_listed_as_such(hub: HubServer) -> None:
    root = cache.root()
    staging = root / "hub" / "o--tiny-GGUF" / ".partial-Q8_0"
    staging.mkdir(parents=True)
    (staging / hub_source.STAGING_STATE).write_text('{"repo": "o/tiny-GGUF", "selector": "Q8_0"}')
    (staging / ("tiny-Q8_0.gguf" + hub_source.PARTIAL)).write_bytes(b"x" * 100)
    broken = root / "hub" / "o--tiny-GGUF" / "F16"
    broken.mkdir()
    (broken / "tiny-F16.gguf").write_bytes(b"GGUF")  # no marker: a folder no pull published
    bundles = root / "bundles"
    bundles.mkdir()
    (bundles / ".tiny.gguf.llvm.abc.giw.x1y2.tmp").write_bytes(b"GIW")
    (bundles / "old.gguf.llvm.def.giw").write_bytes(b"not a bundle")

    entries = {(e.kind, e.name): e for e in cache_list.entries()}
    partial = entries[("hub", "hf:o/tiny-GGUF:Q8_0")]
    assert not partial.complete and "1 in progress" in partial.detail and partial.ref == "hf:o/tiny-GGUF:Q8_0"
    assert partial.size == 100 + len(b'{"repo": "o/tiny-GGUF", "selector": "Q8_0"}')
    assert not entries[("hub", "hf:o/tiny-GGUF:F16")].complete
    building = entries[("bundle", "tiny.gguf.llvm.abc.giw")]
    assert not building.complete and building.ref is None and "not finished" in building.detail
    unreadable = entries[("bundle", "old.gguf.llvm.def.giw")]
    assert not unreadable.complete and unreadable.ref is None and unreadable.detail.startswith("not loadable")

    result = CliRunner().invoke(main, ["cache"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"goinfer cache at {root}: 4 entries")
    assert "incomplete" in result.output and "hf:o/tiny-GGUF:Q8_0" in result.output
    listed = json.loads(CliRunner().invoke(main, ["cache", "--json"]).output)
    assert {(e["kind"], e["name"]) for e in listed} == set(entries)


def test_the_puller_refuses_what_no_pull_takes(hub: HubServer) -> None:
    puller = ModelPuller(OPTIONS)
    with pytest.raises(BadQuant, match="quant 'int3'"):
        puller.check("qwen2.5-coder-0.5b", "int3")
    with pytest.raises(ValueError, match="neither a zoo model"):
        puller.check("./model.gguf", None)
    with pytest.raises(ValueError, match="not a Hub reference"):
        puller.check("hf:nope", None)
    with pytest.raises(ValueError, match="no GGUF for quant Q4_K_M; the repo has F32"):
        puller.plan("hf:o/tiny-GGUF:Q4_K_M", None)
    catalog = puller.catalog()
    assert [m["name"] for m in catalog["zoo"]] == zoo.names()
    assert {m["kind"] for m in catalog["zoo"]} == {"chat", "embedding"}
    assert "gguf" in catalog["quants"] and catalog["default_quant"] == "gguf"


def test_a_zoo_model_is_cached_by_its_marker_alone(tmp_path: Path) -> None:
    """zoo.cached: the marker's stamp (size, mtime) says verified; nothing is hashed or fetched."""
    model = zoo.ZOO["smollm2-135m"]
    models = tmp_path / "models"
    models.mkdir()
    assert zoo.cached("smollm2-135m", tmp_path) is None
    path = models / model.filename
    path.write_bytes(b"stand-in bytes")  # not the model: only a hash would tell, and none is taken
    st = path.stat()
    stamp = {"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    (models / f"{model.filename}.sha256-ok").write_text(json.dumps(stamp))
    assert zoo.cached("smollm2-135m", tmp_path) == path
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched since it was verified
    assert zoo.cached("smollm2-135m", tmp_path) is None
