"""A Hugging Face ``config.json`` -> which of our families it is, and its hyperparameters.

The family is decided from ``model_type`` alone, before any weight is read: a pull can refuse an
unsupported checkpoint having fetched only this small file.

The hyperparameters are translated into the GGUF metadata keys ``convert_hf_to_gguf`` would write,
so that ``gguf_spec.build_spec`` applies one set of rules (defaults, refusals, gemma3's layer
pattern) to both sources. Floats are rounded to float32 as GGUF stores them: the same checkpoint
then gives the same ModelSpec whichever way it arrives (the kernels compute in float32 anyway).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import SourceError

# config.json model_type -> our family (compiler/models registry key).
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3"}
# The encoders' (read by hf_encoder.py, not by read_config).
ENCODER_TYPES = {"bert": "bert", "nomic_bert": "nomic_bert"}

# The transformers config classes' defaults for keys a config.json may leave out. Gemma 3's
# multimodal checkpoints rely on them: their text_config holds little beyond the sizes.
# fmt: off
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
    },
    "qwen2": {
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False,
    },
    "gemma3": {
        "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attention_bias": False,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
    },
}
# fmt: on
_ACTIVATIONS = {"llama": "silu", "qwen2": "silu", "gemma3": "gelu_pytorch_tanh"}


@dataclass(frozen=True)
class TextConfig:
    """What a config.json says about its text model, in the terms our sources use."""

    family: str
    metadata: dict[str, Any]  # GGUF metadata keys, for gguf_spec.build_spec
    tie_embeddings: bool  # tie_word_embeddings: lm_head is the embedding (a stored one is ignored)
    attention_bias: bool  # whether q/k/v carry biases (qwen2 always; llama's attention_bias)
    vocab_size: int | None  # only as stated (never defaulted): checked against the embedding
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


def family_of(config: Mapping[str, Any]) -> str:
    """Our family for a config.json, or a SourceError naming the model types we support."""
    model_type = config.get("model_type")
    known = MODEL_TYPES | ENCODER_TYPES
    if model_type not in known:
        raise SourceError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(known))}")
    return known[model_type]


def read_config(config: Mapping[str, Any]) -> TextConfig:
    """The text model of a config.json; a SourceError says which key we cannot use."""
    family = family_of(config)
    text = _text_config(config)
    c = _Config(text, _DEFAULTS[family])
    act_key = "hidden_activation" if family == "gemma3" else "hidden_act"
    activation = c.str(act_key)
    if activation != _ACTIVATIONS[family]:
        raise SourceError(
            f"config.json: {act_key} {activation!r} is not supported for {family} "
            f"(supported: {_ACTIVATIONS[family]})"
        )
    if family == "qwen2" and c.bool("use_sliding_window"):
        raise SourceError("config.json: qwen2 with use_sliding_window is not supported")
    meta = _common_metadata(family, c)
    if family == "gemma3":
        meta |= _gemma3_metadata(c)
    # Token ids: a multimodal config keeps them at the top level, a text one in itself.
    ids = _Config({**text, **{k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}}, {})
    return TextConfig(
        family=family,
        metadata={f"{family}.{k}": v for k, v in meta.items()},
        tie_embeddings=c.bool("tie_word_embeddings"),
        attention_bias=True if family == "qwen2" else c.bool("attention_bias"),
        vocab_size=c.int("vocab_size", required=False),
        bos_token_id=ids.int("bos_token_id", required=False),
        eos_token_ids=ids.int_list("eos_token_id"),
    )


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    if config.get("model_type") != "gemma3":
        return config
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise SourceError("config.json: model_type gemma3 without a text_config")
    return text


def _common_metadata(family: str, c: _Config) -> dict[str, Any]:
    heads = c.int("num_attention_heads")
    meta: dict[str, Any] = {
        "embedding_length": c.int("hidden_size"),
        "feed_forward_length": c.int("intermediate_size"),
        "block_count": c.int("num_hidden_layers"),
        "attention.head_count": heads,
        "attention.head_count_kv": c.int("num_key_value_heads", required=False) or heads,
        "context_length": c.int("max_position_embeddings"),
        "attention.layer_norm_rms_epsilon": _f32(c.float("rms_norm_eps")),
    }
    head_dim = c.int("head_dim", required=False)
    if head_dim:
        meta["attention.key_length"] = meta["attention.value_length"] = head_dim
    partial = c.float("partial_rotary_factor", required=False)
    if partial is not None and partial != 1.0:
        meta["rope.dimension_count"] = int((head_dim or meta["embedding_length"] // heads) * partial)
    global_rope, _ = _rope_parameters(c)
    meta["rope.freq_base"] = _f32(_number(global_rope.get("rope_theta", c.float("rope_theta")), "rope_theta"))
    meta |= _rope_scaling(global_rope)
    return meta


def _rope_parameters(c: _Config) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(full-attention, sliding-attention) RoPE settings: transformers 5's ``rope_parameters`` (per
    layer type for gemma3), else 4.x's ``rope_scaling`` beside ``rope_theta``."""
    params = c.values.get("rope_parameters")
    if isinstance(params, Mapping):
        if "full_attention" in params or "sliding_attention" in params:
            return params.get("full_attention") or {}, params.get("sliding_attention") or {}
        return params, {}
    scaling = c.values.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise SourceError(f"config.json: rope_scaling should be an object, not {scaling!r}")
    return scaling or {}, {}


