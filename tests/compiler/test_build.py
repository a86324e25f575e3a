"""Builds are reproducible, reuse compiled modules, and bundles map their weights zero-copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from goinfer.compiler.build import BuildOptions, build
from tiny_gguf import rewrite_gguf


def _quiet(_msg: str) -> None:
    pass


def test_rebuild_is_byte_identical_and_reuses_the_module(tiny_gguf, tmp_path: Path) -> None:
    src = tiny_gguf("qwen2")
    a = build(src, tmp_path / "a.giw", BuildOptions(quant="int4", num_cores=2), progress=_quiet)
    b = build(src, tmp_path / "b.giw", BuildOptions(quant="int4", num_cores=2), progress=_quiet)
    assert b.compiled_from_cache
    assert (tmp_path / "a.giw").read_bytes() == (tmp_path / "b.giw").read_bytes()
    assert a.sha256 == b.sha256


def test_a_warm_rebuild_compiles_nothing_and_streams_the_same_weights(
    tiny_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same graph, schemes and target: the modules and the self-test's libraries come from the
    cache (nothing exported, no kernel built or compiled), the checkpoint is not hashed again, and
    the bundle is byte-identical. The weights streamed into it, a slice of rows at a time on
    threads, are what the in-memory pack gives."""
    from goinfer.artifacts import cache, giw
    from goinfer.compiler import build as build_mod
    from goinfer.compiler import compile_cache, selftest
    from goinfer.compiler.models import layer
    from goinfer.compiler.models.decoder import build_model
    from goinfer.compiler.quant import gguf, scheme_for
    from goinfer.compiler.sources import load_checkpoint

    src = tiny_gguf("qwen2", "Q5_0+Q8_0:attn_v")  # two affine layouts: two self-test fixtures
    options = BuildOptions(quant="gguf", num_cores=2)
    monkeypatch.setattr(gguf, "PIECE_WEIGHTS", 1)  # a row block a piece: many pieces per weight
    a = build(src, tmp_path / "a.giw", options, progress=_quiet)

    def refuse(*_a, **_k):
        raise AssertionError("a warm build compiled, built a kernel or hashed the checkpoint")

    monkeypatch.setattr(compile_cache.export, "compile_module", refuse)
    monkeypatch.setattr(selftest, "compile_kernels", refuse)
    monkeypatch.setattr(selftest, "kernels", refuse)
    monkeypatch.setattr(cache, "sha256_files", refuse)
    b = build(src, tmp_path / "b.giw", options, progress=_quiet)
    assert b.compiled_from_cache and a.sha256 == b.sha256
    assert (tmp_path / "a.giw").read_bytes() == (tmp_path / "b.giw").read_bytes()

    ckpt = load_checkpoint(src)
    model = build_model(
        ckpt.spec, layer("qwen2"), lambda p: scheme_for("gguf", p), ckpt.tensors, {"kind": "llvm"}, "float16"
    )
    tensors, _ = build_mod._pack_weights(model, ckpt, _quiet)
    with giw.open_bundle(tmp_path / "b.giw", verify="full") as bundle:
        params = bundle.manifest["params"]
        assert params and set(tensors) == set(params)
        for name in params:
            assert bundle.tensor(name).tobytes() == tensors[name].tobytes(), name


def test_manifest_records_source_and_flags(tiny_bundle, tiny_gguf) -> None:
    from goinfer.artifacts import cache, giw
    from goinfer.artifacts.manifest import Manifest, Source

    with giw.open_bundle(tiny_bundle("llama", "int8int8"), verify="full") as b:
        m = Manifest.of(b)
        assert m.source == Source(tiny_gguf("llama").name, cache.sha256_file(tiny_gguf("llama")))
        assert m.build.quant == "int8int8" and m.build.target == "llvm"
        assert m.cpu_tiers[0].target["kind"] == "llvm" and "-amx-tile" in m.cpu_tiers[0].target["mattr"]
        assert m.tvm_version and m.goinfer_version
        # every other tensor is a self-test fixture or the tokenizer, never a weight
        others = {n for n in b.tensor_names() if n.startswith("selftest.") or n == m.tokenizer_tensor}
        assert set(m.params) == set(b.tensor_names()) - others


