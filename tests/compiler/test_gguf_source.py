"""The GGUF source on tiny files: the spec per family, tensors and dequantization, and every error path."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from goinfer.artifacts.manifest import ModelSpec, RopeScaling
from goinfer.compiler.sources.base import Checkpoint, SourceError
from goinfer.compiler.sources.gguf_file import _unpermute_rows, load_gguf
from tiny_gguf import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    _permute,
    rewrite_gguf,
    tiny_vocab,
    tiny_weights,
    write_tiny_gguf,
)

FAMILIES = ("llama", "qwen2", "gemma3")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny_gguf(root / f"{f}.gguf", f) for f in FAMILIES}


def _ids(family: str) -> dict[str, int]:
    return {t: i for i, t in enumerate(tiny_vocab(family)[0])}


def test_llama_spec(tiny: dict[str, Path]) -> None:
    ckpt = load_gguf(tiny["llama"])
    spec, tokens, ids = ckpt.spec, ckpt.tokens, _ids("llama")
    assert (spec.family, spec.vocab_size, spec.hidden_size) == ("llama", len(ids), 64)
    assert (spec.intermediate_size, spec.num_layers, spec.num_heads) == (128, 2, HEADS)
    assert (spec.num_kv_heads, spec.head_dim) == (KV_HEADS, HEAD_DIM)
    assert (spec.context_length, spec.rope_theta, spec.rope_scaling) == (256, 10000.0, RopeScaling())
    assert spec.norm_eps == pytest.approx(1e-5)
    assert spec.tie_embeddings and not spec.attention_bias
    # <|im_end|> is the EOS; llama.cpp also stops at <|endoftext|> by its text.
    assert tokens.bos_id == ids["<|im_start|>"]
    assert tokens.stop_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
    assert not tokens.add_bos
    assert (spec.activation, spec.embed_scale) == ("silu", 1.0)
    assert (spec.sliding_window, spec.sliding_layers) == (0, ())


def test_qwen2_spec(tiny: dict[str, Path]) -> None:
    ckpt = load_gguf(tiny["qwen2"])
    spec, tokens, ids = ckpt.spec, ckpt.tokens, _ids("qwen2")
    assert spec.family == "qwen2" and spec.rope_theta == 1e6
    assert not spec.tie_embeddings and spec.attention_bias
    assert tokens.bos_id == ids["<|endoftext|>"]
    assert tokens.stop_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
    assert not tokens.add_bos and not spec.qk_norm


def test_gemma3_spec(tiny: dict[str, Path]) -> None:
    ckpt = load_gguf(tiny["gemma3"])
    spec, ids = ckpt.spec, _ids("gemma3")
    assert (spec.family, spec.num_layers, spec.head_dim) == ("gemma3", 6, HEAD_DIM)
    assert spec.activation == "gelu_tanh" and spec.embed_scale == pytest.approx(8.0)
    assert spec.qk_norm and spec.post_norms and spec.norm_weight_offset == 0.0
    assert spec.attn_scale == pytest.approx(HEAD_DIM**-0.5) and spec.softmax_scale == spec.attn_scale
    assert spec.sliding_window == 4
    assert spec.sliding_layers == (True, True, True, True, True, False)  # every 6th layer is global
    assert spec.rope_local_theta == 10000.0 and spec.rope_theta == 1e6
    assert spec.layer_rope_theta(0) == 10000.0 and spec.layer_rope_theta(5) == 1e6
    assert spec.tie_embeddings and ckpt.tokens.add_bos and ckpt.tokens.bos_id == ids["<bos>"]
    assert ckpt.tokens.stop_ids == (ids["<eos>"], ids["<end_of_turn>"])
    assert ckpt.chat_template_origin == "family default: checkpoint has no tokenizer.chat_template"
    assert "<start_of_turn>" in ckpt.chat_template


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_basics(tiny: dict[str, Path], family: str) -> None:
    ckpt = load_gguf(tiny[family])
    assert ModelSpec.from_json(ckpt.spec.to_json()) == ckpt.spec
    assert ckpt.sha256 == hashlib.sha256(tiny[family].read_bytes()).hexdigest()
    assert ckpt.source == str(tiny[family])
    if family != "gemma3":
        assert ckpt.chat_template_origin == "checkpoint" and "<|im_start|>" in ckpt.chat_template
    want = tiny_weights(family)
    assert set(ckpt.tensors) == set(want)
    for name, t in ckpt.tensors.items():
        assert t.name == name and t.shape == want[name].shape and (t.source_type, t.bits) == ("F32", 32.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_loads_exactly(tiny: dict[str, Path], family: str) -> None:
    # For llama this is the un-permute round trip: the file holds interleaved Q/K rows.
    ckpt = load_gguf(tiny[family])
    for name, expected in tiny_weights(family).items():
        got = ckpt.tensors[name].load()
        assert got.dtype == np.float32 and got.flags.writeable
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_llama_file_holds_permuted_rows(tiny: dict[str, Path]) -> None:
    stored = {t.name: np.array(t.data) for t in GGUFReader(tiny["llama"]).tensors}
    want = tiny_weights("llama")
    for i in range(LAYERS["llama"]):
        q, k = f"blk.{i}.attn_q.weight", f"blk.{i}.attn_k.weight"
        np.testing.assert_array_equal(stored[q], _permute(want[q], HEADS))
        np.testing.assert_array_equal(stored[k], _permute(want[k], KV_HEADS))
        assert not np.array_equal(stored[q], want[q])


@pytest.mark.parametrize(("heads", "head_dim"), [(1, 2), (3, 8), (4, 16)])
def test_unpermute_inverts_converter_permute(heads: int, head_dim: int) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((heads * head_dim, 5)).astype(np.float32)
    np.testing.assert_array_equal(_unpermute_rows(_permute(w, heads), heads), w)
    b = rng.standard_normal(heads * head_dim).astype(np.float32)  # a bias is one column
    np.testing.assert_array_equal(_unpermute_rows(_permute(b, heads), heads), b)


@pytest.mark.parametrize(
    ("tensor_type", "bits", "tol"),
    # tol: the worst error the encoding allows, as a fraction of the largest weight.
    [("F16", 16.0, 1e-3), ("BF16", 16.0, 8e-3), ("Q8_0", 8.5, 5e-3), ("Q4_1", 5.0, 7e-2)],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_dequantized_types(tmp_path: Path, family: str, tensor_type: str, bits: float, tol: float) -> None:
    ckpt = load_gguf(write_tiny_gguf(tmp_path / "m.gguf", family, tensor_type=tensor_type))
    for name, expected in tiny_weights(family).items():
        t = ckpt.tensors[name]
        if expected.ndim == 1:
            assert t.source_type == "F32"
            continue
        assert (t.source_type, t.bits) == (tensor_type, bits)
        got = t.load()
        assert got.dtype == np.float32 and got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=tol * np.abs(expected).max(), err_msg=name)


def _error(path: Path) -> str:
    with pytest.raises(SourceError) as info:
        load_gguf(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_not_a_gguf(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 definitely a zip")
    assert "not a GGUF file" in _error(tmp_path / "x.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "not a GGUF file" in _error(tmp_path / "empty.gguf")
    assert "cannot read" in _error(tmp_path / "missing.gguf")


def test_truncated_tensor_data(tiny: dict[str, Path], tmp_path: Path) -> None:
    data = tiny["qwen2"].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    message = _error(tmp_path / "cut.gguf")
    assert "truncated: tensor" in message and f"the file has {len(data) - 1000}" in message


def test_truncated_header(tiny: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "cut.gguf").write_bytes(tiny["gemma3"].read_bytes()[:3000])
    assert "truncated or corrupt GGUF header" in _error(tmp_path / "cut.gguf")


def test_unsupported_architecture(tiny: dict[str, Path], tmp_path: Path) -> None:
    path = rewrite_gguf(tiny["llama"], tmp_path / "phi.gguf", arch="phi2")
    supported = "llama, qwen2, qwen3, gemma3, phi3, mistral, bert, nomic_bert"
    assert f"unsupported architecture 'phi2'; supported: {supported}" in _error(path)


def test_unsupported_tensor_type(tiny: dict[str, Path], tmp_path: Path) -> None:
    path = rewrite_gguf(tiny["llama"], tmp_path / "f64.gguf", retype={"blk.1.ffn_up.weight": np.float64})
    assert "tensor blk.1.ffn_up.weight has unsupported type F64" in _error(path)


@pytest.mark.parametrize(
    ("family", "edit", "expect"),
    [
        ("llama", {"drop": ["llama.block_count"]}, "missing metadata key llama.block_count"),
        ("llama", {"drop": ["blk.1.ffn_up.weight"]}, "missing tensor blk.1.ffn_up.weight"),
        ("qwen2", {"drop": ["blk.0.attn_k.bias"]}, "missing tensor blk.0.attn_k.bias"),
        ("llama", {"set_keys": {"llama.rope.dimension_count": 8}}, "partial rotary is not supported"),
        ("llama", {"set_keys": {"llama.feed_forward_length": 96}}, "ffn_gate.weight has shape (128, 64)"),
        ("llama", {"set_keys": {"llama.expert_count": 8}}, "mixture-of-experts"),
        ("llama", {"set_keys": {"llama.attention.head_count_kv": [2, 2]}}, "per-layer"),
        (
            "llama",
            {"set_keys": {"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0}},
            "rope scaling longrope without rope_factors_short/long tensors",
        ),
        (
            "llama",
            {"set_keys": {"llama.rope.scaling.type": "dynamic", "llama.rope.scaling.factor": 2.0}},
            "rope scaling 'dynamic' is not supported (supported: linear, yarn, llama3, longrope)",
        ),
        (
            "gemma3",
            {"set_keys": {"gemma3.rope.scaling.type": "yarn", "gemma3.rope.scaling.factor": 2.0}},
            "gemma3: rope scaling 'yarn' is not supported",
        ),
        ("llama", {"set_keys": {"llama.rope.dimension_count": 8}}, "partial rotary is not supported"),
        ("gemma3", {"set_keys": {"gemma3.final_logit_softcapping": 30.0}}, "final_logit_softcapping"),
        ("qwen2", {"set_keys": {"tokenizer.ggml.pre": "mystery"}}, "tokenizer.ggml.pre 'mystery'"),
        ("qwen2", {"drop": ["tokenizer.ggml.tokens"]}, "no tokenizer.ggml.tokens"),
        ("gemma3", {"set_keys": {"tokenizer.ggml.model": "t5"}}, "unsupported tokenizer.ggml.model 't5'"),
    ],
)
def test_unusable_checkpoints(
    tiny: dict[str, Path], tmp_path: Path, family: str, edit: dict, expect: str
) -> None:
    assert expect in _error(rewrite_gguf(tiny[family], tmp_path / "bad.gguf", **edit))


def _ckpt_with(tiny: dict[str, Path], tmp_path: Path, family: str, **edit: object) -> Checkpoint:
    return load_gguf(rewrite_gguf(tiny[family], tmp_path / "edit.gguf", **edit))  # type: ignore[arg-type]


def _spec_with(tiny: dict[str, Path], tmp_path: Path, family: str, **edit: object) -> ModelSpec:
    return _ckpt_with(tiny, tmp_path, family, **edit).spec


def test_gemma3_sliding_metadata(tiny: dict[str, Path], tmp_path: Path) -> None:
    spec = _spec_with(tiny, tmp_path, "gemma3", set_keys={"gemma3.attention.sliding_window_pattern": 3})
    assert spec.sliding_layers == (True, True, False, True, True, False)
    flags = [False, True, False, True, False, True]
    spec = _spec_with(
        tiny,
        tmp_path,
        "gemma3",
        set_keys={
            "gemma3.attention.sliding_window_pattern": flags,
            "gemma3.rope.freq_base_swa": 5000.0,
        },
    )
    assert spec.sliding_layers == tuple(flags) and spec.rope_local_theta == 5000.0
    spec = _spec_with(tiny, tmp_path, "gemma3", drop=["gemma3.attention.sliding_window"])
    assert (spec.sliding_window, spec.sliding_layers, spec.rope_local_theta) == (0, (), 0.0)


def test_rope_scaling(tiny: dict[str, Path], tmp_path: Path) -> None:
    spec = _spec_with(
        tiny,
        tmp_path,
        "llama",
        set_keys={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
    )
    assert spec.rope_scaling == RopeScaling(kind="linear", factor=4.0)
    # YaRN on any family but gemma3 (whose two RoPE bases it does not cover); its own keys past
    # transformers' rope_scaling are refused, never silently run as another model.
    yarn = {
        "qwen2.rope.scaling.type": "yarn",
        "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 64,
    }
    spec = _spec_with(tiny, tmp_path, "qwen2", set_keys=yarn)
    assert (spec.rope_scaling.kind, spec.rope_scaling.original_context) == ("yarn", 64)
    for key, fragment in (("yarn_ext_factor", "yarn_ext_factor"), ("yarn_log_multiplier", "mscale_all_dim")):
        with pytest.raises(SourceError, match=fragment):
            _spec_with(tiny, tmp_path, "qwen2", set_keys={**yarn, f"qwen2.rope.scaling.{key}": 0.5})
    spec = _spec_with(tiny, tmp_path, "llama", set_keys={"llama.rope.scale_linear": 2.0})
    assert spec.rope_scaling == RopeScaling(kind="linear", factor=2.0)


def test_token_defaults_follow_llama_cpp(tiny: dict[str, Path], tmp_path: Path) -> None:
    # Without add_bos_token, SentencePiece vocabularies add BOS and the smollm/qwen2 BPE ones do not.
    assert _ckpt_with(tiny, tmp_path, "gemma3", drop=["tokenizer.ggml.add_bos_token"]).tokens.add_bos
    assert not _ckpt_with(tiny, tmp_path, "llama", drop=["tokenizer.ggml.add_bos_token"]).tokens.add_bos
    ids = _ids("gemma3")
    eot = {"tokenizer.ggml.eot_token_id": ids["<start_of_turn>"]}
    tokens = _ckpt_with(tiny, tmp_path, "gemma3", set_keys=eot).tokens
    # An explicit EOT joins the stop set; <end_of_turn> still stops by its text.
    assert tokens.stop_ids == (ids["<eos>"], ids["<start_of_turn>"], ids["<end_of_turn>"])


def test_chat_template_default_is_only_a_fallback(tiny: dict[str, Path], tmp_path: Path) -> None:
    ckpt = load_gguf(
        rewrite_gguf(
            tiny["gemma3"], tmp_path / "t.gguf", set_keys={"tokenizer.chat_template": "{{ messages }}"}
        )
    )
    assert (ckpt.chat_template, ckpt.chat_template_origin) == ("{{ messages }}", "checkpoint")
    ckpt = load_gguf(rewrite_gguf(tiny["qwen2"], tmp_path / "t.gguf", drop=["tokenizer.chat_template"]))
    assert ckpt.chat_template_origin.startswith("family default") and "<|im_start|>" in ckpt.chat_template
