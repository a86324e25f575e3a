"""The Hugging Face source for encoders: a sentence-transformers folder -> Checkpoint.

A BERT-like checkpoint (config.json's model_type `bert`: all-MiniLM-L6-v2, bge-small, e5-small;
`nomic_bert`: nomic-embed-text, CodeRankEmbed) with its tokenizer.json, safetensors, and
sentence-transformers' files: modules.json and <pooling>/config.json say how token states become
one vector (mean, CLS or last token; no Pooling module: mean, as sentence-transformers loads a
plain model), config_sentence_transformers.json the task prompts ("query": "search_query: ").

Tensor names become GGUF's (llama.cpp's BERT and nomic-bert names), as for the decoders, so the
model files read one naming. The tokenizer keeps its post-processor: an encoder's input is
[CLS] text [SEP], exactly as the tokenizer makes it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from goinfer.artifacts.manifest import Embedding, ModelSpec, Tokens
from tokenizers import Tokenizer

from . import hf_dir
from .base import Checkpoint, SourceError
from .hf_config import ENCODER_TYPES

MODEL_TYPES = ENCODER_TYPES  # config.json model_type -> our family (compiler/models/<family>.py)

# HF module names -> GGUF's, globally and inside a layer ("blk.N.").
_BERT_GLOBAL = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
}
_BERT_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias|gamma|beta)$")
_BERT_LAYER_NAMES = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_NOMIC_GLOBAL = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "emb_ln": "token_embd_norm",
}
_NOMIC_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_NOMIC_LAYER_NAMES = {
    "attn.Wqkv": "attn_qkv",
    "attn.out_proj": "attn_output",
    "mlp.fc11": "ffn_up",  # nomic's SwiGLU: fc11(x) * silu(fc12(x))
    "mlp.fc12": "ffn_gate",
    "mlp.fc2": "ffn_down",
    "norm1": "attn_output_norm",
    "norm2": "layer_output_norm",
}
# Tensors an encoder checkpoint may carry that the embedding does not use.
_UNUSED = re.compile(r"^(pooler\.|cls\.|lm_head\.|embeddings\.position_ids$)")
_POOLING_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}


def is_encoder(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") in MODEL_TYPES


def load(path: Path) -> Checkpoint:
    """Read an encoder checkpoint folder; a SourceError says what we cannot use, in one line."""
    read: list[Path] = []
    config = hf_dir._json(path / "config.json", read)
    family = MODEL_TYPES[config["model_type"]]
    tokenizer_json = _tokenizer(path, read)
    entries = _entries(path, read, family)
    spec = _spec(family, config, entries)
    _check_shapes(spec, entries, family)
    tensors = {name: hf_dir._source_tensor(name, e, family) for name, e in entries.items()}
    embedding = Embedding(
        pooling=_pooling(path, read),
        dimensions=spec.hidden_size,
        max_tokens=spec.context_length,
        prompts=_prompts(path, read),
    )
    return Checkpoint(
        spec=spec,
        tokens=Tokens(bos_id=None, add_bos=False, stop_ids=()),  # the tokenizer adds [CLS] .. [SEP]
        tokenizer_json=tokenizer_json,
        chat_template="",
        chat_template_origin="none: an encoder",
        tensors=tensors,
        source=str(path),
        sha256=hf_dir._digest(path, read),  # every file read, the pooling and prompts' included
        embedding=embedding,
    )


# ------------------------------------------------------------------------------------ config.json


def _spec(family: str, config: Mapping[str, Any], entries: Mapping[str, Any]) -> ModelSpec:
    def num(key: str, kind: type = int) -> Any:
        v = config.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            raise SourceError(
                f"config.json: {key} should be {'an integer' if kind is int else 'a number'}, not {v!r}"
            )
        if v <= 0:
            raise SourceError(f"config.json: {key} is {v}, not positive")
        return kind(v)

    if family == "bert":
        hidden, heads = num("hidden_size"), num("num_attention_heads")
        act = config.get("hidden_act")
        if act != "gelu":
            raise SourceError(f"config.json: hidden_act {act!r} is not supported for bert (supported: gelu)")
        if (pos := config.get("position_embedding_type", "absolute")) != "absolute":
            raise SourceError(
                f"config.json: position_embedding_type {pos!r} is not supported (absolute only)"
            )
        fields = dict(
            intermediate_size=num("intermediate_size"), num_layers=num("num_hidden_layers"),
            context_length=num("max_position_embeddings"), norm_eps=num("layer_norm_eps", float),
            rope_theta=0.0, activation="gelu", attention_bias=True, learned_positions=True,
        )  # fmt: skip
    else:
        hidden, heads = num("n_embd"), num("n_head")
        act = config.get("activation_function")
        if act != "swiglu":
            raise SourceError(f"config.json: activation_function {act!r} is not supported (swiglu only)")
        for key in ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias", "prenorm", "rotary_emb_interleaved"):
            if config.get(key):
                raise SourceError(f"config.json: nomic_bert with {key} true is not supported")
        if config.get("rotary_emb_fraction", 1.0) != 1.0:
            raise SourceError("config.json: rotary_emb_fraction other than 1.0 is not supported")
        if config.get("use_rms_norm"):
            raise SourceError("config.json: nomic_bert with use_rms_norm is not supported")
        fields = dict(
            intermediate_size=num("n_inner"), num_layers=num("n_layer"),
            context_length=num("n_positions"), norm_eps=num("layer_norm_epsilon", float),
            rope_theta=num("rotary_emb_base", float), activation="silu", attention_bias=False,
        )  # fmt: skip
    if hidden % heads:
        raise SourceError(f"config.json: hidden size {hidden} is not a multiple of {heads} heads")
    if "token_embd.weight" not in entries:
        raise SourceError(f"missing tensor embeddings.word_embeddings.weight ({family})")
    vocab = entries["token_embd.weight"].shape[0]
    if (stated := config.get("vocab_size")) is not None and stated != vocab:
        raise SourceError(f"config.json: vocab_size is {stated}, but the word embeddings have {vocab} rows")
    return ModelSpec(family=family, vocab_size=vocab, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=heads, head_dim=hidden // heads, **fields)  # fmt: skip


# ----------------------------------------------------------------------------------------- tensors


def _gguf_name(hf_name: str, family: str) -> str | None:
    """The GGUF name of an HF tensor; None for one the embedding does not use; an unknown tensor
    keeps its HF name, which _check_shapes then refuses."""
    if family == "bert" and hf_name.startswith("bert."):  # BertForX checkpoints nest the model
        hf_name = hf_name[len("bert.") :]
    if _UNUSED.match(hf_name):
        return None
    glob, layer, names = (
        (_BERT_GLOBAL, _BERT_LAYER, _BERT_LAYER_NAMES) if family == "bert"
        else (_NOMIC_GLOBAL, _NOMIC_LAYER, _NOMIC_LAYER_NAMES)
    )  # fmt: skip
    suffix = {"gamma": "weight", "beta": "bias"}  # old BERT LayerNorms
    if m := layer.match(hf_name):
        module = names.get(m[2])
        return f"blk.{m[1]}.{module}.{suffix.get(m[3], m[3])}" if module else hf_name
    stem, _, last = hf_name.rpartition(".")
    return f"{glob[stem]}.{suffix.get(last, last)}" if stem in glob else hf_name


def _entries(path: Path, read: list[Path], family: str) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for file in hf_dir._weight_files(path, read):
        for e in hf_dir._read_header(file):
            name = _gguf_name(e.hf_name, family)
            if name is None:
                continue
            if name in entries:
                raise SourceError(f"tensor {e.hf_name} appears twice")
            if e.dtype not in hf_dir._BITS:
                raise SourceError(
                    f"{file.name}: tensor {e.hf_name} has unsupported dtype {e.dtype}; "
                    f"supported: {', '.join(hf_dir._BITS)}"
                )
            entries[name] = e
    return entries


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a family's encoder reads, by GGUF name, with its shape (numpy order)."""
    d, f = spec.hidden_size, spec.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (spec.vocab_size, d),
        "token_types.weight": (-1, d),  # any number of types: the embedding adds type 0's row
        "token_embd_norm.weight": (d,),
        "token_embd_norm.bias": (d,),
    }
    if spec.learned_positions:
        out["position_embd.weight"] = (spec.context_length, d)
    for i in range(spec.num_layers):
        blk = f"blk.{i}"
        for norm in ("attn_output_norm", "layer_output_norm"):
            out[f"{blk}.{norm}.weight"] = out[f"{blk}.{norm}.bias"] = (d,)
        out[f"{blk}.attn_output.weight"] = (d, d)
        out[f"{blk}.ffn_up.weight"] = (f, d)
        out[f"{blk}.ffn_down.weight"] = (d, f)
        if spec.family == "bert":
            for n in ("attn_q", "attn_k", "attn_v"):
                out[f"{blk}.{n}.weight"], out[f"{blk}.{n}.bias"] = (d, d), (d,)
            for n, width in (("attn_output", d), ("ffn_up", f), ("ffn_down", d)):
                out[f"{blk}.{n}.bias"] = (width,)
        else:
            out[f"{blk}.attn_qkv.weight"] = (3 * d, d)
            out[f"{blk}.ffn_gate.weight"] = (f, d)
    return out


