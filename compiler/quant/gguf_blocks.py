"""GGUF block decoders: a quantized tensor's raw bytes -> its integers, scales and offsets.

gguf.quants.dequantize only gives floats. A compiler that keeps a checkpoint's own integers (rather
than re-quantizing its float image, which compounds rounding error) needs the integers and per-group
scales themselves, in a form whose float32 arithmetic `scale * q - min` reproduces gguf's
dequantization bit for bit: then a kernel doing that arithmetic is exact by construction, and this
module's `Decoded.dequantize` is the reference it is tested against.

Pure numpy (no TVM). Bit layouts and float op order mirror gguf/quants.py's `dequantize_blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType
from gguf.quants import Q4_K

DECODABLE: frozenset[str] = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})


@dataclass(frozen=True)
class Scales:
    """Per-group float32 values, either stored directly (codes float16, super None) or, for K-quants,
    as int8 codes times a float16 per super-block of 256 weights: value = f32(code) * f32(super)."""

    codes: np.ndarray  # (rows, in/group): float16, or int8 for K-quants
    super: np.ndarray | None  # (rows, in/256) float16 for K-quants, else None

    def values(self, group: int) -> np.ndarray:
        """(rows, in/group) float32. f32(super) * f32(code) is exact: 11 significant bits times <= 8."""
        codes = self.codes.astype(np.float32)
        if self.super is None:
            return codes
        per = QK_K // group
        if codes.shape[-1] != self.super.shape[-1] * per:
            raise ValueError(f"{codes.shape[-1]} codes do not match {self.super.shape[-1]} super-blocks")
        # gguf computes d * sc (super first); multiplication commutes anyway.
        return np.repeat(self.super.astype(np.float32), per, axis=-1) * codes


@dataclass(frozen=True)
class Decoded:
    q: np.ndarray  # (rows, in) int16: the integer per weight
    group: int  # weights per scale along a row: 32, or 16 for Q6_K
    scale: Scales
    min: Scales | None  # None when the type has no offset term

    def dequantize(self) -> np.ndarray:
        """(rows, in) float32 = scale*q - min: one f32 multiply, then one f32 subtract, per weight."""
        rows, n = self.q.shape
        q = self.q.reshape(rows, n // self.group, self.group).astype(np.float32)
        out = self.scale.values(self.group)[..., None] * q
        if self.min is not None:
            out = out - self.min.values(self.group)[..., None]
        return out.reshape(rows, n)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """(..., k*half) bytes -> (..., 2*k*half): per chunk of `half` bytes, the low nibbles then the high."""
    lead = qs.shape[:-1]
    # 8 bytes at a time (half is 16, 32 or 64): a byte's high nibble shifted down stays in it
    words = np.ascontiguousarray(qs).view("<u8").reshape(*lead, -1, 1, half // 8)
    out = np.empty((*words.shape[:-2], 2, half // 8), "<u8")
    np.bitwise_and(words[..., 0, :], 0x0F0F0F0F0F0F0F0F, out=out[..., 0, :])
    np.right_shift(words[..., 0, :], 4, out=out[..., 1, :])
    out[..., 1, :] &= 0x0F0F0F0F0F0F0F0F
    return out.view(np.uint8).reshape(*lead, -1)


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) bytes -> (n,) float16 (little-endian, as gguf reads it)."""
    return np.ascontiguousarray(b).view(np.float16)[:, 0]


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: (n, 4) bytes as a uint32 -> (n, 32) bit j of it, for weight j."""
    # bit j of the little-endian word is bit j % 8 of byte j // 8
    return np.unpackbits(np.ascontiguousarray(qh, dtype=np.uint8), axis=-1, bitorder="little")


def _legacy(blocks: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q4_0..Q8_0 blocks (n, type_size) -> q (n, 32) int16, d (n,) f16, -m (n,) f16 or None."""
    d = _f16(blocks[:, :2])
    neg_m = None
    if name in ("Q4_1", "Q5_1"):
        # gguf adds m; we subtract -m. IEEE defines x - y as x + (-y), and f16 negation is exact,
        # so this is bit-identical (only a NaN m could differ, in its sign bit).
        neg_m = -_f16(blocks[:, 2:4])
    rest = blocks[:, 4 if neg_m is not None else 2 :]
    if name == "Q8_0":
        q = rest.view(np.int8).astype(np.int16)
    elif name in ("Q4_0", "Q4_1"):
        q = _nibbles(rest, 16).astype(np.int16)
    else:
        q = (_nibbles(rest[:, 4:], 16) | (_high_bits32(rest[:, :4]) << np.uint8(4))).astype(np.int16)
    # gguf: d * (u - 8) and d * (u - 16), with the offset applied to the integer: the same as ours.
    if name == "Q4_0":
        q -= 8
    elif name == "Q5_0":
        q -= 16
    return q, d, neg_m


