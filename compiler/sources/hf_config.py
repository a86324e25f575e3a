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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import rope_scaling
from .base import SourceError

# config.json model_type -> our family (compiler/models registry key).
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "mistral": "mistral",
}
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
    "qwen3": {
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 128,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "use_sliding_window": False,
    },
    "phi3": {
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "partial_rotary_factor": 1.0,
    },
    "mistral": {
        "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False,
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
_ACTIVATIONS = {
    "llama": "silu",
    "qwen2": "silu",
    "qwen3": "silu",
    "gemma3": "gelu_pytorch_tanh",
    "phi3": "silu",
    "mistral": "silu",
}
# The sliding window a config.json that leaves the key out has (MistralConfig's; an explicit null
# means none). Windows over every layer are read for these families only.
_WINDOW_DEFAULTS = {"mistral": 4096, "phi3": None}


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
    # The RoPE tables convert_hf_to_gguf would write as tensors (gguf_spec.ROPE_TENSORS): Llama 3's
    # rope_freqs, longrope's short and long factors.
    rope_tables: Mapping[str, np.ndarray] = field(default_factory=dict)


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
    if family in ("qwen2", "qwen3") and c.bool("use_sliding_window"):
        raise SourceError(f"config.json: {family} with use_sliding_window is not supported")
    meta, tables = _common_metadata(family, c)
    if family == "gemma3":
        meta |= _gemma3_metadata(c)
    if family in _WINDOW_DEFAULTS:
        window = text.get("sliding_window", _WINDOW_DEFAULTS[family])
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
            raise SourceError(f"config.json: sliding_window should be an integer or null, not {window!r}")
        meta["attention.sliding_window"] = window or 0
    # Token ids: a multimodal config keeps them at the top level, a text one in itself.
    ids = _Config({**text, **{k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}}, {})
    return TextConfig(
        family=family,
        metadata={f"{family}.{k}": v for k, v in meta.items()},
        tie_embeddings=c.bool("tie_word_embeddings"),
        attention_bias=True if family == "qwen2" else False if family == "phi3" else c.bool("attention_bias"),
        vocab_size=c.int("vocab_size", required=False),
        bos_token_id=ids.int("bos_token_id", required=False),
        eos_token_ids=ids.int_list("eos_token_id"),
        rope_tables=tables,
    )


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    if config.get("model_type") != "gemma3":
        return config
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise SourceError("config.json: model_type gemma3 without a text_config")
    return text


def _common_metadata(family: str, c: _Config) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
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
    global_rope, _ = _rope_parameters(c)
    rot = head_dim or meta["embedding_length"] // heads
    partial = global_rope.get("partial_rotary_factor", c.float("partial_rotary_factor", required=False))
    if partial is not None and _number(partial, "partial_rotary_factor") != 1.0:
        rot = meta["rope.dimension_count"] = int(rot * partial)
    theta = _f32(_number(global_rope.get("rope_theta", c.float("rope_theta")), "rope_theta"))
    meta["rope.freq_base"] = theta
    scaling, tables = _rope_scaling(global_rope, c, theta, rot)
    return meta | scaling, tables


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


def _rope_scaling(
    rope: Mapping[str, Any], c: _Config, theta: float, rot: int
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """rope_scaling as convert_hf_to_gguf writes it: (metadata keys, RoPE tables as tensors). A kind
    we do not build goes through as its type, which build_spec refuses as the GGUF source does."""
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind == "default":
        return {}, {}

    def number(key: str, default: float | None = None) -> float:
        v = rope.get(key, default)
        if v is None:
            raise SourceError(f"config.json: rope_scaling {kind} needs {key}")
        return _number(v, f"rope_scaling.{key}")

    context = c.int("max_position_embeddings")
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        factor, low, high, original = (number(k) for k in keys)
        factors = rope_scaling.llama3_factors(theta, rot, factor, low, high, int(original))
        return {}, {"rope_freqs.weight": factors}
    if kind == "yarn":
        factor = number("factor")
        if rope.get("truncate", True) is not True:
            raise SourceError("config.json: rope_scaling yarn with truncate false is not supported")
        meta: dict[str, Any] = {
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": _f32(factor),
            "rope.scaling.original_context_length": int(
                rope.get("original_max_position_embeddings") or context
            ),
        }
        for key, gguf_key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if rope.get(key):  # transformers: a missing or zero beta takes its default
                meta[f"rope.scaling.{gguf_key}"] = _f32(number(key))
        attn = rope.get("attention_factor")
        if attn is None:
            attn = rope_scaling.yarn_attention_factor(factor, rope.get("mscale"), rope.get("mscale_all_dim"))
        meta["rope.scaling.yarn_attn_factor"] = _f32(_number(attn, "rope_scaling.attention_factor"))
        return meta, {}
    if kind in ("longrope", "su"):
        short, long = (_float_list(rope, key) for key in ("short_factor", "long_factor"))
        # transformers reads the original context at the top level (Phi-3's configs keep it there)
        # and then stretches by max_position_embeddings over it.
        original = c.int("original_max_position_embeddings", required=False)
        attn = rope.get("attention_factor")
        if original:
            default = rope_scaling.longrope_attention_factor(context, original)
        else:
            original = int(rope.get("original_max_position_embeddings") or context)
            factor = number("factor", context / original)
            default = rope_scaling.longrope_attention_factor(int(factor * original), original)
        attn = default if attn is None else _number(attn, "rope_scaling.attention_factor")
        meta = {"rope.scaling.original_context_length": original, "rope.scaling.attn_factor": _f32(attn)}
        tables = {
            "rope_factors_short.weight": np.asarray(short, np.float32),
            "rope_factors_long.weight": np.asarray(long, np.float32),
        }
        return meta, tables
    factor = _number(rope.get("factor", 1.0), "rope_scaling.factor")
    return {"rope.scaling.type": str(kind), "rope.scaling.factor": _f32(factor)}, {}


def _float_list(rope: Mapping[str, Any], key: str) -> list[float]:
    v = rope.get(key)
    if not isinstance(v, list) or not v:
        raise SourceError(f"config.json: rope_scaling longrope needs {key}, a list of numbers")
    return [_number(x, f"rope_scaling.{key}") for x in v]


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
