"""The scaled RoPEs the sources compute (compiler/sources/rope_scaling.py, as per-frequency divisors and
a cos/sin scale) against transformers' formulas as the numpy reference states them
(tests/reference/rope.py), on real models' parameters and on the tiny ones'."""

from __future__ import annotations

import math

import numpy as np
import pytest
from goinfer.compiler.sources import rope_scaling
from reference.rope import default_inv_freq, llama3_inv_freq, longrope_inv_freq, yarn_inv_freq
from tiny_gguf import ORIGINAL_CONTEXT, ROPE_THETA

# float32 rounding of the divisors and of the base frequencies (which transformers computes in float32)
RTOL = 2e-6


def _inv(theta: float, dims: int, divisors: tuple[float, ...]) -> np.ndarray:
    return default_inv_freq(theta, dims) / np.asarray(divisors, np.float64)


@pytest.mark.parametrize(
    ("theta", "dims", "factor", "low", "high", "original"),
    [
        (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 / 3.2
        (500000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B's factor
        (ROPE_THETA["llama3"], 16, 4.0, 1.0, 4.0, ORIGINAL_CONTEXT),  # the tiny llama3
    ],
)
def test_llama3_divisors_give_transformers_frequencies(theta, dims, factor, low, high, original) -> None:
    ours = rope_scaling.llama3_factors(theta, dims, factor, low, high, original)
    want = llama3_inv_freq(theta, dims, factor, low, high, original)
    np.testing.assert_allclose(_inv(theta, dims, tuple(ours)), want, rtol=RTOL)
    # every branch of the rule is taken: kept, divided by factor, blended
    assert ours[0] == 1.0 and ours[-1] == np.float32(factor) and ((ours > 1) & (ours < factor)).any()


@pytest.mark.parametrize(
    ("theta", "dims", "factor", "original", "fast", "slow", "attn", "mscale"),
    [
        (1000000.0, 128, 4.0, 32768, 32.0, 1.0, None, None),  # Qwen3's 131k recipe
        (10000.0, 128, 16.0, 4096, 32.0, 1.0, None, (1.0, 0.707)),  # mscale / mscale_all_dim
        (500000.0, 64, 8.0, 8192, 16.0, 2.0, 1.25, None),  # an explicit attention_factor
        (ROPE_THETA["yarn"], 16, 4.0, ORIGINAL_CONTEXT, 32.0, 1.0, None, None),  # the tiny yarn
    ],
)
def test_yarn_gives_transformers_frequencies(theta, dims, factor, original, fast, slow, attn, mscale) -> None:
    want_attn = attn
    if want_attn is None:
        want_attn = rope_scaling.yarn_attention_factor(factor, *(mscale or (None, None)))
    ours = rope_scaling.yarn(theta, dims, factor, original, fast, slow, want_attn)
    want, want_scale = yarn_inv_freq(
        theta, dims, factor, original, fast, slow, attn, *(mscale or (None, None))
    )
    np.testing.assert_allclose(_inv(theta, dims, ours.freq_factors), want, rtol=RTOL)
    assert ours.attn_factor == pytest.approx(want_scale, rel=1e-7)
    assert (ours.kind, ours.factor, ours.original_context) == ("yarn", factor, original)


def test_longrope_attention_factor_and_tables() -> None:
    """Phi-3.5-mini's shape: 131072 over 4096; its factors pass through as divisors."""
    short, long = [1.0 + i / 100 for i in range(48)], [1.0 + i for i in range(48)]
    attn = rope_scaling.longrope_attention_factor(131072, 4096)
    ours = rope_scaling.longrope(short, long, 96, 4096, attn)
    for table, divisors in ((short, ours.freq_factors), (long, ours.long_factors)):
        want, want_attn = longrope_inv_freq(10000.0, 96, np.asarray(table), 131072, 4096)
        np.testing.assert_allclose(_inv(10000.0, 96, divisors), want, rtol=RTOL)
        assert ours.attn_factor == pytest.approx(want_attn, rel=1e-7)
    assert ours.attn_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-7)
    with pytest.raises(ValueError, match="expected 48"):
        rope_scaling.longrope(short[:10], long, 96, 4096, attn)
