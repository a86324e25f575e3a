"""gguf: the checkpoint's own quantization, transcoded value-exact (the default for GGUF sources).

Re-quantizing a Q4_K or Q5_0 weight's float image onto another grid compounds two roundings: the
0.5B Qwen lost 8% perplexity to our int4 that way, Gemma 3 76%. Every common GGUF block type is
affine over small groups, so this scheme keeps the file's own integers and scales, laid out for the
grouped affine kernels (kernels/affine.py); each weight dequantizes to the float32 gguf gives, bit
for bit (quant/gguf_blocks.py holds that arithmetic, the tests hold this to it; one exception: a
Q4_0 part fused beside a type with a min gives +0 where gguf gives -0):

    Q4_0, Q4_1, Q4_K   4-bit nibbles, group 32: a float16 scale (and min) per group, or K-quant
                       6-bit codes (int8) times a float16 per 256
    Q5_0, Q5_1, Q5_K   the same nibbles, plus a 32-bit word of fifth bits per group (a bit plane,
                       ordered for the kernel): 5.5 bits a weight for Q5_0, as in the file
    Q6_K               two such planes: 6 bits, group 16, K-quant codes (6.56 bits as in the file)
    Q8_0               8-bit bytes u = q + 128, group 32

Weights fused into one matmul (q, k and v; gate and up) share the widest layout that holds each
part exactly (more bits beat fewer, group 16 beats 32, and float32 values where one part has
K-quant codes and another float16 scales: both are exact in float32). The models fuse only parts
of one layout, so none is stored wider than its own (models/layers.py `scheme_runs`: Qwen's Q5_0
q and k beside a Q8_0 v are two matmuls, not one at 8 bits).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tvm import tirx

from ..kernels import affine as tir
from ..kernels.affine import Layout
from ..sources.base import SourceTensor
from . import affine, gguf_blocks
from .scheme import ParamSpecs, TeLinear

NAME = "gguf"
# type -> (bits stored, group, code type, has a min)
_NATIVE: dict[str, tuple[int, int, str, bool]] = {
    "Q4_0": (4, 32, "float16", False),
    "Q4_1": (4, 32, "float16", True),
    "Q4_K": (4, 32, "int8", True),
    "Q5_0": (5, 32, "float16", False),
    "Q5_1": (5, 32, "float16", True),
    "Q5_K": (5, 32, "int8", True),
    "Q6_K": (6, 16, "int8", False),
    "Q8_0": (8, 32, "float16", False),
}
_SIGNED_OFFSET = {"Q4_0": 8, "Q5_0": 16}  # the types whose q is signed, without a min


def layout_for(parts: Sequence[SourceTensor]) -> Layout | None:
    """The layout holding every part exactly, or None when some part's type has none."""
    if not parts or any(p.source_type not in _NATIVE or p.raw is None for p in parts):
        return None
    native = [_NATIVE[p.source_type] for p in parts]
    bits = max(n[0] for n in native)
    codes = {n[2] for n in native}
    has_min = any(n[3] for n in native)
    # 4 and 5 bits: Q4_0 and Q5_0 alone keep their signed values (zero 8 or 16); beside a type
    # with a min, d * (u - 8) becomes d * u - 8d (16d), exact, and every value is stored as read.
    # 6 and 8 bits: every type's q, signed or not, fits beside zero 32 (128).
    zero = {6: 32, 8: 128}.get(bits, 0 if has_min else 1 << (bits - 1))
    return Layout(
        bits=bits,
        group=min(n[1] for n in native),
        code=codes.pop() if len(codes) == 1 else "float32",
        has_min=has_min,
        zero=zero,
        full_range=bits == 8 and any(_has_minus_128(p) for p in parts),
    )


def _has_minus_128(t: SourceTensor) -> bool:
    """Q8_0 alone can store -128 (gguf's quantizer gives [-127, 127], the format allows it)."""
    if t.source_type != "Q8_0":
        return False
    blocks = np.asarray(t.raw()).reshape(-1, 34)  # 2 bytes of float16 d, 32 int8
    step = 1 << 16  # blocks at a time: the comparison's temporary stays small
    found = any(bool((blocks[i : i + step, 2:] == 0x80).any()) for i in range(0, len(blocks), step))
    release_pages(blocks)  # read again when packed, a slice at a time
    return found