def _rope_scaling(rope: Mapping[str, Any]) -> dict[str, Any]:
    # build_spec refuses every kind but linear, with the message the GGUF source gives.
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind == "default":
        return {}
    factor = _number(rope.get("factor", 1.0), "rope_scaling.factor")
    return {"rope.scaling.type": str(kind), "rope.scaling.factor": _f32(factor)}


def _gemma3_metadata(c: _Config) -> dict[str, Any]:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.values.get(key) is not None:
            raise SourceError(f"config.json: gemma3 {key} is not supported")
    meta: dict[str, Any] = {"attention.query_pre_attn_scalar": _f32(c.float("query_pre_attn_scalar"))}
    window = c.int("sliding_window", required=False) or 0
    meta["attention.sliding_window"] = window
    if window:
        layer_types = c.values.get("layer_types")
        if isinstance(layer_types, list):
            meta["attention.sliding_window_pattern"] = [t == "sliding_attention" for t in layer_types]
        else:  # every pattern-th layer is global, as transformers derives layer_types from it
            meta["attention.sliding_window_pattern"] = c.int("sliding_window_pattern")
        _, local_rope = _rope_parameters(c)
        theta = local_rope.get("rope_theta", c.float("rope_local_base_freq"))
        meta["rope.freq_base_swa"] = _f32(_number(theta, "rope_local_base_freq"))
    return meta


def _f32(x: float) -> float:
    return float(np.float32(x))


def _number(v: Any, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SourceError(f"config.json: {key} should be a number, not {v!r}")
    return float(v)


class _Config:
    """Typed reads of config.json keys, falling back to the transformers defaults; SourceErrors
    name the config.json key."""

    def __init__(self, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        self.values, self.defaults = values, defaults

    def _get(self, key: str, required: bool) -> Any:
        v = self.values.get(key)
        if v is None:
            v = self.defaults.get(key)
        if v is None and required:
            raise SourceError(f"config.json: missing {key}")
        return v

    def int(self, key: str, required: bool = True) -> Any:
        v = self._get(key, required)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise SourceError(f"config.json: {key} should be an integer, not {v!r}")
        return v

    def float(self, key: str, required: bool = True) -> Any:
        v = self._get(key, required)
        return None if v is None else _number(v, key)

    def bool(self, key: str) -> bool:
        v = self._get(key, False)
        if v is not None and not isinstance(v, bool):
            raise SourceError(f"config.json: {key} should be true or false, not {v!r}")
        return bool(v)

    def str(self, key: str) -> str:
        return str(self._get(key, True))

    def int_list(self, key: str) -> tuple[int, ...]:
        """An id or a list of ids (eos_token_id is either)."""
        v = self._get(key, False)
        items = v if isinstance(v, list) else [] if v is None else [v]
        if any(isinstance(i, bool) or not isinstance(i, int) for i in items):
            raise SourceError(f"config.json: {key} should be an integer or a list of them, not {v!r}")
        return tuple(items)
