"""RoPE scalings as pure functions: a checkpoint's parameters -> the RopeScaling the graph bakes in.

Every kind is reduced to what the graph computes (artifacts/manifest.py RopeScaling): a divisor per
rotated frequency, applied to theta^(-2i/d), and a scale on cos and sin. The formulas are
transformers' (`modeling_rope_utils`: `_compute_llama3_parameters`, `_compute_yarn_parameters`,
`_compute_longrope_parameters`), so a checkpoint behaves as its own config says wherever it came
from; a GGUF file carries them as convert_hf_to_gguf writes them (llama3 as the `rope_freqs` tensor,
longrope as `rope_factors_short` / `rope_factors_long`, YaRN as `rope.scaling.*` keys).

Longrope's factors are chosen by position (short below the original context, long from it on), not
per forward pass as transformers switches them: a reply must not depend on how its prompt was cut
into chunks. Token by token, transformers' choice is the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from goinfer.artifacts.manifest import RopeScaling

from .base import SourceError


def base_inv_freq(theta: float, dims: int) -> np.ndarray:
    """theta^(-2i/dims) for i < dims/2, as convert_hf_to_gguf and transformers compute it (float32)."""
    return (1.0 / (np.float32(theta) ** (np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims)))).astype(
        np.float32
    )


def llama3_factors(
    theta: float, dims: int, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> np.ndarray:
    """Llama 3.1's per-frequency divisors, as convert_hf_to_gguf writes them to `rope_freqs`:
    1 for short wavelengths, `factor` for long ones, a smooth blend between. In float32 arithmetic,
    as the converter's torch scalars, so a folder and its GGUF give the same table."""
    if high_freq_factor == low_freq_factor:
        raise SourceError("rope scaling llama3: high_freq_factor equals low_freq_factor")
    low_wavelen, high_wavelen = original / low_freq_factor, original / high_freq_factor
    out = []
    for freq in base_inv_freq(theta, dims):  # numpy float32 scalars: the arithmetic stays float32
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """transformers' default for rope_scaling.attention_factor."""
    if mscale and mscale_all_dim:
        return _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    return _mscale(factor)


def yarn(
    theta: float,
    dims: int,
    factor: float,
    original: int,
    beta_fast: float,
    beta_slow: float,
    attn_factor: float,
    truncate: bool = True,
) -> RopeScaling:
    """YaRN: each frequency interpolated (divided by `factor`), kept, or a linear blend between, by
    how many turns it makes over the original context (beta_fast and beta_slow bound the blend)."""
    if factor <= 0 or original <= 0:
        raise SourceError(
            f"rope scaling yarn: factor {factor} and original context {original} must be positive"
        )

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each frequency left as it was (extrapolated)
    inv = base_inv_freq(theta, dims).astype(np.float64)
    scaled = inv / factor * (1 - keep) + inv * keep
    return RopeScaling(
        kind="yarn",
        factor=factor,
        original_context=original,
        freq_factors=_floats(inv / scaled),
        attn_factor=_f32(attn_factor),
    )


def longrope_attention_factor(context: int, original: int) -> float:
    """transformers' (and convert_hf_to_gguf's) default: sqrt(1 + ln(s) / ln(original)), s the
    context's stretch over the original one."""
    scale = context / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0


def longrope(
    short: Sequence[float], long: Sequence[float], dims: int, original: int, attn_factor: float
) -> RopeScaling:
    if len(short) != dims // 2 or len(long) != dims // 2:
        raise SourceError(
            f"rope scaling longrope: {len(short)} short and {len(long)} long factors, "
            f"expected {dims // 2} (half the {dims} rotated dims)"
        )
    if original <= 0:
        raise SourceError("rope scaling longrope: the original context length is missing")
    return RopeScaling(
        kind="longrope",
        factor=1.0,
        original_context=original,
        freq_factors=_floats(short),
        long_factors=_floats(long),
        attn_factor=_f32(attn_factor),
    )


def from_freq_factors(factors: Sequence[float], dims: int) -> RopeScaling:
    """A `rope_freqs` table (Llama 3.x's, as the converter writes it)."""
    if len(factors) != dims // 2:
        raise SourceError(
            f"rope_freqs has {len(factors)} entries, expected {dims // 2} (half the rotated dims)"
        )
    return RopeScaling(kind="llama3", freq_factors=_floats(factors))


def _floats(values: Sequence[float] | np.ndarray) -> tuple[float, ...]:
    """float32-rounded, as GGUF stores them and the graph computes."""
    arr = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise SourceError("rope scaling: frequency factors must be finite and positive")
    return tuple(float(v) for v in arr.astype(np.float32))


def _f32(x: float) -> float:
    return float(np.float32(x))
