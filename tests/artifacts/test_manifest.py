"""The typed manifest: a round trip, refusals that name the field, checks against the bundle."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from goinfer.artifacts import giw
from goinfer.artifacts.manifest import CpuTier, GpuModule, GpuSelfTest, Manifest, describe
from sample_manifest import sample


def write(
    path: Path, m: dict[str, Any], tensors: tuple[str, ...] = ("w", "tokenizer.json", "st.in0", "st.want")
):
    arrays = [(n, np.zeros(4, np.float32)) for n in tensors]
    giw.write_bundle(
        path, m, arrays, [("llvm", {"kind": "llvm"}, b"x"), ("selftest@avx2", {"kind": "llvm"}, b"y")]
    )
    return giw.open_bundle(path, verify="none")


def test_round_trip_through_json_and_a_bundle(tmp_path: Path) -> None:
    m = sample()
    text = json.dumps(m.to_json())  # plain JSON types only
    assert Manifest.from_json(json.loads(text)) == m
    with write(tmp_path / "a.giw", m.to_json()) as b:
        assert Manifest.of(b) == m
    # each fact once: family and context length in the model, the quant in the build
    assert {"family", "context_length", "quant"}.isdisjoint(m.to_json())
    assert (m.family, m.context_length, m.quant) == ("llama", 64, "f32")


@pytest.mark.parametrize(
    ("edit", "expect"),
    [
        (lambda d: d.pop("kv_cache"), "manifest.kv_cache is missing"),
        (lambda d: d["kv_cache"].pop("prefill_chunk"), "manifest.kv_cache.prefill_chunk is missing"),
        (
            lambda d: d["kv_cache"].update(prefill_chunk=0),
            "kv_cache.prefill_chunk is 0, not a positive count",
        ),
        (lambda d: d["kv_cache"].update(dtype="bfloat16"), "kv_cache.dtype is 'bfloat16', not one of"),
        (lambda d: d["model"].update(vocab_size="8"), "manifest.model.vocab_size is not int"),
        (lambda d: d["model"].update(context_length=True), "manifest.model.context_length is not int"),
        (lambda d: d["tokens"].update(stop_ids=[7, "x"]), r"manifest.tokens.stop_ids\[1\] is not int"),
        (lambda d: d.update(config={}), "unknown field manifest.config"),
        (lambda d: d.update(forward_input="token_ids"), "unknown field manifest.forward_input"),
        (lambda d: d.update(entry_points=["prefill_all", "decode"]), "lacks batch_prefill, batch_d"),
        (lambda d: d.update(cpu_tiers=[]), "neither cpu_tiers nor gpu_modules names a module"),
        (
            lambda d: d.update(gpu_modules=[{"kind": "rocm", "arch": "", "module": "rocm", "target": {}}]),
            "gpu_modules kind 'rocm' is not one of cuda, metal",
        ),
        (
            lambda d: d.update(
                gpu_modules=[{"kind": "cuda", "arch": "sm_90", "module": "cuda", "target": {}}]
            ),
            "gpu_modules without a gpu_selftest",
        ),
        (lambda d: d["cpu_tiers"][0].pop("selftest"), r"manifest.cpu_tiers\[0\].selftest is missing"),
        (lambda d: d.update(weight_schemes={"a": 1}), "manifest.weight_schemes.a is not str"),
    ],
)
def test_a_bad_manifest_is_refused_naming_the_field(edit: Any, expect: str) -> None:
    d = sample().to_json()
    edit(d)
    with pytest.raises(giw.BundleError, match=expect):
        Manifest.from_json(d)


def test_the_bundle_must_hold_what_its_manifest_names(tmp_path: Path) -> None:
    no_tokenizer = write(tmp_path / "a.giw", sample().to_json(), ("w", "st.in0", "st.want"))
    with no_tokenizer as b, pytest.raises(giw.BundleError, match=r"no tensor 'tokenizer\.json', which"):
        Manifest.of(b)
    tiers = (CpuTier("avx2", "llvm@avx2", "selftest@avx2", {}),)
    other_module = write(tmp_path / "b.giw", dataclasses.replace(sample(), cpu_tiers=tiers).to_json())
    with other_module as b, pytest.raises(giw.BundleError, match="no module 'llvm@avx2', which its manifest"):
        Manifest.of(b)
    gpu = dataclasses.replace(
        sample(),
        gpu_modules=(
            GpuModule("cuda", "sm_90", "llvm", {}, kernels="cuda.kernels", kernels_source_sha256="0"),
        ),
        gpu_selftest=GpuSelfTest(prompt="st.in0", want="st.want", min_cosine=0.995),
    )
    with (
        write(tmp_path / "c.giw", gpu.to_json()) as b,
        pytest.raises(giw.BundleError, match=r"no module 'cuda\.kernels'"),
    ):
        Manifest.of(b)


def test_describe(tmp_path: Path) -> None:
    with write(tmp_path / "tiny.giw", sample().to_json()) as b:
        text = describe(b)
    for part in (
        "tiny.giw",
        "format v3",
        "llama",
        "quant f32",
        "context 64",
        "prefill chunks of 64",
        "tensors  4",
    ):
        assert part in text, part
    for part in ("selftest@avx2", "tiny.gguf  sha256 abababababababab"):
        assert part in text, part