@dataclass(frozen=True)
class Transcode:
    """The Scheme for one weight (several fused parts) in its layout."""

    layout: Layout

    @property
    def NAME(self) -> str:
        return f"{NAME}:{self.layout.tag}"

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return affine.param_specs(self.layout, out_features, in_features)

    def pack(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        raise TypeError("gguf transcodes a checkpoint's blocks: use transcode(parts)")

    def transcode(self, parts: Sequence[SourceTensor]) -> dict[str, np.ndarray]:
        """The parts' blocks, rows concatenated, in this layout: value-exact."""
        return transcode(self.layout, parts)

    def rows(self, parts: Sequence[SourceTensor]) -> Rows:
        """The same, to transcode a slice of rows at a time."""
        return Rows(self.layout, parts)

    def matmul(self, out_features: int, in_features: int) -> tirx.PrimFunc | TeLinear:
        return tir.kernel(out_features, in_features, self.layout)

    @property
    def take(self):
        return tir.take(self.layout)


def transcode(layout: Layout, parts: Sequence[SourceTensor]) -> dict[str, np.ndarray]:
    return Rows(layout, parts).pack(0, sum(p.shape[0] for p in parts))


# Rows a piece when a weight is transcoded in pieces: ~1M weights, a few MB of temporaries each.
PIECE_WEIGHTS = 1 << 20


class Rows:
    """A weight's parts (rows concatenated) to transcode a slice of rows at a time: every packed
    parameter has its row blocks on axis 0, so slices of whole blocks give consecutive blocks of
    each, which concatenated are the whole weight's (quant/affine.py)."""

    def __init__(self, layout: Layout, parts: Sequence[SourceTensor]):
        self.layout, self.parts = layout, list(parts)
        # (rows, bytes per row): mmap views, asked for once a weight (a llama q or k is a copy)
        self.raws = [np.asarray(p.raw()).reshape(p.shape[0], -1) for p in self.parts]
        starts = np.cumsum([0] + [p.shape[0] for p in self.parts])
        self.spans = list(zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True))
        self.rows = int(starts[-1])

    def release(self) -> None:
        """Done with the parts' blocks: drop their pages from this process's memory map (the file
        stays in the page cache). A build reads every block once, and the mapped checkpoint would
        otherwise count in full against its peak RSS (the 0.5B's: 491 MB of its ~1 GB)."""
        for raw in self.raws:
            release_pages(raw)
        self.raws = []

    def pieces(self, weights: int = PIECE_WEIGHTS) -> list[tuple[int, int]]:
        """(start, stop) row slices of whole row blocks (the last may end mid-block), in order."""
        k = self.parts[0].shape[-1]
        step = max(tir.ROW_BLOCK, weights // k // tir.ROW_BLOCK * tir.ROW_BLOCK)
        return [(r, min(r + step, self.rows)) for r in range(0, self.rows, step)]

    def pack(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows start..stop (start on a row block) in the layout: their blocks of each parameter."""
        pieces = []
        for part, raw, (lo, hi) in zip(self.parts, self.raws, self.spans, strict=True):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                decoded = gguf_blocks.decode(raw[a - lo : b - lo], part.source_type, (b - a, part.shape[-1]))
                pieces.append(_in_layout(self.layout, part.source_type, decoded))
        if len(pieces) == 1:
            return affine.pack(self.layout, *pieces[0])
        stacked = [None if pieces[0][i] is None else np.concatenate([p[i] for p in pieces]) for i in range(5)]
        return affine.pack(self.layout, *stacked)


def release_pages(arr: np.ndarray) -> None:
    """MADV_DONTNEED the pages under `arr` where it is a view of a read-only file mapping (an
    np.memmap's): they are read again from the page cache if touched. Anything else: nothing."""
    base = arr
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if base is None or not hasattr(mmap, "MADV_DONTNEED") or arr.size == 0 or base.closed:
        return
    start = arr.__array_interface__["data"][0] - np.frombuffer(base, np.uint8, 1).ctypes.data
    end = start + arr.nbytes if arr.flags.c_contiguous else len(base)
    first, last = (
        start // mmap.PAGESIZE * mmap.PAGESIZE,
        min(len(base), -(-end // mmap.PAGESIZE) * mmap.PAGESIZE),
    )
    with contextlib.suppress(OSError, ValueError):
        base.madvise(mmap.MADV_DONTNEED, first, last - first)


def _in_layout(layout: Layout, type_name: str, d: gguf_blocks.Decoded) -> tuple[np.ndarray | None, ...]:
    """One part's (u, scale, min, super_scale, super_min) in `layout`'s terms."""
    rows, k = d.q.shape
    # a signed type in a layout with a min: its offset goes into the min (Q4_0: 8d, Q5_0: 16d)
    offset = _SIGNED_OFFSET.get(type_name, 0) if layout.zero == 0 else 0
    u = d.q + np.int16(offset or layout.zero)  # in [0, 256): int16 holds it
    repeat = d.group // layout.group  # a part with groups of 32 in a layout of 16: codes twice

    def per_group(s: gguf_blocks.Scales | None, native: np.ndarray | None = None) -> tuple:
        """(codes, super) of one scale or min in the layout's code type; absent terms are zeros."""
        groups = (rows, k // layout.group)
        if layout.code == "float32":
            v = native if native is not None else s.values(d.group) if s is not None else None
            return (np.zeros(groups, np.float32) if v is None else np.repeat(v, repeat, axis=1)), None
        if layout.code == "int8":
            if s is None:
                return np.zeros(groups, np.int8), np.zeros((rows, k // tir.SUPER), np.float16)
            return np.repeat(s.codes, repeat, axis=1).astype(np.int8), s.super.astype(np.float16)
        if native is not None:
            return np.repeat(native, repeat, axis=1), None
        return (np.zeros(groups, np.float16) if s is None else np.repeat(s.codes, repeat, axis=1)), None

    scale, super_scale = per_group(d.scale)
    offset_min = None
    if offset:  # the offset times d as a min: exact (a power-of-two multiple), checked in float16
        offset_min = d.scale.values(d.group) * np.float32(offset)
        if layout.code == "float16":
            offset_min = offset_min.astype(np.float16)
            if not np.isfinite(offset_min).all():
                raise ValueError(f"{type_name} scale too large to hold {offset} * d in float16")
    min_, super_min = per_group(d.min, offset_min) if layout.has_min else (None, None)
    return u, scale, min_, super_scale, super_min
