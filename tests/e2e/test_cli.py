"""The `goinfer` command as a user meets it: output on stdout only, one-line errors, exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from goinfer.cli.main import main
from tiny_gguf import ARCH, NEW_MODELS, rewrite_gguf


def _run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def _assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("goinfer: error: ")
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def bad_inputs(tiny_gguf, tmp_path: Path) -> dict[str, Path]:
    good = tiny_gguf("llama")
    data = good.read_bytes()
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04 not a model")
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 500])
    return {
        "not_gguf": tmp_path / "zip.gguf",
        "truncated": tmp_path / "cut.gguf",
        "arch": rewrite_gguf(good, tmp_path / "phi.gguf", arch="phi2"),
        "type": rewrite_gguf(good, tmp_path / "f64.gguf", retype={"blk.1.ffn_up.weight": np.float64}),
        "rope": rewrite_gguf(good, tmp_path / "ntk.gguf", set_keys={"llama.rope.scaling.type": "dynamic",
                                                                    "llama.rope.scaling.factor": 2.0}),
        "partial": rewrite_gguf(good, tmp_path / "rot.gguf", set_keys={"llama.rope.dimension_count": 8}),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("not_gguf", ["not a GGUF file"]),
        ("truncated", ["truncated"]),
        ("arch", ["phi2", "llama, qwen2, qwen3, gemma3, phi3, mistral"]),
        ("type", ["unsupported type F64"]),
        ("rope", ["rope scaling 'dynamic' is not supported (supported: linear, yarn, llama3, longrope)"]),
        ("partial", ["partial rotary is not supported"]),
    ],
)
def test_build_refuses_bad_checkpoints(case, needles, bad_inputs, tmp_path: Path) -> None:
    out = tmp_path / "out.giw"
    _assert_one_line_error(_run("build", bad_inputs[case], "-o", out), *needles)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temp file was left behind"


def test_build_refuses_unknown_target_quant_and_unwritable_output(tiny_gguf, tmp_path: Path) -> None:
    src = tiny_gguf("llama")
    out = tmp_path / "a.giw"
    _assert_one_line_error(_run("build", src, "--target", "tpu", "-o", out), "unknown target 'tpu'")
    _assert_one_line_error(_run("build", src, "--quant", "int3", "-o", out), "unknown quant 'int3'")
    _assert_one_line_error(_run("build", src, "-o", tmp_path / "no" / "such" / "a.giw"), "cannot write")
    _assert_one_line_error(_run("build", src, "-o", tmp_path), "cannot write")
    _assert_one_line_error(_run("build", tmp_path / "missing.gguf", "-o", tmp_path / "a.giw"), "missing.gguf")
    assert not list(tmp_path.glob("*.giw"))


def test_build_kv_dtype(tiny_gguf, tmp_path: Path) -> None:
    src, out = tiny_gguf("llama", "F32"), tmp_path / "f32kv.giw"
    _assert_one_line_error(_run("build", src, "--kv-dtype", "f8", "-o", out), "--kv-dtype", "f8")
    assert _run("build", src, "--quant", "f32", "--kv-dtype", "f32", "-o", out).exit_code == 0
    manifest = json.loads(_run("inspect", out, "--json").stdout)
    assert manifest["kv_cache"]["dtype"] == "float32"


@pytest.mark.parametrize("model", NEW_MODELS)
def test_build_and_chat_on_each_newer_family(model, tiny_gguf, tmp_path: Path) -> None:
    """`goinfer build` on a GGUF of qwen3, llama 3.x (rope_freqs), llama with YaRN, phi3 and
    mistral, then a chat turn through the checkpoint's own template (their real families')."""
    out = tmp_path / f"{model}.giw"
    built = _run("build", tiny_gguf(model), "--quant", "f32", "--kv-dtype", "f32", "-o", out)
    assert built.exit_code == 0, built.stderr
    manifest = json.loads(_run("inspect", out, "--json").stdout)
    assert manifest["model"]["family"] == ARCH.get(model, model)
    assert manifest["chat_template_origin"] == "checkpoint"
    chat = _run("generate", out, "Name a prime.", "--chat", "--temperature", "0", "--max-tokens", "4")
    assert chat.exit_code == 0 and chat.stderr == "", chat.stderr


def test_generate_prints_only_the_text(tiny_bundle) -> None:
    from goinfer.runtime.decode import GenerationRequest
    from goinfer.runtime.model import Model
    from goinfer.runtime.sampler import SamplingParams

    bundle = tiny_bundle("qwen2", "f32")
    m = Model.load(bundle)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    events = list(m.generate(GenerationRequest(m.encode("Hello world"), greedy)))
    expected = "".join(e.text for e in events) + "\n"
    result = _run("generate", bundle, "Hello world", "--max-tokens", "12", "--temperature", "0")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == expected
    assert result.stderr == ""
    verbose = _run("generate", bundle, "Hello world", "--max-tokens", "12", "--temperature", "0", "-v")
    assert verbose.stdout == expected and "tok/s" in verbose.stderr


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_generate_chat_is_seeded(family, tiny_bundle) -> None:
    bundle = tiny_bundle(family, "f32")
    args = ("generate", bundle, "Name a prime.", "--chat", "--temperature", "0.9", "--seed", "1")
    args += ("--max-tokens", "8")
    a, b = _run(*args), _run(*args)
    assert a.exit_code == 0, a.stderr
    assert a.stdout == b.stdout


def test_inspect_human_and_json(tiny_bundle) -> None:
    bundle = tiny_bundle("gemma3", "int4")
    human = _run("inspect", bundle)
    assert human.exit_code == 0 and "gemma3" in human.stdout and "int4" in human.stdout
    manifest = json.loads(_run("inspect", bundle, "--json").stdout)
    assert manifest["model"]["family"] == "gemma3" and manifest["build"]["quant"] == "int4"
    assert manifest["chat_template_origin"].startswith("family default")
    assert manifest["source"]["sha256"] and manifest["build"]["target"] == "llvm"
    assert manifest["kv_cache"]["prefill_chunk"] > 0 and manifest["tensors"] and manifest["modules"]


def test_corrupt_bundle_is_refused(tiny_bundle, tmp_path: Path) -> None:
    data = bytearray(Path(tiny_bundle("llama", "int8")).read_bytes())
    (tmp_path / "cut.giw").write_bytes(data[: len(data) // 2])
    _assert_one_line_error(_run("generate", tmp_path / "cut.giw", "hi"), "truncated")
    (tmp_path / "magic.giw").write_bytes(b"XXXX" + data[4:])
    _assert_one_line_error(_run("inspect", tmp_path / "magic.giw"), "magic")
    _assert_one_line_error(_run("generate", tmp_path / "nope.giw", "hi"), "nope.giw")


def test_inspect_verify_checks_every_digest(tiny_bundle, tmp_path: Path) -> None:
    """A flipped weight byte: `inspect` shows the manifest (it reads no blob), `inspect --verify`
    hashes every one and exits 2 naming the tensor whose sha256 does not match."""
    from goinfer.artifacts import giw

    good = Path(tiny_bundle("llama", "int8"))
    ok = _run("inspect", "--verify", good)
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.splitlines()[-1].startswith("verified: ") and "match their sha256" in ok.stdout
    as_json = _run("inspect", "--verify", "--json", good)  # stdout stays one JSON document
    assert as_json.exit_code == 0 and json.loads(as_json.stdout) and "verified: " in as_json.stderr

    with giw.open_bundle(good, verify="none") as b:
        name = next(n for n in b.tensor_names() if n.endswith(".weight"))
        offset = b.tensor_info(name).file_offset
    data = bytearray(good.read_bytes())
    data[offset + 3] ^= 0x10
    bad = tmp_path / "flipped.giw"
    bad.write_bytes(bytes(data))
    assert _run("inspect", bad).exit_code == 0
    _assert_one_line_error(_run("inspect", "--verify", bad), "sha256 mismatch", repr(name))
    _assert_one_line_error(_run("inspect", "--verify", "--json", bad), "sha256 mismatch", repr(name))
