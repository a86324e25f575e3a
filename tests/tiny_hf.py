"""The tiny models of tiny_gguf, written as Hugging Face checkpoint directories.

``write_tiny_hf_dir(path, family)`` writes what ``save_pretrained`` would for the same weights and
vocabulary as ``write_tiny_gguf(..., family)``: config.json, generation_config.json, tokenizer.json,
tokenizer_config.json and safetensors (one file, or shards with an index). It is built from
tiny_gguf's data, not through the compiler's GGUF source, so that loading both and comparing checks
the HF source against the GGUF one:

* tensor names are HF's; Q/K rows half-split (as HF stores them, unlike GGUF's llama);
* Gemma 3 norms are stored as w, where GGUF stores 1 + w;
* tokenizer.json is laid out as the real families' are (SmolLM2's digit split + byte level, Qwen2's
  split regex, Gemma's SentencePiece BPE with byte fallback), post-processor included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tiny_gguf import (
    CHATML,
    CONTEXT,
    FFN,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    MODEL_TYPE,
    MODELS,
    ORIGINAL_CONTEXT,
    PARTIAL_ROTARY,
    RMS_EPS,
    ROLE_TOKENS,
    ROPE_SCALING,
    ROPE_THETA,
    SLIDING_WINDOW,
    TINY,
    WINDOWS,
    tiny_template,
    tiny_vocab,
    tiny_weights,
)
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral Nemo's (tekken) and Phi-4-mini's (o200k) splits, as their tokenizer.json files write them.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF module names inside blk.N -> HF's inside model.layers.N.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_QWEN3_LAYER_NAMES = {**_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_FAMILY_LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES, "qwen3": _QWEN3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def write_tiny_hf_dir(
    path: str | Path,
    family: str,
    dtype: str = "F32",
    shards: int = 1,
    *,
    seed: int = 0,
    chat_template: str | None = None,
    extra_tokens: tuple[str, ...] = (),
) -> Path:
    """Write the tiny ``family`` model (tiny_gguf's, seed ``seed``; one of tiny_gguf.MODELS) into the
    directory ``path``, every tensor stored as ``dtype`` ("F32", "F16", "BF16"), in ``shards``
    safetensors files. ``chat_template`` and ``extra_tokens`` as write_tiny_gguf's."""
    if family not in MODELS:
        raise ValueError(f"unknown family {family!r}; one of {MODELS}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = {t: i for i, t in enumerate(tiny_vocab(family, extra_tokens)[0])}
    template = chat_template if chat_template is not None else tiny_template(family)
    _write_json(path / "config.json", _config(family, ids, dtype))
    _write_json(path / "generation_config.json", _generation_config(family, ids))
    _write_json(path / "tokenizer_config.json", _tokenizer_config(family, template))
    (path / "tokenizer.json").write_text(_tokenizer(family, extra_tokens).to_str(), encoding="utf-8")
    write_weights(path, hf_weights(family, seed=seed, extra_tokens=extra_tokens), dtype, shards)
    return path


def hf_weights(family: str, *, seed: int = 0, extra_tokens: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """tiny_weights under HF names, as HF stores them (float32 here; Gemma 3 norms as w)."""
    out = {}
    for name, w in tiny_weights(family, seed=seed, extra_tokens=extra_tokens).items():
        if family == "gemma3" and name.endswith("_norm.weight"):
            w = w - np.float32(1.0)
        out[hf_name(name, family)] = w
    return out


def hf_name(gguf_name: str, family: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] != "blk":
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    names = _FAMILY_LAYER_NAMES.get(family, _LAYER_NAMES)
    return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"


def write_weights(path: Path, weights: dict[str, np.ndarray], dtype: str, shards: int = 1) -> None:
    """``weights`` as ``dtype`` in model.safetensors, or split over ``shards`` files with an index."""
    stored = {name: np.ascontiguousarray(w.astype(DTYPES[dtype])) for name, w in weights.items()}
    if shards == 1:
        save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(stored)
    weight_map = {}
    for i, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[j]: stored[names[j]] for j in part}, str(path / file), metadata={"format": "pt"})
        weight_map |= {names[j]: file for j in part}
    total = sum(w.nbytes for w in stored.values())
    _write_json(
        path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}
    )


def _write_json(file: Path, value: Any) -> None:
    file.write_text(json.dumps(value, indent=2, ensure_ascii=False), encoding="utf-8")


def _config(family: str, ids: dict[str, int], dtype: str) -> dict[str, Any]:
    common = {
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS[family],
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": TINY.of(family).head_dim,
        "max_position_embeddings": CONTEXT,
        "rope_theta": ROPE_THETA[family],
        "rope_scaling": ROPE_SCALING.get(family),
        "vocab_size": len(ids),
        "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype],
    }
    if family in ROLE_TOKENS:
        return _new_config(family, ids, common)
    if family in ("llama", "yarn"):  # SmolLM2's
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **common,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": True,
            "bos_token_id": ids["<|im_start|>"],
            "eos_token_id": ids["<|im_end|>"],
        }
    if family == "qwen2":  # Qwen2.5-Instruct's
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            **common,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": CONTEXT,
            "max_window_layers": LAYERS[family],
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
        }
    layers = LAYERS[family]
    return {  # Gemma 3 1B's layout
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **common,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": TINY.head_dim,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 6,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "pad_token_id": ids["<pad>"],
    }