def _check_shapes(spec: ModelSpec, entries: Mapping[str, Any], family: str) -> None:
    want = expected_shapes(spec)
    if extra := sorted(set(entries) - set(want)):
        raise SourceError(f"unexpected tensor {entries[extra[0]].hf_name} for {family}")
    if missing := [n for n in want if n not in entries]:
        raise SourceError(f"missing tensor {missing[0]} (GGUF name) for {family}")
    for name, shape in want.items():
        got = entries[name].shape
        if len(got) != len(shape) or any(w not in (-1, g) for w, g in zip(shape, got, strict=True)):
            raise SourceError(f"tensor {entries[name].hf_name} has shape {list(got)}, expected {list(shape)}")
    if entries["token_types.weight"].shape[0] < 1:
        raise SourceError("tensor embeddings.token_type_embeddings.weight has no rows")


# ----------------------------------------------------------------------------- tokenizer, pooling


def _tokenizer(path: Path, read: list[Path]) -> str:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise SourceError("no tokenizer.json (only fast-tokenizer checkpoints are supported)")
    tok_json = hf_dir._json(file, read)
    if not tok_json.get("post_processor"):
        raise SourceError("tokenizer.json has no post_processor: the [CLS] ... [SEP] an encoder reads")
    # Kept: the post-processor. Dropped: truncation and padding (the runtime packs inputs whole,
    # and refuses or cuts a long one itself).
    tok_json["truncation"] = tok_json["padding"] = None
    text = json.dumps(tok_json, ensure_ascii=False)
    try:
        Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises plain Exceptions for a malformed file
        raise SourceError(f"tokenizer.json: cannot load: {e}") from None
    return text


