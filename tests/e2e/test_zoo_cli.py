"""`goinfer zoo build/plan/merge` and serving from the store they make, on a tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from goinfer.artifacts import giw, zoo_store
from goinfer.cli.main import main


def _run(*args: str | Path):
    return CliRunner().invoke(main, [str(a) for a in args])


def _zoo_build(source: Path, store: Path, *extra: str):
    # kv f32: the same graph the tiny_bundle fixture compiles, so the module cache serves both
    return _run("zoo", "build", "--models", source, "--kv-dtype", "f32", *extra, "-o", store)


@pytest.fixture(scope="module")
def store(tiny_gguf, tmp_path_factory) -> tuple[Path, Path]:
    source = tiny_gguf("llama")
    folder = tmp_path_factory.mktemp("zoo") / "store"
    result = _zoo_build(source, folder)
    assert result.exit_code == 0, (result.output, result.exception)
    return source, folder


def test_zoo_build_writes_a_content_addressed_store_and_its_index(store) -> None:
    source, folder = store
    (entry,) = zoo_store.read_index(folder)
    assert entry.name == f"{source.stem}.gguf.llvm" and entry.model == source.stem
    assert (entry.quant, entry.target, entry.kv_dtype) == ("gguf", "llvm", "float32")
    assert entry.path == f"bundles/{entry.key}.giw"
    bundle = folder / entry.path
    assert bundle.stat().st_size == entry.size
    with giw.open_bundle(bundle, verify="full") as b:
        assert b.manifest["build"]["quant"] == "gguf"
        assert b.manifest["source"]["sha256"] == entry.source_sha256  # the key's digest is the build's
    assert zoo_store.verified(folder, entry)


def test_a_second_zoo_build_builds_nothing_and_says_so(store) -> None:
    source, folder = store
    before = (folder / zoo_store.INDEX).read_bytes()
    result = _zoo_build(source, folder)
    assert result.exit_code == 0, result.output
    assert "nothing to build: all 1 bundles are in" in result.stdout
    assert "already built" in result.stderr and "[1/6]" not in result.stderr
    assert (folder / zoo_store.INDEX).read_bytes() == before


def test_a_damaged_bundle_is_rebuilt(store, tmp_path: Path) -> None:
    source, _ = store
    copy = tmp_path / "store"
    _zoo_build(source, copy)
    (entry,) = zoo_store.read_index(copy)
    with (copy / entry.path).open("r+b") as f:
        f.seek(entry.size // 2)
        f.write(b"\xff\xff")
    result = _zoo_build(source, copy)
    assert result.exit_code == 0 and "built 1, 0 already there" in result.stdout, result.output
    assert zoo_store.verified(copy, entry)


def test_zoo_plan_prints_a_github_matrix_and_keys(tiny_gguf) -> None:
    source = tiny_gguf("llama")
    result = _run(
        "zoo", "plan", "--models", f"{source},smollm2-135m", "--quants", "gguf,int4", "--format", "github"
    )
    assert result.exit_code == 0, result.output
    cells = json.loads(result.stdout)["include"]
    assert [(c["model"], c["quant"], c["target"]) for c in cells] == [
        (str(source), "gguf", "llvm"),
        (str(source), "int4", "llvm"),
        ("smollm2-135m", "gguf", "llvm"),
        ("smollm2-135m", "int4", "llvm"),
    ]
    # A zoo model's key comes from its pinned sha256: planning it fetches nothing.
    keys = _run("zoo", "plan", "--models", "smollm2-135m", "--targets", "llvm,llvm+cuda", "--format", "key")
    assert keys.exit_code == 0, keys.output
    lines = keys.stdout.split()
    assert len(lines) == 2 and len(set(lines)) == 2 and all(len(k) == 32 for k in lines)
    bad = _run("zoo", "plan", "--models", "smollm2-135m", "--targets", "tpu")
    assert bad.exit_code == 2 and "unknown target 'tpu'" in bad.stderr


def test_zoo_merge_joins_the_cells_stores(store, tiny_gguf, tmp_path: Path) -> None:
    source, folder = store
    other = tmp_path / "cell2"
    result = _zoo_build(tiny_gguf("qwen2"), other)
    assert result.exit_code == 0, result.output
    merged = tmp_path / "merged"
    result = _run("zoo", "merge", folder, other / "index.json", "-o", merged)
    assert result.exit_code == 0, result.output
    entries = zoo_store.read_index(merged)
    assert sorted(e.model for e in entries) == sorted([source.stem, tiny_gguf("qwen2").stem])
    assert all(zoo_store.verified(merged, e) for e in entries)
    # Merging again changes nothing; a store whose name maps to other bytes is refused.
    assert _run("zoo", "merge", folder, other, "-o", merged).exit_code == 0
    (entry,) = zoo_store.read_index(other)
    forged = tmp_path / "forged"
    zoo_store.write_index(
        forged, [zoo_store.Entry(**{**entry.__dict__, "name": zoo_store.read_index(folder)[0].name})]
    )
    (forged / entry.path).parent.mkdir(parents=True)
    (forged / entry.path).write_bytes((other / entry.path).read_bytes())
    result = _run("zoo", "merge", forged, "-o", merged)
    assert result.exit_code == 2 and "key" in result.stderr, result.output


def test_generate_from_a_store_never_builds(store, monkeypatch) -> None:
    source, folder = store
    import goinfer.compiler.build as build_module

    def no_build(*_a, **_k):
        raise AssertionError("a zoo: model was built")

    monkeypatch.setattr(build_module, "build", no_build)
    for ref in (f"zoo:{folder}/{source.stem}", f"zoo:{folder}/{source.stem}.gguf.llvm"):
        result = _run("generate", ref, "hello", "--max-tokens", "3", "--temperature", "0", "--no-selftest")
        assert result.exit_code == 0, (result.output, result.exception)
    missing = _run("generate", f"zoo:{folder}/nope", "hi", "--max-tokens", "1")
    assert (
        missing.exit_code == 2 and "is not in the store" in missing.stderr and source.stem in missing.stderr
    )


def test_serve_names_every_bundle_of_a_store(store) -> None:
    from goinfer.compiler.resolve import model_specs

    source, folder = store
    name = f"{source.stem}.gguf.llvm"
    assert model_specs((f"zoo:{folder}",)) == [(name, f"zoo:{folder}/{name}")]
    assert model_specs((f"zoo:{folder}/index.json",)) == [(name, f"zoo:{folder}/{name}")]
    assert model_specs((f"zoo:{folder}/{source.stem}",)) == [(source.stem, f"zoo:{folder}/{source.stem}")]
    assert model_specs(("m=zoo:x/y", "/a/b/qwen-00001-of-00003.gguf")) == [
        ("m", "zoo:x/y"),
        ("qwen", "/a/b/qwen-00001-of-00003.gguf"),
    ]


def test_the_example_workflow_calls_goinfer_as_it_is() -> None:
    """ci/zoo-workflow.yml: a GitHub matrix from zoo plan, one cell per job, a merge; every goinfer
    command in it names a real subcommand and real options."""
    import shlex

    import yaml

    flow = yaml.safe_load((Path(__file__).parents[2] / "ci" / "zoo-workflow.yml").read_text())
    jobs = flow["jobs"]
    assert jobs["build"]["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert jobs["build"]["needs"] == "plan" and jobs["merge"]["needs"] == "build"
    caches = [
        s["with"]["key"] for s in jobs["build"]["steps"] if s.get("uses", "").startswith("actions/cache")
    ]
    assert any("steps.key.outputs.key" in k for k in caches)
    commands = []
    for job in jobs.values():
        for step in job["steps"]:
            script = step.get("run", "").replace("\\\n", " ")
            for part in script.replace("$(", "\n").replace(")", "\n").splitlines():
                words = shlex.split(part.split(">>")[0].strip()) if "goinfer zoo" in part else []
                if words:
                    commands.append(words[words.index("goinfer") + 1 :])
    assert {c[1] for c in commands} == {"plan", "build", "merge"}
    zoo = main.commands["zoo"]
    for words in commands:
        options = {o for p in zoo.commands[words[1]].params for o in p.opts}
        assert {w for w in words if w.startswith("-")} <= options, words