def _new_config(family: str, ids: dict[str, int], common: dict[str, Any]) -> dict[str, Any]:
    """The newer families' configs, as their real checkpoints lay them out."""
    bos, eos, _unk, _add_bos = ROLE_TOKENS[family]
    config = {
        "architectures": [{"qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM",
                           "phi3": "Phi3ForCausalLM", "mistral": "MistralForCausalLM"}[family]],
        "model_type": MODEL_TYPE.get(family, family),
        **common,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_EPS.get(family, 1e-6),
        "tie_word_embeddings": family in ("qwen3", "llama3"),
        "bos_token_id": ids[bos] if bos else None,
        "eos_token_id": ids[eos],
    }  # fmt: skip
    if family == "qwen3":  # Qwen3-0.6B's
        config |= {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                   "max_window_layers": LAYERS[family]}  # fmt: skip
    if family == "llama3":  # Llama 3.2's: every end token stops
        ends = [ids[t] for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
        config |= {"attention_bias": False, "mlp_bias": False, "eos_token_id": ends}
    if family == "phi3":  # Phi-4-mini's
        config |= {"partial_rotary_factor": PARTIAL_ROTARY[family], "sliding_window": WINDOWS[family],
                   "original_max_position_embeddings": ORIGINAL_CONTEXT, "pad_token_id": ids[eos],
                   "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}  # fmt: skip
    if family == "mistral":
        config |= {"sliding_window": WINDOWS[family]}
    return config


def _generation_config(family: str, ids: dict[str, int]) -> dict[str, Any]:
    if family in ROLE_TOKENS:
        bos, eos, _unk, _add_bos = ROLE_TOKENS[family]
        return {"bos_token_id": ids[bos] if bos else None, "eos_token_id": ids[eos]}
    if family in ("llama", "yarn"):
        return {"bos_token_id": ids["<|im_start|>"], "eos_token_id": ids["<|im_end|>"]}
    if family == "qwen2":
        return {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        }
    return {"bos_token_id": ids["<bos>"], "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]]}


def _tokenizer_config(family: str, template: str | None = CHATML) -> dict[str, Any]:
    if family in ROLE_TOKENS:
        bos, eos, unk, _add_bos = ROLE_TOKENS[family]
        out = {"bos_token": bos, "eos_token": eos, "chat_template": template}
        return out | ({"unk_token": unk} if unk else {})
    if family in ("llama", "yarn"):
        return {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template}
    if family == "qwen2":  # no BOS token: the post-processor adds none either
        return {
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": template,
        }
    return {  # no chat template, as the tiny GGUF has none
        "bos_token": {"content": "<bos>", "__type": "AddedToken"},
        "eos_token": "<eos>",
        "add_bos_token": True,
        "add_eos_token": False,
    }


def _tokenizer(family: str, extra_tokens: tuple[str, ...] = ()) -> Tokenizer:
    tokens, types, extra = tiny_vocab(family, extra_tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if family == "gemma3":
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=_spm_merges(tokens, extra), unk_token="<unk>", byte_fallback=True)
        )
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
        )
    else:
        merges = [tuple(m.split(" ")) for m in extra]
        # Llama 3's and tekken's tokenizer.json skip the merges for a word that is a token (llama.cpp's
        # ignore_merges)
        ignore = family in ("llama3", "mistral")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore))
        if family in ("llama", "yarn"):  # SmolLM2: every digit alone, then GPT-2's byte-level split
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False),
                ]
            )
        else:
            splits = {"llama3": _LLAMA3_SPLIT, "mistral": _TEKKEN_SPLIT, "phi3": _O200K_SPLIT}
            split = splits.get(family, _QWEN2_SPLIT)
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        bos, _eos, _unk, add_bos = ROLE_TOKENS.get(family, (None, "", None, False))
        if add_bos:  # Llama 3's and Mistral's post-processors put BOS first
            tok.post_processor = processors.Sequence(
                [
                    processors.ByteLevel(trim_offsets=False),
                    processors.TemplateProcessing(
                        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
                    ),
                ]
            )
    control, user = 3, 4  # llama_token_type values in tiny_vocab
    kinds = dict(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in tokens if kinds[t] == control]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens if kinds[t] == user])
    return tok


def _spm_merges(tokens: tuple[str, ...], scores: tuple[Any, ...]) -> list[tuple[str, str]]:
    """Merges for a SentencePiece BPE vocabulary, as transformers' converter makes them: every split
    of a piece into two pieces, the best-scoring piece's first."""
    index = {t: i for i, t in enumerate(tokens)}
    ranked = sorted(
        (-scores[i], i, k)
        for i, piece in enumerate(tokens)
        for k in range(1, len(piece))
        if piece[:k] in index and piece[k:] in index
    )
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]
