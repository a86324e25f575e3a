"""A numpy forward pass that follows llama.cpp's graph builders, for checking the compiled model.

Written from llama.cpp's source (src/models/{llama,qwen2,qwen3,gemma3,phi3}.cpp, src/llama-model.cpp,
src/llama-hparams.{h,cpp}, ggml-cpu rope), not from goinfer's lowering, and it reads the GGUF with
the `gguf` package alone, so a shared misreading cannot make both sides agree. The scaled RoPEs
(Llama 3's rope_freqs, YaRN, longrope) follow transformers' formulas instead (rope.py), which are
what the checkpoints were trained with.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from .rope import longrope_inv_freq, yarn_inv_freq

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "phi3")


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_rot: int
    eps: float
    neox: bool  # LLAMA_ROPE_TYPE_NEOX (pairs i, i+n_rot/2) vs NORM (pairs 2i, 2i+1)
    rope_base: float
    rope_freq_scale: float  # ggml's freq_scale: 1/factor of linear scaling
    swa_window: int  # 0 means no sliding window
    swa_layers: tuple[bool, ...]
    rope_base_swa: float
    attn_scale: float
    logit_softcap: float
    # Scaled RoPE (None: plain): inverse frequencies below and from `rope_switch` (longrope's
    # original context; the same array twice otherwise), and the cos/sin scale.
    rope_inv_freq: tuple[np.ndarray, np.ndarray] | None = None
    rope_switch: int = 0
    rope_mscale: float = 1.0


class _Model:
    """The GGUF's metadata and tensors; each tensor is dequantized at most once."""

    def __init__(self, path: Path) -> None:
        self.reader = GGUFReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._cache: dict[str, np.ndarray] = {}
        self.hp = _read_hparams(self)

    def meta(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def weight(self, name: str) -> np.ndarray:
        """Whole tensor as float32 in numpy order: (ne1, ne0), i.e. (out, in) for a matrix."""
        w = self._cache.get(name)
        if w is None:
            t = self.tensors[name]
            shape = [int(n) for n in reversed(t.shape)]
            w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            self._cache[name] = w
        return w

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Selected rows only: the embedding lookup need not dequantize a 262k-row table."""
        if name in self._cache:
            return self._cache[name][ids]
        t = self.tensors[name]
        return dequantize(t.data[ids], t.tensor_type).astype(np.float32).reshape(len(ids), int(t.shape[0]))


def _scalar_per_layer(value: Any, what: str) -> int:
    # llama.cpp allows per-layer arrays; the families here use one value for all layers.
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise NotImplementedError(f"per-layer {what} is not supported: {value}")
        value = value[0]
    return int(value)


def _read_hparams(m: _Model) -> HParams:
    arch = m.meta("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise NotImplementedError(f"architecture {arch!r} not in {SUPPORTED_ARCHS}")

    def key(name: str, default: Any = None) -> Any:
        return m.meta(f"{arch}.{name}", default)

    n_layer = int(key("block_count"))
    n_embd = int(key("embedding_length"))
    n_head = _scalar_per_layer(key("attention.head_count"), "head_count")
    n_head_kv = _scalar_per_layer(key("attention.head_count_kv", n_head), "head_count_kv")
    head_dim_k = int(key("attention.key_length", n_embd // n_head))
    head_dim_v = int(key("attention.value_length", n_embd // n_head))
    n_rot = int(key("rope.dimension_count", head_dim_k))

    # llama_model_base::load_hparams: linear factor from rope.scaling.factor, else rope.scale_linear;
    # llama_context forces freq_scale = 1 when the scaling type is "none".
    scaling = key("rope.scaling.type", "linear")
    if scaling not in ("linear", "none", "yarn"):
        raise NotImplementedError(f"rope scaling {scaling!r}")
    factor = float(key("rope.scaling.factor", key("rope.scale_linear", 0.0)))
    freq_scale = 1.0 if scaling in ("none", "yarn") or factor == 0.0 else 1.0 / factor
    rope_base = float(key("rope.freq_base", 10000.0))
    n_ctx = int(key("context_length", 0))  # 0: not stated (hand-written test files)
    scaled, switch, mscale = None, 0, 1.0
    if scaling == "yarn":  # transformers' rope_scaling, as convert_hf_to_gguf writes its keys
        inv, mscale = yarn_inv_freq(
            rope_base,
            n_rot,
            factor,
            int(key("rope.scaling.original_context_length", n_ctx)),
            float(key("rope.scaling.yarn_beta_fast", 32.0)),
            float(key("rope.scaling.yarn_beta_slow", 1.0)),
            key("rope.scaling.yarn_attn_factor"),
        )
        scaled = (inv, inv)
    if m.has("rope_factors_long.weight"):  # Phi-3's longrope: the factors as tensors
        original = int(key("rope.scaling.original_context_length"))
        short, mscale = longrope_inv_freq(
            rope_base, n_rot, m.weight("rope_factors_short.weight"), n_ctx, original,
            key("rope.scaling.attn_factor"),
        )  # fmt: skip
        long, _ = longrope_inv_freq(
            rope_base, n_rot, m.weight("rope_factors_long.weight"), n_ctx, original,
            key("rope.scaling.attn_factor"),
        )  # fmt: skip
        scaled, switch = (short, long), original

    swa_window, swa_layers, rope_base_swa = 0, (False,) * n_layer, 10000.0
    softcap = 0.0
    if arch in ("llama", "phi3"):
        # one window over every layer where the file sets one (Mistral, Phi-3); as transformers masks
        swa_window = int(key("attention.sliding_window", 0))
        if swa_window > 0 and not 0 < n_ctx <= swa_window:
            swa_layers = (True,) * n_layer
        else:
            swa_window = 0
    if arch == "gemma3":
        # llama_model_gemma3::load_arch_hparams: SWA only when attention.sliding_window > 0; the
        # pattern is a per-layer bool array or a period (default 6) where layer il slides iff
        # il % period < period - 1, i.e. every period-th layer is global.
        swa_window = int(key("attention.sliding_window", 0))
        if swa_window > 0:
            pattern = key("attention.sliding_window_pattern", 6)
            if isinstance(pattern, list):
                swa_layers = tuple(bool(p) for p in pattern[:n_layer])
            else:
                period = int(pattern)
                swa_layers = tuple(period == 0 or il % period < period - 1 for il in range(n_layer))
            rope_base_swa = float(key("rope.freq_base_swa", 10000.0))
        softcap = float(key("final_logit_softcapping", 0.0))
        # gemma_pytorch's query_pre_attn_scalar as llama.cpp hard-codes it: 27B (62 layers) uses
        # n_embd / n_head (integer division), every other size head_dim_k.
        attn_scale = 1.0 / math.sqrt(n_embd // n_head if n_layer == 62 else head_dim_k)
    else:
        if (n_rot != head_dim_k and arch != "phi3") or head_dim_k != head_dim_v:
            raise NotImplementedError("llama/qwen2/qwen3 graphs assert n_rot == head_dim_k == head_dim_v")
        attn_scale = 1.0 / math.sqrt(head_dim_k)

    return HParams(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        n_rot=n_rot,
        eps=float(key("attention.layer_norm_rms_epsilon")),
        neox=arch != "llama",  # llama_model_rope_type: LLAMA is NORM; QWEN2/3, GEMMA3, PHI3 are NEOX
        rope_base=rope_base,
        rope_freq_scale=freq_scale,
        swa_window=swa_window,
        swa_layers=swa_layers,
        rope_base_swa=rope_base_swa,
        attn_scale=attn_scale,
        logit_softcap=softcap,
        rope_inv_freq=scaled,
        rope_switch=switch,
        rope_mscale=mscale,
    )


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int) -> _Model:
    # mtime/size in the key: a rewritten file (tiny test models) is never served stale.
    return _Model(Path(path))


def load(gguf_path: str | Path) -> _Model:
    p = Path(gguf_path).resolve()
    st = p.stat()
    return _open(str(p), st.st_mtime_ns, st.st_size)


# --- ggml ops, float64 except the weight matmuls ----------------------------------------------------


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # ggml_rms_norm then ggml_mul: x / sqrt(mean(x^2) + eps) * w (gemma's +1 is already in w).
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


# ggml-cpu type_traits_cpu[w].vec_dot_type: the format llama.cpp converts activations to before a
# matmul with weights of type w. Types not listed keep float32 activations.
_Q = GGMLQuantizationType
_ACT_FORMAT = {
    **dict.fromkeys((_Q.Q4_0, _Q.Q5_0, _Q.Q8_0), "q8_0"),
    **dict.fromkeys((_Q.Q4_1, _Q.Q5_1), "q8_1"),
    **dict.fromkeys((_Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K), "q8_K"),
    _Q.F16: "f16",
}


def _round_activations(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray | None]:
    """x after a round trip through llama.cpp's activation format (ggml-cpu x86 quantize_row_*).

    For q8_1 also returns, per block, how far the stored fp16 block sum s = fp16(d * sum(q)) is
    from fp16(d) * sum(q): the q4_1/q5_1 dot products multiply the weight's block min by s.
    """
    x = x.astype(np.float32)
    if fmt == "f16":
        return x.astype(np.float16).astype(np.float32), None
    block = 256 if fmt == "q8_K" else 32
    xb = x.reshape(*x.shape[:-1], -1, block)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0))
    q = np.clip(np.round(xb * inv), -127, 127)  # half-to-even like _mm256_round_ps / nearest_int
    d = amax / np.float32(127)
    s_err = None
    if fmt != "q8_K":
        d16 = d.astype(np.float16).astype(np.float32)  # q8_0/q8_1 store the scale as fp16
        if fmt == "q8_1":
            qsum = q.sum(axis=-1)
            s16 = (d[..., 0] * qsum).astype(np.float16).astype(np.float32)
            s_err = (s16 - d16[..., 0] * qsum).astype(np.float64)
        d = d16
    return (q * d).reshape(x.shape), s_err


def _block_mins(m: _Model, name: str) -> np.ndarray:
    """(rows, blocks) fp16 block minimum m of a Q4_1/Q5_1 tensor (bytes 2..3 of each block)."""
    key = f"{name}#mins"
    if key not in m._cache:
        t = m.tensors[name]
        raw = np.asarray(t.data).reshape(t.data.shape[0], int(t.shape[0]) // 32, -1)
        m._cache[key] = np.ascontiguousarray(raw[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
    return m._cache[key]


def _linear(m: _Model, x: np.ndarray, name: str, rounding: bool) -> np.ndarray:
    # float32 weights and sgemm keep memory and time sane; activations return to float64.
    wname = f"{name}.weight"
    fmt = _ACT_FORMAT.get(m.tensors[wname].tensor_type) if rounding else None
    s_err = None
    xa = x.astype(np.float32)
    if fmt:
        xa, s_err = _round_activations(x, fmt)
    y = (xa @ m.weight(wname).T).astype(np.float64)
    if s_err is not None:
        y += s_err @ _block_mins(m, wname).T.astype(np.float64)
    if m.has(f"{name}.bias"):
        y = y + m.weight(f"{name}.bias")
    return y


def _rope(
    x: np.ndarray, pos: np.ndarray, hp: HParams, base: float, freq_scale: float, factors: np.ndarray | None
) -> np.ndarray:
    """ggml_rope_ext without YaRN: theta_i = pos * freq_scale * base^(-2i/n_rot) / factor_i; or,
    for a scaled RoPE, theta_i = pos * inv_freq_i (longrope's long table from rope_switch on),
    cos and sin times its mscale.

    x is (T, heads, head_dim); dims past n_rot pass through unchanged.
    """
    half = hp.n_rot // 2
    if hp.rope_inv_freq is not None:
        short, long = hp.rope_inv_freq
        late = (pos >= hp.rope_switch)[:, None] if hp.rope_switch else np.zeros((len(pos), 1), bool)
        inv_freq = np.where(late, long[None, :], short[None, :])
        theta = pos[:, None].astype(np.float64) * inv_freq
        cos, sin = (f(theta)[:, None, :] * hp.rope_mscale for f in (np.cos, np.sin))
        return _rotate(x, hp, cos, sin)
    inv_freq = base ** (-2.0 * np.arange(half) / hp.n_rot)
    if factors is not None:
        inv_freq = inv_freq / factors
    theta = pos[:, None].astype(np.float64) * freq_scale * inv_freq[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    return _rotate(x, hp, cos, sin)


def _rotate(x: np.ndarray, hp: HParams, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = hp.n_rot // 2
    out = x.copy()
    if hp.neox:
        a, b = x[..., :half], x[..., half : hp.n_rot]
        out[..., :half], out[..., half : hp.n_rot] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0 : hp.n_rot : 2], x[..., 1 : hp.n_rot : 2]
        out[..., 0 : hp.n_rot : 2], out[..., 1 : hp.n_rot : 2] = a * cos - b * sin, a * sin + b * cos
    return out


def attention_mask(n_tokens: int, window: int) -> np.ndarray:
    """allowed[q, k] for query q and key k at positions 0..n-1.

    Causal, plus llama_hparams::is_masked_swa (LLAMA_SWA_TYPE_STANDARD): a key is masked when
    q - k >= window, so a query sees itself and the window-1 keys before it.
    """
    q = np.arange(n_tokens)[:, None]
    k = np.arange(n_tokens)[None, :]
    allowed = k <= q
    if window > 0:
        allowed &= q - k < window
    return allowed


def _attention(m: _Model, x: np.ndarray, il: int, rounding: bool) -> np.ndarray:
    hp = m.hp
    n = x.shape[0]
    blk = f"blk.{il}"
    if hp.arch == "phi3":  # build_phi3: one qkv matmul, its rows q, then k, then v
        qkv = _linear(m, x, f"{blk}.attn_qkv", rounding)
        q_end, k_end = hp.n_head * hp.head_dim_k, (hp.n_head + hp.n_head_kv) * hp.head_dim_k
        q = qkv[:, :q_end].reshape(n, hp.n_head, hp.head_dim_k)
        k = qkv[:, q_end:k_end].reshape(n, hp.n_head_kv, hp.head_dim_k)
        v = qkv[:, k_end:].reshape(n, hp.n_head_kv, hp.head_dim_v)
    else:
        q = _linear(m, x, f"{blk}.attn_q", rounding).reshape(n, hp.n_head, hp.head_dim_k)
        k = _linear(m, x, f"{blk}.attn_k", rounding).reshape(n, hp.n_head_kv, hp.head_dim_k)
        v = _linear(m, x, f"{blk}.attn_v", rounding).reshape(n, hp.n_head_kv, hp.head_dim_v)

    if hp.arch in ("gemma3", "qwen3"):  # per-head RMSNorm over head_dim before RoPE
        q = _rms_norm(q, m.weight(f"{blk}.attn_q_norm.weight"), hp.eps)
        k = _rms_norm(k, m.weight(f"{blk}.attn_k_norm.weight"), hp.eps)

    # get_rope_freq_base/scale: sliding layers use the *_train_swa values, the rest the context's.
    # (gemma3's own: a window over every layer, as Mistral's, keeps the model's RoPE)
    swa = hp.swa_layers[il]
    local = swa and hp.arch == "gemma3"
    base = hp.rope_base_swa if local else hp.rope_base
    freq_scale = 1.0 if local else hp.rope_freq_scale
    # the optional llama3-style rope_freqs.weight (the divisors convert_hf_to_gguf computes from
    # transformers' rule); the gemma3 graph passes none.
    factors = m.weight("rope_freqs.weight") if hp.arch != "gemma3" and m.has("rope_freqs.weight") else None
    pos = np.arange(n)
    q = _rope(q, pos, hp, base, freq_scale, factors)
    k = _rope(k, pos, hp, base, freq_scale, factors)

    # GQA as ggml_mul_mat broadcasts: query head h reads kv head h // (n_head / n_head_kv).
    group = hp.n_head // hp.n_head_kv
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * hp.attn_scale
    allowed = attention_mask(n, hp.swa_window if swa else 0)
    scores = np.where(allowed[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", probs, v).reshape(n, hp.n_head * hp.head_dim_v)
    return _linear(m, out, f"{blk}.attn_output", rounding)


def _gelu_tanh(x: np.ndarray, fp16_table: bool) -> np.ndarray:
    """ggml_gelu / ggml_geglu: the tanh approximation.

    fp16_table mirrors ggml-cpu's GGML_GELU_FP16 path: for |x| < 10 the result is a table lookup,
    fp16(gelu(fp16(x))); at or past +-10 it is x or 0.
    """
    if fp16_table:
        xh = x.astype(np.float16).astype(np.float64)
        y = _gelu_tanh(xh, False).astype(np.float16).astype(np.float64)
        return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, y))
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _ffn(m: _Model, x: np.ndarray, il: int, rounding: bool) -> np.ndarray:
    # build_ffn with LLM_FFN_PAR: act(gate(x)) * up(x), then down
    blk = f"blk.{il}"
    if m.hp.arch == "phi3":  # LLM_FFN_SWIGLU on the fused up: silu(first half) * second half
        gate, up = np.split(_linear(m, x, f"{blk}.ffn_up", rounding), 2, axis=-1)
        return _linear(m, _silu(gate) * up, f"{blk}.ffn_down", rounding)
    gate = _linear(m, x, f"{blk}.ffn_gate", rounding)
    gate = _gelu_tanh(gate, rounding) if m.hp.arch == "gemma3" else _silu(gate)
    up = _linear(m, x, f"{blk}.ffn_up", rounding)
    return _linear(m, gate * up, f"{blk}.ffn_down", rounding)


def reference_logits(
    gguf_path: str | Path, token_ids: list[int], *, llama_cpp_rounding: bool = False
) -> np.ndarray:
    """Logits (len(token_ids), n_vocab) float32 of a full causal pass at positions 0..n-1
    (a sliding window as transformers masks it: a query sees itself and the window - 1 keys before).

    llama_cpp_rounding=True mirrors the roundings of llama.cpp's CPU backend, to compare against
    its numbers tightly: each matmul input goes through the weight type's vec_dot_type
    (q8_0/q8_1/q8_K/f16) and GELU through ggml's fp16 table. The default is exact math.
    """
    m = load(gguf_path)
    hp = m.hp
    eps = hp.eps
    ids = np.asarray(token_ids, dtype=np.int64)
    x = m.rows("token_embd.weight", ids).astype(np.float64)
    if hp.arch == "gemma3":
        x = x * float(np.float32(math.sqrt(hp.n_embd)))  # ggml_scale by sqrtf(n_embd)

    for il in range(hp.n_layer):
        blk = f"blk.{il}"
        h = _rms_norm(x, m.weight(f"{blk}.attn_norm.weight"), eps)
        a = _attention(m, h, il, llama_cpp_rounding)
        if hp.arch == "gemma3":
            # gemma3 normalizes each sublayer's output before the residual add
            a = _rms_norm(a, m.weight(f"{blk}.post_attention_norm.weight"), eps)
        x = x + a
        h = _rms_norm(x, m.weight(f"{blk}.ffn_norm.weight"), eps)
        f = _ffn(m, h, il, llama_cpp_rounding)
        if hp.arch == "gemma3":
            f = _rms_norm(f, m.weight(f"{blk}.post_ffw_norm.weight"), eps)
        x = x + f

    x = _rms_norm(x, m.weight("output_norm.weight"), eps)
    head = "output" if m.has("output.weight") else "token_embd"  # tied embeddings when absent
    logits = _linear(m, x, head, llama_cpp_rounding)
    if hp.logit_softcap:
        logits = np.tanh(logits / hp.logit_softcap) * hp.logit_softcap
    return logits.astype(np.float32)