def _pooling(path: Path, read: list[Path]) -> str:
    """The Pooling module's mode (modules.json names its folder); mean where there is none."""
    modules = path / "modules.json"
    if not modules.is_file():
        return "mean"
    try:
        listed = json.loads(hf_dir._text(modules, read))
    except json.JSONDecodeError as e:
        raise SourceError(f"modules.json: not JSON: {e}") from None
    if not isinstance(listed, list):
        raise SourceError("modules.json: not a list of modules")
    pooling = [m for m in listed if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")]
    if not pooling:
        return "mean"
    folder = str(pooling[0].get("path", ""))
    if "/" in folder.strip("/") or folder.startswith("."):
        raise SourceError(f"modules.json: Pooling path {folder!r} is not a folder beside it")
    config = hf_dir._json(path / folder / "config.json", read)
    modes = [mode for key, mode in _POOLING_KEYS.items() if config.get(key)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _POOLING_KEYS]
    if others or len(modes) != 1:
        given = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
        raise SourceError(
            f"{folder}/config.json: pooling {', '.join(given) or 'none'} is not supported "
            "(one of pooling_mode_mean_tokens, pooling_mode_cls_token, pooling_mode_lasttoken)"
        )
    return modes[0]


def _prompts(path: Path, read: list[Path]) -> dict[str, str]:
    file = path / "config_sentence_transformers.json"
    if not file.is_file():
        return {}
    prompts = hf_dir._json(file, read).get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise SourceError("config_sentence_transformers.json: prompts should map names to strings")
    return {str(k): v for k, v in prompts.items()}