def test_the_prefill_chunk_is_always_a_concrete_number() -> None:
    from goinfer.artifacts.manifest import ModelSpec
    from goinfer.compiler.build import MAX_PREFILL_CHUNK, kv_cache

    spec = ModelSpec("llama", 8, 4, 8, 1, 1, 1, 4, context_length=32768, norm_eps=1e-5, rope_theta=1e4)
    assert kv_cache(spec).prefill_chunk == MAX_PREFILL_CHUNK  # was 0 ("the whole window")
    assert kv_cache(spec.__class__(**{**spec.__dict__, "context_length": 256})).prefill_chunk == 256
    windowed = spec.__class__(**{**spec.__dict__, "sliding_window": 512})
    assert kv_cache(windowed).prefill_chunk == 511  # shorter than the window: windowed layers stay exact


def test_an_unknown_kv_dtype_is_refused(tiny_gguf, tmp_path: Path) -> None:
    from goinfer.compiler.build import BuildError

    with pytest.raises(BuildError, match="unknown KV cache dtype 'bfloat16'; choose one of float16, float32"):
        build(tiny_gguf("llama"), tmp_path / "x.giw", BuildOptions(kv_dtype="bfloat16"), progress=_quiet)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_the_kv_dtype_reaches_the_cache_and_every_kernel_it_calls(tiny_gguf, kv_dtype: str) -> None:
    """Ours in place of the stock kernels take the dtype the cache was created with; a float32
    cache leaves no half anywhere (the module exported before the option existed)."""
    from goinfer.compiler.kernels import attention, kv_append
    from goinfer.compiler.models import layer
    from goinfer.compiler.models.decoder import build_model
    from goinfer.compiler.quant import scheme_for
    from goinfer.compiler.sources import load_checkpoint
    from goinfer.compiler.tvm import passes, targets

    ckpt = load_checkpoint(tiny_gguf("gemma3"))  # sliding layers: every kernel is called

    def pick(parts):
        return scheme_for("f32", parts)

    model = build_model(ckpt.spec, layer("gemma3"), pick, ckpt.tensors, targets.host_target(2), kv_dtype)
    mod, _ = model.exported()
    funcs = {gv.name_hint: f for gv, f in mod.functions_items()}
    kernels = [attention.RAGGED, attention.PREFILL, attention.PREFILL_SLIDING, attention.DECODE]
    for name in [*kernels, attention.DECODE_SLIDING, kv_append.APPEND, kv_append.SPLIT]:
        assert passes.param_dtype(funcs[name], 0) == kv_dtype, name  # q, pages or the fused qkv
    assert ("float16" in mod.script()) == (kv_dtype == "float16")


def test_int4mix_keeps_the_source_precision_mix(tiny_gguf, tmp_path: Path) -> None:
    """What the checkpoint stores at >= 5 bits a weight stays 8-bit (int8), its 4-bit tensors become
    int4: a Q4_0 llama (4.5 bits) whose ffn_down matrices are Q5_0 (5.5 bits), as a Q4_K_M file
    keeps some tensors at Q6_K."""
    from goinfer.artifacts import giw

    donor = (tiny_gguf("llama", "Q5_0"), "ffn_down")
    src = rewrite_gguf(tiny_gguf("llama", "Q4_0"), tmp_path / "mix.gguf", donor=donor)
    build(src, tmp_path / "mix.giw", BuildOptions(quant="int4mix", num_cores=2), progress=_quiet)
    with giw.open_bundle(tmp_path / "mix.giw", verify="none") as b:
        schemes = b.manifest["weight_schemes"]
    quantized = {k: v for k, v in schemes.items() if v != "f32"}  # norms and biases stay f32
    assert quantized == {k: "int8" if k.endswith(".mlp.down") else "int4" for k in quantized}
    # the tied embedding and 2 layers of qkv, o, gate_up and down, of which the 2 downs are 8-bit
    assert len(quantized) == 9 and list(quantized.values()).count("int8") == 2, quantized