def _k_quant(blocks: np.ndarray, name: str) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K blocks -> q (n, 256) int16, d (n,) f16, dmin (n,) f16, sc and m (n, 8) int8."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4 : 4 + Q4_K.K_SCALE_SIZE]))
    rest = blocks[:, 4 + Q4_K.K_SCALE_SIZE :]
    if name == "Q4_K":
        q = _nibbles(rest, 32)
    else:  # Q5_K: 32 bytes of high bits (bit i of byte j -> weight j of sub-block i), then the nibbles
        qh, qs = rest[:, : QK_K // 8], rest[:, QK_K // 8 :]
        hi = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)
        q = _nibbles(qs, 32) | (hi.reshape(len(blocks), QK_K) << np.uint8(4))
    return q.astype(np.int16), d, dmin, sc.astype(np.int8), m.astype(np.int8)


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K blocks -> q (n, 256) int16 in [-32, 31], sc (n, 16) int8, d (n,) f16."""
    n = len(blocks)
    ql, qh = blocks[:, : QK_K // 2], blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
    sc = np.ascontiguousarray(blocks[:, QK_K // 2 + QK_K // 4 : -2]).view(np.int8)
    d = _f16(blocks[:, -2:])
    lo = _nibbles(ql, 64)  # per 128 weights: 64 low nibbles, then 64 high
    hi = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    hi = (hi & np.uint8(3)).reshape(n, QK_K)
    q = (lo | (hi << np.uint8(4))).astype(np.int16) - 32
    return q, sc, d


def decode(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Decoded:
    """raw: the tensor's bytes as uint8, shape (rows, bytes_per_row) or flat; shape = (rows, in) numpy order.

    Raises ValueError naming the type for a type not in DECODABLE, a row not made of whole blocks, or
    a byte count that does not match the shape."""
    if type_name not in DECODABLE:
        raise ValueError(f"cannot decode GGUF type {type_name}; decodable: {', '.join(sorted(DECODABLE))}")
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rows, n = shape
    if n % block:
        raise ValueError(f"{type_name} needs a row length divisible by {block}, got {n}")
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    nb = n // block
    if data.size != rows * nb * type_size:
        raise ValueError(f"{type_name} {shape} needs {rows * nb * type_size} bytes, got {data.size}")
    blocks = data.reshape(rows * nb, type_size)

    if type_name == "Q6_K":
        q, sc, d = _q6_k(blocks)
        scale = Scales(sc.reshape(rows, nb * 16), d.reshape(rows, nb))
        return Decoded(q.reshape(rows, n), 16, scale, None)
    if type_name in ("Q4_K", "Q5_K"):
        q, d, dmin, sc, m = _k_quant(blocks, type_name)
        scale = Scales(sc.reshape(rows, nb * 8), d.reshape(rows, nb))
        return Decoded(q.reshape(rows, n), 32, scale, Scales(m.reshape(rows, nb * 8), dmin.reshape(rows, nb)))
    q, d, neg_m = _legacy(blocks, type_name)
    low = None if neg_m is None else Scales(neg_m.reshape(rows, nb), None)
    return Decoded(q.reshape(rows, n), 32, Scales(d.reshape(rows, nb), None), low)
