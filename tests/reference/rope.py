"""transformers' scaled RoPEs in numpy (modeling_rope_utils: `_compute_llama3_parameters`,
`_compute_yarn_parameters`, `_compute_longrope_parameters`), line by line in float64: the inverse
frequency of each rotated pair and the factor cos and sin are scaled by. Written from transformers'
source, not from goinfer's (compiler/sources/rope_scaling.py), which states the same rules in its
own terms (per-frequency divisors).
"""

from __future__ import annotations

import math

import numpy as np


def default_inv_freq(base: float, dim: int) -> np.ndarray:
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def llama3_inv_freq(
    base: float,
    dim: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    old_context_len: int,
) -> np.ndarray:
    inv_freq = default_inv_freq(base, dim)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    base: float,
    dim: int,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attention_factor: float | None = None,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    truncate: bool = True,
) -> tuple[np.ndarray, float]:
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _get_mscale(factor)

    def find_correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = find_correction_dim(beta_fast), find_correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def longrope_inv_freq(
    base: float,
    dim: int,
    ext_factors: np.ndarray,
    max_position_embeddings: int,
    original_max_position_embeddings: int,
    attention_factor: float | None = None,
) -> tuple[np.ndarray, float]:
    """One of the factor lists (short or long) -> (inverse frequencies, attention factor)."""
    factor = max_position_embeddings / original_max_position_embeddings
    if attention_factor is None:
        attention_factor = (
            1.0
            if factor <= 1.0
            else math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))
        )
    inv_freq = 1.0 / (np.asarray(ext_factors, np.float64) * base ** (np.arange(0, dim, 2) / dim))
    return inv_freq, float(attention_factor)