@pytest.mark.parametrize(
    ("tensor_type", "split", "fused"),
    [("Q5_0+Q8_0:attn_v", "attn.qkv", "mlp.gate_up"), ("Q5_0+Q8_0:ffn_up", "mlp.gate_up", "attn.qkv")],
)
def test_a_fused_weight_of_mixed_types_is_split_under_its_own_name(tiny_gguf, tensor_type, split, fused):
    """Q5_0 q and k beside a Q8_0 v (or gate beside up): a matmul per layout, named after the fused
    weight ("attn.qkv.0", "attn.qkv.1"), so every parameter's name is unique and the same each
    build; a fused weight of one type keeps its one matmul and its name."""
    from goinfer.compiler.models import layer
    from goinfer.compiler.models.decoder import build_model
    from goinfer.compiler.models.layers import Weighted
    from goinfer.compiler.quant import scheme_for
    from goinfer.compiler.sources import load_checkpoint
    from goinfer.compiler.tvm import graph, targets

    ckpt = load_checkpoint(tiny_gguf("qwen2", tensor_type))

    def pick(parts):
        return scheme_for("gguf", parts)

    model = build_model(ckpt.spec, layer("qwen2"), pick, ckpt.tensors, targets.host_target(2), "float32")
    weights = {prefix: m for prefix, m in graph.modules_of_type(model, Weighted)}
    for i in range(ckpt.spec.num_layers):
        head = f"layers.{i}."
        assert [weights[f"{head}{split}.{j}"].scheme.NAME for j in (0, 1)] == [
            "gguf:u5-g32-float16-z16",
            "gguf:u8-g32-float16-z128",
        ]
        assert f"{head}{split}" not in weights and f"{head}{fused}.0" not in weights
        assert weights[f"{head}{fused}"].scheme.NAME == "gguf:u5-g32-float16-z16"
    names = [name for name, _p in model.named_parameters()]
    assert len(names) == len(set(names))
    assert {n for n in names if n.startswith(f"layers.0.{split}.")} == {
        f"layers.0.{split}.0.weight",
        f"layers.0.{split}.0.high",
        f"layers.0.{split}.0.scale",
        f"layers.0.{split}.1.weight",
        f"layers.0.{split}.1.scale",
    }


def test_weights_are_mapped_zero_copy(tiny_bundle) -> None:
    from goinfer.runtime import tvm_runtime as rt
    from goinfer.runtime.model import Model

    m = Model.load(tiny_bundle("gemma3", "int4"))
    base = (
        int(m.bundle.tensor(m.manifest.params[0]).ctypes.data)
        - m.bundle.tensor_info(m.manifest.params[0]).file_offset
    )
    for name, t in zip(m.manifest.params, m.params, strict=True):
        info = m.bundle.tensor_info(name)
        assert rt.data_pointer(t) == base + info.file_offset, name


def test_tokenizer_json_reads_the_byte_tensor_and_refuses_a_bad_one(tmp_path) -> None:
    from goinfer.artifacts import giw
    from goinfer.runtime.model import tokenizer_json
    from sample_manifest import sample

    text = '{"model": {"type": "BPE", "vocab": {"é": 0, "漢": 1}}}'
    m = sample()

    def bundle(data: bytes) -> giw.Bundle:
        path = tmp_path / f"b{len(list(tmp_path.iterdir()))}.giw"
        giw.write_bundle(path, m.to_json(), [(m.tokenizer_tensor, np.frombuffer(data, np.uint8))])
        return giw.open_bundle(path, verify="full")

    with bundle(text.encode("utf-8")) as b:
        assert tokenizer_json(b, m) == text
    with bundle(b"\xff{}") as b, pytest.raises(giw.BundleError, match="is not UTF-8"):
        tokenizer_json(b, m)


def test_output_is_optional_and_targets_are_checked(tiny_gguf, tmp_path: Path) -> None:
    import shutil

    from goinfer.compiler.build import BuildError, default_output

    src = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf("llama"), src)
    options = BuildOptions(target="llvm", quant="int4", num_cores=2)
    assert default_output(src, options) == tmp_path / "model.int4.llvm.giw"
    assert default_output(src, BuildOptions(target="llvm,cuda")).name == "model.gguf.llvm+cuda.giw"
    assert default_output("qwen2.5-coder-0.5b", options) == Path("qwen2.5-coder-0.5b.int4.llvm.giw")
    result = build(src, None, options, progress=_quiet)
    assert result.path == tmp_path / "model.int4.llvm.giw" and result.path.is_file()
    for target, message in (
        ("rocm", "unknown target 'rocm'; choose one or more of llvm, cuda, metal"),
        ("llvm,llvm", "names a target twice"),
        ("", "unknown target ''"),
    ):
        with pytest.raises(BuildError, match=message):
            build(src, tmp_path / "x.giw", BuildOptions(target=target), progress=_quiet)
    with pytest.raises(BuildError, match="CUDA arch 'ninety'"):
        build(src, tmp_path / "x.giw", BuildOptions(target="cuda", cuda_arch="ninety"), progress=_quiet)
