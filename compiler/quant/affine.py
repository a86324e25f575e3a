"""The numpy half of kernels/affine.py's grouped affine layouts: packing integers and per-group
scales into the row-block layout, and the numpy twins of what the kernels compute, which the tests
and the startup self-test hold them to. Schemes (int4, gguf) decide the integers and scales;
this module only lays them out.
"""

from __future__ import annotations

import numpy as np

from ..kernels.affine import ROW_BLOCK, SUPER, Layout, plane_bit
from .scheme import ParamSpecs

FIFTH_BIT = plane_bit(np.arange(32)).astype(np.uint32)  # per c of a group: its bit in a plane word


def param_specs(layout: Layout, out_features: int, in_features: int) -> ParamSpecs:
    """weight[, high], scale[, min][, super_scale][, super_min]: the kernel's parameter order."""
    layout.check(in_features)
    blocks = -(-out_features // ROW_BLOCK)
    groups = (blocks, in_features // layout.group, ROW_BLOCK)
    specs: ParamSpecs = {"weight": ((blocks, in_features // layout.per_word, ROW_BLOCK), "uint32")}
    if layout.planes:
        specs["high"] = ((blocks, in_features // 32 * layout.planes, ROW_BLOCK), "uint32")
    specs["scale"] = (groups, layout.code)
    if layout.has_min:
        specs["min"] = (groups, layout.code)
    if layout.code == "int8":
        specs["super_scale"] = ((blocks, in_features // SUPER, ROW_BLOCK), "float16")
        if layout.has_min:
            specs["super_min"] = ((blocks, in_features // SUPER, ROW_BLOCK), "float16")
    return specs


def row_blocks(a: np.ndarray, fill: float | int = 0) -> np.ndarray:
    """(rows, cols) -> (ceil(rows/16), cols, 16): row 16b + r at [b, :, r], padded with `fill`."""
    rows, cols = a.shape
    blocks = -(-rows // ROW_BLOCK)
    padded = np.full((blocks * ROW_BLOCK, cols), fill, a.dtype)
    padded[:rows] = a
    return np.ascontiguousarray(padded.reshape(blocks, ROW_BLOCK, cols).transpose(0, 2, 1))


def _unblock(a: np.ndarray, rows: int) -> np.ndarray:
    blocks, cols, _ = a.shape
    return a.transpose(0, 2, 1).reshape(blocks * ROW_BLOCK, cols)[:rows]


def pack(
    layout: Layout,
    u: np.ndarray,
    scale: np.ndarray,
    min_: np.ndarray | None = None,
    super_scale: np.ndarray | None = None,
    super_min: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """u (out, in) stored integers in [0, 2**bits); scale and min (out, in/group) of the layout's
    code type; for int8 codes, super_scale and super_min (out, in/256) float16.

    Every parameter has its row blocks on axis 0, so packing rows 16b.. of a weight gives blocks
    b.. of each parameter: a weight may be packed a slice of rows at a time (quant/gguf.py does).
    The integers stay bytes throughout, and each word is its four bytes viewed as one
    little-endian uint32 (the 0.5B Qwen's embedding took ~0.5 GB an int32 copy as sums of shifts).
    """
    rows, k = u.shape
    if u.min() < 0 or u.max() >= 1 << layout.bits:
        raise ValueError(f"{layout.tag}: stored values must lie in [0, {1 << layout.bits})")
    blocks = -(-rows // ROW_BLOCK)
    stored = np.empty((blocks * ROW_BLOCK, k), np.uint8)
    stored[:rows] = u
    stored[rows:] = layout.zero  # padding rows
    # Row 16b + r's bytes as little-endian words of 4 k: [b, r, k // 4]. Each step below works on
    # whole words (numpy is slow on a 4-byte inner axis), and every word ends up as it is stored.
    quads = stored.view("<u4").reshape(blocks, ROW_BLOCK, k // 4)
    high = None
    if layout.planes:  # row 16b + r's bit 4 + p of group g at high[b, g*planes + p, r], FIFTH_BIT apart
        # plane_bit: k = 32g + 4j + i (byte i of the group's quad j) goes to bit j of byte i
        group_quads = quads.reshape(blocks, ROW_BLOCK, k // 32, 8)
        high = np.zeros((blocks, k // 32, layout.planes, ROW_BLOCK), "<u4")
        for p in range(layout.planes):
            plane = high[:, :, p].transpose(0, 2, 1)  # [b, r, g]
            for j in range(8):
                plane |= ((group_quads[..., j] >> (4 + p)) & 0x01010101) << j
        high = high.reshape(blocks, k // 32 * layout.planes, ROW_BLOCK)
        quads = quads & 0x0F0F0F0F
    if layout.bits != 8:
        # k = 8j + 4*half + byte: byte i of word j holds k = 8j+i low and 8j+4+i high (a nibble
        # shifted left by 4 stays inside its byte)
        halves = quads.reshape(blocks, ROW_BLOCK, k // 8, 2)
        words = np.empty((blocks, k // 8, ROW_BLOCK), "<u4")
        np.left_shift(halves[..., 1].transpose(0, 2, 1), 4, out=words)
        words |= halves[..., 0].transpose(0, 2, 1)
    else:
        words = np.ascontiguousarray(quads.transpose(0, 2, 1))  # (blocks, words, 16)
    params = {"weight": words}
    if high is not None:
        params["high"] = high
    params["scale"] = row_blocks(scale.astype(layout.code))
    if layout.has_min:
        params["min"] = row_blocks(np.asarray(min_).astype(layout.code))
    if layout.code == "int8":
        params["super_scale"] = row_blocks(np.asarray(super_scale).astype(np.float16))
        if layout.has_min:
            params["super_min"] = row_blocks(np.asarray(super_min).astype(np.float16))
    return params


def unpack_u(
    layout: Layout, weight: np.ndarray, out_features: int, high: np.ndarray | None = None
) -> np.ndarray:
    """numpy twin of the layout: the (out, in) stored integers (5 and 6 bits: given `high`)."""
    words = _unblock(weight, out_features)  # (n, words)
    by = (words[..., None] >> (np.arange(4, dtype=np.uint32) * 8)) & 0xFF  # (n, words, byte)
    if layout.bits != 8:
        by = np.stack([by & 0xF, by >> 4], axis=2)  # (n, words, half, byte)
    u = by.reshape(out_features, -1).astype(np.int32)
    if layout.planes:
        planes = _unblock(high, out_features).reshape(out_features, -1, layout.planes, 1)
        bits = (planes >> FIFTH_BIT) & 1  # (n, groups, plane, c)
        for p in range(layout.planes):
            u |= bits[:, :, p].reshape(out_features, -1).astype(np.int32) << (4 + p)
    return u


def _values(layout: Layout, codes: np.ndarray, sup: np.ndarray | None, n: int) -> np.ndarray:
    """(n, in/group) float32 scales or mins, as the kernels form them."""
    v = _unblock(codes, n).astype(np.float32)
    if layout.code == "int8":
        v = v * np.repeat(_unblock(sup, n).astype(np.float32), SUPER // layout.group, axis=1)
    return v


def scales(layout: Layout, params: dict[str, np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(scale, min or None), each (n, in/group) float32."""
    s = _values(layout, params["scale"], params.get("super_scale"), n)
    m = _values(layout, params["min"], params.get("super_min"), n) if layout.has_min else None
    return s, m


def dequantize(layout: Layout, params: dict[str, np.ndarray], n: int) -> np.ndarray:
    """The (n, in) float32 weights, w = scale * (u - zero) - min in float32 ops (the GGUF
    transcode's value-exact claim is about this)."""
    s, m = scales(layout, params, n)
    q = (unpack_u(layout, params["weight"], n, params.get("high")) - layout.zero).astype(np.float32)
    w = np.repeat(s, layout.group, axis=1) * q
    return w - np.repeat(m, layout.group, axis=1) if m is not None else w


def example(layout: Layout, n: int, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random packed parameters over the layout's whole range (q = -128 only where it is full
    range): kernel fixtures for the tests and the startup self-test."""
    rng = np.random.default_rng(seed)
    low = 0 if layout.bits != 8 or layout.full_range else 1
    u = rng.integers(low, 1 << layout.bits, (n, k))
    if layout.full_range:
        u[0, :4] = 0  # q = -128
    g = k // layout.group
    if layout.code == "int8":
        s, m = rng.integers(-63, 64, (n, g)), rng.integers(0, 64, (n, g))
        sup = [(rng.random((n, k // SUPER)) * 0.01).astype(np.float16) for _ in range(2)]
    else:
        s, m = rng.random((n, g)) * 0.02, rng.random((n, g)) * 0.1
        sup = [None, None]
    return pack(layout, u, s, m if layout.has_min else None, sup[0], sup[1] if layout.has_min else None)


def quantize_activations(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy twin of the kernels' prologue: int8 per group and one float32 scale per group."""
    m, k = x.shape
    g = x.reshape(m, k // group, group)
    amax = np.abs(g).max(axis=-1)
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    inv = np.float32(1) / s  # the kernels multiply by the reciprocal, rounded as here
    q = np.clip(np.rint(g * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(m, k), s


def reference(layout: Layout, x: np.ndarray, params: dict[str, np.ndarray], n: int) -> np.ndarray:
    """What the kernels compute for n output rows, in numpy: exact integer sums per group, rescaled
    in float64."""
    m, k = x.shape
    gs = layout.group
    xq, xs = quantize_activations(x, gs)
    xq = xq.astype(np.int64).reshape(m, k // gs, gs)
    u = unpack_u(layout, params["weight"], n, params.get("high"))
    q = (u.astype(np.int64) - layout.zero).reshape(n, k // gs, gs)
    dots = np.einsum("tgk,ngk->tng", xq, q).astype(np.float64)
    s, mn = scales(layout, params, n)
    y = dots * xs.astype(np.float64)[:, None, :] * s.astype(np.float64)[None]
    if mn is not None:
        y -= (xs.astype(np.float64) * xq.sum(axis=-1))[:, None, :] * mn.astype(np.float64)[None]
    return y.sum(axis=-1).astype(np.float32)
