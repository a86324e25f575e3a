"""GGUF metadata -> ModelSpec for the decoder architectures (llama, qwen2, qwen3, gemma3, phi3, mistral).

Defaults and derived values follow llama.cpp's ``llama-model.cpp`` (the reference reader of these
files); RoPE scalings follow transformers' formulas (rope_scaling.py). Anything our families cannot
express (partial rotary outside phi3, MoE, logit soft-capping, per-layer head counts, unexpected
tensors) is a SourceError rather than a silently different model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from goinfer.artifacts.manifest import FAMILIES, ModelSpec, RopeScaling

from . import rope_scaling
from .base import SourceError
from .gguf_vocab import Vocab

# llama.cpp: gemma3 layers are sliding except every 6th (set_swa_pattern(6), dense last).
_GEMMA3_SWA_PERIOD = 6
_GEMMA3_SWA_ROPE_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa default
# Where a window over every layer comes from `{arch}.attention.sliding_window` (Mistral v0.1's 4096,
# Phi-3's 2047): the families whose graphs llama.cpp builds with one.
_WINDOWED = ("llama", "mistral", "phi3")
# Tensors that hold RoPE tables rather than weights: the spec takes their values (rope_scaling.py).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
_PARTIAL_ROTARY = ("phi3",)  # the families whose graphs rotate only the first rope.dimension_count dims


class Metadata:
    """Typed access to ``{arch}.*`` and other GGUF keys, with SourceErrors that name the key."""

    def __init__(self, values: Mapping[str, Any], arch: str) -> None:
        self.values = values
        self.arch = arch

    def raw(self, key: str) -> Any:
        return self.values.get(f"{self.arch}.{key}")

    def int(self, key: str, default: int | None = None) -> int:
        v = self.raw(key)
        if v is None:
            if default is None:
                raise SourceError(f"missing metadata key {self.arch}.{key}")
            return default
        if isinstance(v, list):
            raise SourceError(f"{self.arch}.{key} is per-layer; only uniform layers are supported")
        if isinstance(v, bool) or not isinstance(v, int):
            raise SourceError(f"{self.arch}.{key} should be an integer, not {v!r}")
        return v

    def float(self, key: str, default: float | None = None) -> float:
        v = self.raw(key)
        if v is None:
            if default is None:
                raise SourceError(f"missing metadata key {self.arch}.{key}")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SourceError(f"{self.arch}.{key} should be a number, not {v!r}")
        return float(v)

    def str(self, key: str, default: str) -> str:
        v = self.raw(key)
        return default if v is None else str(v)

    def has(self, key: str) -> bool:
        return self.raw(key) is not None


def build_spec(
    arch: str,
    meta: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    vocab: Vocab,
    rope_tables: Mapping[str, np.ndarray] | None = None,
) -> ModelSpec:
    """The spec of a checkpoint with metadata ``meta`` and tensors ``shapes`` (numpy order);
    ``rope_tables``: the values of those of ROPE_TENSORS it has (the spec keeps them, and they are
    not weights)."""
    if arch not in FAMILIES:
        raise SourceError(f"unsupported architecture {arch!r}; supported: {', '.join(FAMILIES)}")
    m = Metadata(meta, arch)
    if m.int("expert_count", 0) > 0:
        raise SourceError(f"mixture-of-experts {arch} checkpoints are not supported")
    hidden = m.int("embedding_length")
    heads = m.int("attention.head_count")
    if heads <= 0 or hidden % heads:
        raise SourceError(f"{arch}.attention.head_count {heads} does not divide embedding_length {hidden}")
    head_dim = m.int("attention.key_length", hidden // heads)
    if m.int("attention.value_length", head_dim) != head_dim:
        raise SourceError(f"{arch}: value_length differs from key_length; not supported")
    rot = m.int("rope.dimension_count", head_dim)
    if rot != head_dim and arch not in _PARTIAL_ROTARY:
        raise SourceError(f"{arch}: rope.dimension_count is not head_dim (partial rotary is not supported)")
    if rot <= 0 or rot > head_dim or rot % 2:
        raise SourceError(
            f"{arch}: rope.dimension_count {rot} is not an even count up to head_dim {head_dim}"
        )
    layers = m.int("block_count")
    context = m.int("context_length")
    theta = m.float("rope.freq_base", 10000.0)
    tables = dict(rope_tables or {})
    if missing := [n for n in ROPE_TENSORS if n in shapes and n not in tables]:
        raise SourceError(f"internal: the values of {missing[0]} were not read")
    if "token_embd.weight" not in shapes:
        raise SourceError("missing tensor token_embd.weight")
    vocab_size = shapes["token_embd.weight"][0]
    if len(vocab.tokens) > vocab_size:
        raise SourceError(f"{len(vocab.tokens)} tokens but token_embd.weight has only {vocab_size} rows")

    spec = ModelSpec(
        family=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=m.int("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=m.int("attention.head_count_kv", heads),
        head_dim=head_dim,
        context_length=context,
        norm_eps=m.float("attention.layer_norm_rms_epsilon"),
        rope_theta=theta,
        rope_scaling=_rope_scaling(m, theta, rot, context, tables),
        tie_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
        rope_dims=0 if rot == head_dim else rot,
        **_family_fields(m, hidden, heads, head_dim, layers, context),
    )
    if spec.attention_bias and arch == "gemma3":
        raise SourceError("gemma3: attention biases are not supported")
    if spec.num_kv_heads <= 0 or heads % spec.num_kv_heads:
        raise SourceError(f"{arch}: {spec.num_kv_heads} kv heads do not divide {heads} heads")
    check_tensors(spec, shapes)
    return spec


def _rope_scaling(
    m: Metadata, theta: float, rot: int, context: int, tables: Mapping[str, np.ndarray]
) -> RopeScaling:
    kind = m.str("rope.scaling.type", "linear")  # llama.cpp's default type
    freqs, short, long = (tables.get(n) for n in ROPE_TENSORS)
    if (short is None) != (long is None):
        raise SourceError(f"{m.arch}: rope_factors_short and rope_factors_long come as a pair")
    if (freqs is not None or short is not None) and m.arch == "gemma3":
        raise SourceError("gemma3: per-frequency rope factors are not supported")
    if freqs is not None and short is not None:
        raise SourceError(f"{m.arch}: both rope_freqs and rope_factors_*: not supported")
    if short is not None:  # longrope (Phi-3): the converter writes the factors, not the type
        if kind not in ("linear", "longrope", "none"):
            raise SourceError(f"{m.arch}: rope scaling {kind!r} beside rope_factors_*: not supported")
        original = m.int("rope.scaling.original_context_length", 0)
        default = rope_scaling.longrope_attention_factor(context, original) if original > 0 else 1.0
        attn = m.float("rope.scaling.attn_factor", default)
        return rope_scaling.longrope(_values(short), _values(long), rot, original, attn)
    if kind == "longrope":
        raise SourceError(f"{m.arch}: rope scaling longrope without rope_factors_short/long tensors")
    if freqs is not None:  # Llama 3.x: the converter writes the divisors as rope_freqs
        if kind == "yarn" or (kind == "linear" and m.float("rope.scaling.factor", 0.0) not in (0.0, 1.0)):
            raise SourceError(f"{m.arch}: rope_freqs beside rope scaling {kind!r}: not supported")
        return rope_scaling.from_freq_factors(_values(freqs), rot)
    # llama.cpp: a missing or zero factor means no scaling.
    factor = m.float("rope.scaling.factor", m.float("rope.scale_linear", 0.0))
    if factor in (0.0, 1.0) or kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    if kind == "yarn" and m.arch != "gemma3":
        return _yarn(m, theta, rot, context, factor)
    raise SourceError(
        f"{m.arch}: rope scaling {kind!r} is not supported (supported: linear, yarn, llama3, longrope)"
    )


def _yarn(m: Metadata, theta: float, rot: int, context: int, factor: float) -> RopeScaling:
    """YaRN from the keys convert_hf_to_gguf writes, read as transformers' rope_scaling: factor,
    original_max_position_embeddings, beta_fast, beta_slow, attention_factor."""
    if m.float("rope.scaling.yarn_ext_factor", 1.0) != 1.0:
        raise SourceError(f"{m.arch}: yarn_ext_factor other than 1 is not supported")
    if m.float("rope.scaling.yarn_log_multiplier", 0.0) != 0.0:
        raise SourceError(f"{m.arch}: yarn_log_multiplier (DeepSeek's mscale_all_dim) is not supported")
    attn = m.float(
        "rope.scaling.yarn_attn_factor",
        m.float("rope.scaling.attn_factor", rope_scaling.yarn_attention_factor(factor, None, None)),
    )
    return rope_scaling.yarn(
        theta,
        rot,
        factor,
        m.int("rope.scaling.original_context_length", context),
        m.float("rope.scaling.yarn_beta_fast", 32.0),
        m.float("rope.scaling.yarn_beta_slow", 1.0),
        attn,
    )


def _values(table: np.ndarray) -> list[float]:
    return [float(v) for v in np.asarray(table, dtype=np.float32).reshape(-1)]


def _family_fields(
    m: Metadata, hidden: int, heads: int, head_dim: int, layers: int, context: int
) -> dict[str, Any]:
    if m.arch == "gemma3":
        return _gemma3_fields(m, hidden, heads, head_dim, layers)
    fields: dict[str, Any] = {"qk_norm": m.arch == "qwen3"}
    window = m.int("attention.sliding_window", 0) if m.arch in _WINDOWED else 0
    if 0 < window < context:  # a window as long as the context changes nothing
        fields |= {"sliding_window": window, "sliding_layers": (True,) * layers}
    return fields


def _gemma3_fields(m: Metadata, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
    if m.float("final_logit_softcapping", 0.0):
        raise SourceError("gemma3: final_logit_softcapping is not supported")
    window = m.int("attention.sliding_window", 0)
    return {
        "activation": "gelu_tanh",
        "embed_scale": math.sqrt(hidden),
        "norm_weight_offset": 0.0,  # convert_hf_to_gguf already stores 1 + w for every gemma3 norm
        "qk_norm": True,
        "post_norms": True,
        "attn_scale": _gemma3_attn_scale(m, hidden, heads, head_dim, layers),
        "sliding_window": window,
        "sliding_layers": _gemma3_sliding_layers(m, layers) if window > 0 else (),
        "rope_local_theta": m.float("rope.freq_base_swa", _GEMMA3_SWA_ROPE_THETA) if window > 0 else 0.0,
    }


def _gemma3_attn_scale(m: Metadata, hidden: int, heads: int, head_dim: int, layers: int) -> float:
    # HF's query_pre_attn_scalar, if a converter ever stores it; llama.cpp hardcodes the same rule:
    # 27B (62 layers) scales by hidden/heads, every other size by head_dim.
    if m.has("attention.query_pre_attn_scalar"):
        return m.float("attention.query_pre_attn_scalar") ** -0.5
    return (hidden // heads) ** -0.5 if layers == 62 else head_dim**-0.5


def _gemma3_sliding_layers(m: Metadata, layers: int) -> tuple[bool, ...]:
    pattern = m.raw("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per-layer flags
        if len(pattern) != layers:
            raise SourceError(f"sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        return tuple(bool(p) for p in pattern)
    period = m.int("attention.sliding_window_pattern", _GEMMA3_SWA_PERIOD)
    return tuple(period == 0 or i % period < period - 1 for i in range(layers))


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``spec`` has, with its numpy shape."""
    h, f, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = {
        "attn_norm.weight": (h,),
        "attn_q.weight": (q, h),
        "attn_k.weight": (kv, h),
        "attn_v.weight": (kv, h),
        "attn_output.weight": (h, q),
        "ffn_norm.weight": (h,),
        "ffn_gate.weight": (f, h),
        "ffn_up.weight": (f, h),
        "ffn_down.weight": (h, f),
    }
    if spec.family == "phi3":  # fused: q, k, v rows in one tensor; gate then up rows in ffn_up
        for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight"):
            del per_layer[name]
        per_layer |= {"attn_qkv.weight": (q + 2 * kv, h), "ffn_up.weight": (2 * f, h)}
    if spec.qk_norm:
        per_layer |= {"attn_q_norm.weight": (spec.head_dim,), "attn_k_norm.weight": (spec.head_dim,)}
    if spec.family == "gemma3":
        per_layer |= {"post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)}
    if spec.attention_bias:
        per_layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not spec.tie_embeddings:
        shapes["output.weight"] = (v, h)
    half = spec.rotary_dims // 2
    r = spec.rope_scaling
    if r.kind == "llama3":
        shapes["rope_freqs.weight"] = (half,)
    if r.kind == "longrope":
        shapes |= {"rope_factors_short.weight": (half,), "rope_factors_long.weight": (half,)}
    for i in range(spec.num_layers):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in per_layer.items()}
    return shapes


def check_tensors(spec: ModelSpec, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """SourceError unless the checkpoint has exactly the tensors ``spec`` implies, shaped as it implies."""
    want = expected_shapes(spec)
    missing = sorted(set(want) - set(shapes), key=_tensor_order)
    if missing:
        raise SourceError(f"{spec.family}: missing tensor {missing[0]}" + _more(missing))
    extra = sorted(set(shapes) - set(want), key=_tensor_order)
    if extra:
        raise SourceError(f"{spec.family}: unexpected tensor {extra[0]} (not supported)" + _more(extra))
    for name, shape in want.items():
        if tuple(shapes[name]) != shape:
            raise SourceError(f"tensor {name} has shape {tuple(shapes[name])}, the metadata implies {shape}")


def _more(names: list[str]) -> str:
    return f" and {len(names) - 1} more" if len(names) > 1 else ""


def _tensor_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[1]) if parts[0] == "blk" else -1, name)
