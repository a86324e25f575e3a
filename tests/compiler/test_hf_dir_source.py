"""The Hugging Face directory source on tiny checkpoints: the same model as its GGUF twin (spec,
tensors, tokens, tokenizer, and end to end the logits), half-precision and sharded weights, config
variants, and every error path."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from goinfer.artifacts.manifest import RopeScaling
from goinfer.compiler.sources.base import Checkpoint, SourceError
from goinfer.compiler.sources.gguf_file import load_gguf
from goinfer.compiler.sources.hf_config import family_of
from goinfer.compiler.sources.hf_dir import load_dir
from safetensors.numpy import save_file
from tiny_gguf import tiny_vocab, tiny_weights
from tiny_hf import DTYPES, hf_name, hf_weights, write_tiny_hf_dir, write_weights
from tokenizers import Tokenizer, processors

FAMILIES = ("llama", "qwen2", "gemma3")
TEXT = (
    "The quick brown fox, 12345 symbols #$% and  spaces\n\nnew lines, héllo 🙂 "
    "<|im_start|>user\nHi<|im_end|> <start_of_turn>model\nOk<end_of_turn>"
)


@pytest.fixture
def hf_dir(tmp_path: Path) -> Callable[..., Path]:
    def make(family: str, dtype: str = "F32", shards: int = 1) -> Path:
        return write_tiny_hf_dir(tmp_path / f"{family}-{dtype}-{shards}", family, dtype, shards)

    return make


def _edit_json(file: Path, **changes: object) -> None:
    value = json.loads(file.read_text())
    for key, v in changes.items():
        if v is None:
            value.pop(key, None)
        else:
            value[key] = v
    file.write_text(json.dumps(value))


def _rewrite_weights(d: Path, family: str, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    weights = hf_weights(family)
    edit(weights)
    write_weights(d, weights, "F32")


def _encode(ckpt: Checkpoint, text: str) -> list[int]:
    # as the runtime encodes (Model.encode): special tokens matched, no post-processing
    return Tokenizer.from_str(ckpt.tokenizer_json).encode(text, add_special_tokens=False).ids


# --------------------------------------------------------------------------------- same as GGUF


@pytest.mark.parametrize("family", FAMILIES)
def test_same_model_as_gguf(family: str, tiny_gguf, hf_dir) -> None:
    gguf, hf = load_gguf(tiny_gguf(family)), load_dir(hf_dir(family))
    assert hf.spec == gguf.spec
    assert hf.tokens == gguf.tokens
    assert sorted(hf.tensors) == sorted(gguf.tensors)
    for name, t in hf.tensors.items():
        assert np.array_equal(t.load(), gguf.tensors[name].load()), name
        assert (t.source_type, t.bits, t.raw, t.shape) == ("F32", 32, None, gguf.tensors[name].shape)
    assert _encode(hf, TEXT) == _encode(gguf, TEXT)
    assert hf.chat_template == gguf.chat_template
    assert json.loads(hf.tokenizer_json)["post_processor"] is None  # the runtime decides about BOS
    assert hf.source == str(hf_dir(family)) and len(hf.sha256) == 64


def test_tokens_per_family(hf_dir) -> None:
    ids = {f: {t: i for i, t in enumerate(tiny_vocab(f)[0])} for f in FAMILIES}
    llama, qwen, gemma = (load_dir(hf_dir(f)).tokens for f in FAMILIES)
    # SmolLM2: <|im_start|> is BOS but not added; Qwen2: no BOS added; Gemma: <bos> added.
    assert (llama.bos_id, llama.add_bos) == (ids["llama"]["<|im_start|>"], False)
    assert llama.stop_ids == (ids["llama"]["<|im_end|>"], ids["llama"]["<|endoftext|>"])
    assert (qwen.bos_id, qwen.add_bos) == (ids["qwen2"]["<|endoftext|>"], False)
    assert qwen.stop_ids == (ids["qwen2"]["<|im_end|>"], ids["qwen2"]["<|endoftext|>"])
    assert (gemma.bos_id, gemma.add_bos) == (ids["gemma3"]["<bos>"], True)
    assert gemma.stop_ids == (ids["gemma3"]["<eos>"], ids["gemma3"]["<end_of_turn>"])


def test_chat_template_origin(hf_dir) -> None:
    assert load_dir(hf_dir("qwen2")).chat_template_origin == "checkpoint"
    assert load_dir(hf_dir("gemma3")).chat_template_origin.startswith("family default:")


# ---------------------------------------------------------------------------- dtypes and shards


@pytest.mark.parametrize(("family", "dtype"), [("qwen2", "BF16"), ("gemma3", "BF16"), ("llama", "F16")])
def test_half_precision_weights(family: str, dtype: str, hf_dir) -> None:
    ckpt = load_dir(hf_dir(family, dtype))
    for name, w in tiny_weights(family).items():
        t = ckpt.tensors[name]
        if family == "gemma3" and name.endswith("_norm.weight"):  # stored as w - 1, rounded there
            want = (w - np.float32(1)).astype(DTYPES[dtype]).astype(np.float32) + np.float32(1)
        else:
            want = w.astype(DTYPES[dtype]).astype(np.float32)
        got = t.load()
        assert got.dtype == np.float32 and np.array_equal(got, want), name
        assert (t.source_type, t.bits) == (dtype, 16)


def test_sharded_directory(hf_dir) -> None:
    d = hf_dir("qwen2", shards=3)
    assert len(list(d.glob("model-*-of-00003.safetensors"))) == 3
    ckpt = load_dir(d)
    weights = tiny_weights("qwen2")
    assert sorted(ckpt.tensors) == sorted(weights)
    for name, w in weights.items():
        assert np.array_equal(ckpt.tensors[name].load(), w), name


def test_digest_follows_the_files(hf_dir, tmp_path: Path) -> None:
    a = load_dir(hf_dir("llama")).sha256
    assert load_dir(write_tiny_hf_dir(tmp_path / "again", "llama")).sha256 == a
    assert load_dir(write_tiny_hf_dir(tmp_path / "other", "llama", seed=1)).sha256 != a


# --------------------------------------------------------------------------------- config variants


def test_gemma3_multimodal_checkpoint(hf_dir) -> None:
    """gemma3 with a text_config: the text model under language_model., the vision tower ignored."""
    d = hf_dir("gemma3")
    text = json.loads((d / "config.json").read_text())
    config = {"model_type": "gemma3", "text_config": text, "eos_token_id": text["eos_token_id"]}
    (d / "config.json").write_text(json.dumps(config))
    weights = {"language_model." + n: w for n, w in hf_weights("gemma3").items()}
    weights |= {
        "vision_tower.patch.weight": np.zeros((4, 4)),
        "multi_modal_projector.w": np.ones(3, np.int64),
    }
    save_file(weights, str(d / "model.safetensors"))
    ckpt = load_dir(d)
    plain = load_dir(hf_dir("gemma3", "F32", 2))
    assert ckpt.spec == plain.spec and sorted(ckpt.tensors) == sorted(plain.tensors)
    name = "blk.0.attn_q_norm.weight"
    assert np.array_equal(ckpt.tensors[name].load(), plain.tensors[name].load())


def test_gemma3_sliding_window_pattern(hf_dir, tiny_gguf) -> None:
    d = hf_dir("gemma3")
    _edit_json(d / "config.json", layer_types=None)  # older configs: the period alone
    spec = load_dir(d).spec
    assert spec == load_gguf(tiny_gguf("gemma3")).spec
    assert spec.sliding_layers == (True,) * 5 + (False,)


def test_linear_rope_scaling(hf_dir) -> None:
    d = hf_dir("llama")
    _edit_json(d / "config.json", rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert load_dir(d).spec.rope_scaling == RopeScaling(kind="linear", factor=4.0)


def test_chat_template_forms(hf_dir) -> None:
    d = hf_dir("gemma3")
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    _edit_json(d / "tokenizer_config.json", chat_template=named)
    assert (load_dir(d).chat_template, load_dir(d).chat_template_origin) == ("plain", "checkpoint")
    (d / "chat_template.jinja").write_text("from its own file")  # newer checkpoints: it wins
    assert load_dir(d).chat_template == "from its own file"


def test_add_bos_from_post_processor(hf_dir) -> None:
    """No add_bos_token in tokenizer_config.json: BOS is added where the post-processor adds it
    (Llama 3's TemplateProcessing), and the checkpoint's tokenizer has no post-processor."""
    d = hf_dir("llama")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    bos_id = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos_id)]
    )
    tok.save(str(d / "tokenizer.json"))
    ckpt = load_dir(d)
    assert (ckpt.tokens.bos_id, ckpt.tokens.add_bos) == (bos_id, True)
    assert Tokenizer.from_str(ckpt.tokenizer_json).encode("Hi").ids[0] != bos_id


def test_tied_head_stored_anyway(hf_dir) -> None:
    d = hf_dir("llama")
    _rewrite_weights(d, "llama", lambda w: w.update({"lm_head.weight": w["model.embed_tokens.weight"]}))
    ckpt = load_dir(d)
    assert ckpt.spec.tie_embeddings and "output.weight" not in ckpt.tensors


def test_family_of() -> None:
    types = ("llama", "qwen2", "qwen3", "gemma3_text", "gemma3", "phi3", "mistral", "bert", "nomic_bert")
    assert [family_of({"model_type": t}) for t in types] == [
        "llama",
        "qwen2",
        "qwen3",
        "gemma3",
        "gemma3",
        "phi3",
        "mistral",
        "bert",
        "nomic_bert",
    ]
    with pytest.raises(SourceError, match=r"unsupported model_type 'phi'; supported: bert, gemma3, "):
        family_of({"model_type": "phi"})


# ------------------------------------------------------------------------------------- bad input


def _refused(d: Path, *fragments: str) -> str:
    with pytest.raises(SourceError) as e:
        load_dir(d)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{d}: ")
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_no_config_json(tmp_path: Path) -> None:
    assert _refused(tmp_path, "no config.json") == f"{tmp_path}: no config.json: not a checkpoint directory"


def test_unsupported_model_type_before_any_weight(hf_dir) -> None:
    d = hf_dir("llama")
    _edit_json(d / "config.json", model_type="qwen3_moe")
    (d / "model.safetensors").write_bytes(b"not read")
    _refused(
        d,
        "unsupported model_type 'qwen3_moe'",
        "supported: bert, gemma3, gemma3_text, llama, mistral, nomic_bert, phi3, qwen2, qwen3",
    )


def test_missing_shard(hf_dir) -> None:
    d = hf_dir("qwen2", shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    _refused(d, "missing shard model-00002-of-00002.safetensors")


def test_truncated_safetensors(hf_dir) -> None:
    d = hf_dir("llama")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-100])
    _refused(d, "model.safetensors: truncated or corrupt", "not fully covered")
    (d / "model.safetensors").write_bytes(data[:20])
    _refused(d, "model.safetensors: truncated or corrupt", "header length")


def test_unsupported_dtype(hf_dir) -> None:
    d = hf_dir("llama")
    weights = {n: w.astype(np.float32) for n, w in hf_weights("llama").items()}
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.float64)
    save_file(weights, str(d / "model.safetensors"))
    _refused(d, "tensor model.norm.weight has unsupported dtype F64; supported: F32, F16, BF16")


def test_missing_tensor(hf_dir) -> None:
    d = hf_dir("gemma3")
    _rewrite_weights(d, "gemma3", lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    _refused(d, "missing tensor model.layers.1.mlp.up_proj.weight")


def test_untied_head_missing(hf_dir) -> None:
    d = hf_dir("qwen2")
    _rewrite_weights(d, "qwen2", lambda w: w.pop("lm_head.weight"))
    _refused(d, "missing tensor lm_head.weight")


def test_unexpected_tensor(hf_dir) -> None:
    d = hf_dir("llama")
    extra = {"model.layers.0.mlp.extra.weight": np.zeros((2, 2), np.float32)}
    _rewrite_weights(d, "llama", lambda w: w.update(extra))
    _refused(d, "unexpected tensor model.layers.0.mlp.extra.weight (not supported)")


def test_missing_bias(hf_dir) -> None:
    d = hf_dir("qwen2")
    _rewrite_weights(d, "qwen2", lambda w: [w.pop(n) for n in list(w) if n.endswith("_proj.bias")])
    _refused(d, "model.layers.0.self_attn.q_proj.bias: the checkpoint lacks it")


def test_no_tokenizer_json(hf_dir) -> None:
    d = hf_dir("qwen2")
    (d / "tokenizer.json").unlink()
    _refused(d, "no tokenizer.json")


def test_no_weights(hf_dir) -> None:
    d = hf_dir("qwen2")
    (d / "model.safetensors").unlink()
    _refused(d, "no model.safetensors or model.safetensors.index.json")


@pytest.mark.parametrize(
    ("family", "changes", "fragment"),
    [
        (
            "llama",
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "config.json: rope_scaling llama3 needs low_freq_factor",
        ),
        (
            "llama",
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope scaling 'dynamic' is not supported (supported: linear, yarn, llama3, longrope)",
        ),
        (
            "llama",
            {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": False}},
            "rope_scaling yarn with truncate false is not supported",
        ),
        ("qwen3", {"use_sliding_window": True}, "qwen3 with use_sliding_window is not supported"),
        ("mistral", {"sliding_window": "wide"}, "sliding_window should be an integer or null"),
        ("phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, "needs long_factor"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported for llama"),
        ("llama", {"hidden_size": None}, "config.json: missing hidden_size"),
        ("qwen2", {"num_hidden_layers": 2.5}, "config.json: num_hidden_layers should be an integer"),
        ("qwen2", {"vocab_size": 7}, "config.json: vocab_size is 7"),
    ],
)
def test_refused_configs(family: str, changes: dict, fragment: str, hf_dir) -> None:
    d = hf_dir(family)
    _edit_json(d / "config.json", **changes)
    _refused(d, fragment)


def test_hf_names_round_trip() -> None:
    """tiny_hf's names are the ones the loader maps back (every tensor of every family)."""
    for family in FAMILIES:
        names = {hf_name(n, family) for n in tiny_weights(family)}
        assert len(names) == len(tiny_weights(family))


# ------------------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_same_logits_as_gguf(family: str, tiny_bundle, hf_dir, tmp_path: Path) -> None:
    """Built with quant f32 (through load_checkpoint's dispatch), the HF directory and the GGUF give
    identical logits: same graph, same weights."""
    from goinfer.compiler.build import BuildOptions, build
    from goinfer.runtime.model import Model

    gguf_bundle = tiny_bundle(family, "f32")  # its KV cache is float32, as here
    hf_bundle = tmp_path / f"{family}-hf.giw"
    build(
        hf_dir(family), hf_bundle, BuildOptions(quant="f32", num_cores=2, kv_dtype="float32"), progress=print
    )

    def logits(bundle: Path) -> np.ndarray:
        m = Model.load(bundle)
        ids = m.encode("The quick brown fox jumps over the lazy dog.")
        rows = list(m.prefill_logits(ids))
        rows += [m.decode_step(t)[None] for t in ids[:4]]
        return np.concatenate(rows, axis=0)

    got, want = logits(hf_bundle), logits(gguf_bundle)
    assert got.shape == want.shape and np.array_equal(got, want)
