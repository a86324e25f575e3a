"""gguf_blocks: decode(...).dequantize() is bit-identical to gguf.quants.dequantize for every type."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from goinfer.compiler.quant.gguf_blocks import DECODABLE, decode

ROWS, COLS = 5, 512
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# The integer range per type; random block bytes reach both ends.
Q_RANGE = {
    "Q4_0": (-8, 7),
    "Q4_1": (0, 15),
    "Q5_0": (-16, 15),
    "Q5_1": (0, 31),
    "Q8_0": (-128, 127),
    "Q4_K": (0, 15),
    "Q5_K": (0, 31),
    "Q6_K": (-32, 31),
}
# Byte offsets of the float16 fields (d, and m/dmin) inside one block.
F16_AT = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_blocks(name: str, rng: np.random.Generator) -> np.ndarray:
    """Random bytes, with every float16 field a finite random half: any sign, exponent, subnormals."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    blocks = rng.integers(0, 256, (ROWS * COLS // block, size), dtype=np.uint8)
    for at in F16_AT.get(name, (0,)):
        bits = rng.integers(0, 1 << 16, len(blocks), dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000  # inf/NaN exponent -> a finite one
        blocks[:, at : at + 2] = bits.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(ROWS, -1)


def _quantized(name: str, rng: np.random.Generator) -> np.ndarray:
    """gguf's own quantizer on rows of very different magnitudes."""
    w = rng.standard_normal((ROWS, COLS)) * 10.0 ** rng.uniform(-6, 4, (ROWS, 1))
    return quantize(w.astype(np.float32), GGMLQuantizationType[name])


def _check(raw: np.ndarray, name: str, *, full_range: bool) -> None:
    want = dequantize(raw, GGMLQuantizationType[name]).reshape(ROWS, COLS)
    d = decode(raw.reshape(-1) if full_range else raw, name, (ROWS, COLS))
    got = d.dequantize()
    assert got.dtype == np.float32 and got.shape == (ROWS, COLS)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))

    lo, hi = Q_RANGE[name]
    assert d.q.dtype == np.int16 and d.q.shape == (ROWS, COLS)
    if full_range:
        assert (d.q.min(), d.q.max()) == (lo, hi)
    else:
        assert lo <= d.q.min() and d.q.max() <= hi
    assert d.group == (16 if name == "Q6_K" else 32)
    assert d.scale.codes.shape == (ROWS, COLS // d.group)
    if name.endswith("_K"):
        assert d.scale.codes.dtype == np.int8 and d.scale.super.shape == (ROWS, COLS // 256)
    else:
        assert d.scale.codes.dtype == np.float16 and d.scale.super is None
    assert (d.min is None) == (name in ("Q4_0", "Q5_0", "Q8_0", "Q6_K"))
    if name in ("Q4_K", "Q5_K"):
        assert min(d.scale.codes.min(), d.min.codes.min()) >= 0
        assert max(d.scale.codes.max(), d.min.codes.max()) <= 63


@pytest.mark.parametrize("name", sorted(DECODABLE))
def test_random_blocks_bit_exact(name: str) -> None:
    _check(_random_blocks(name, np.random.default_rng(0)), name, full_range=True)


@pytest.mark.parametrize("name", LEGACY)
def test_gguf_quantized_bit_exact(name: str) -> None:
    _check(_quantized(name, np.random.default_rng(1)), name, full_range=False)


def test_decodable_is_the_eight_types() -> None:
    assert set(Q_RANGE) == DECODABLE


@pytest.mark.parametrize("name", ["Q2_K", "F16", "NOT_A_TYPE"])
def test_unsupported_type(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        decode(np.zeros(1024, np.uint8), name, (1, 256))


@pytest.mark.parametrize(("name", "cols"), [("Q4_0", 48), ("Q6_K", 512 + 32)])
def test_row_not_whole_blocks(name: str, cols: int) -> None:
    with pytest.raises(ValueError, match=name):
        decode(np.zeros(4096, np.uint8), name, (1, cols))


def test_wrong_byte_count() -> None:
    with pytest.raises(ValueError, match="Q8_0"):
        decode(np.zeros(33, np.uint8), "Q8_0", (1, 64))
