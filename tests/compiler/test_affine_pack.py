"""quant/affine.py's pack (bytes viewed as words, a slice of rows at a time) against the plain
arithmetic it replaced: every layout, row counts on and off the 16-row block, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from goinfer.compiler.kernels.affine import ROW_BLOCK, Layout
from goinfer.compiler.quant import affine

LAYOUTS = [
    Layout(4, 32, "float16", False, 8),
    Layout(4, 32, "float16", True, 0),
    Layout(4, 32, "int8", True, 0),
    Layout(4, 32, "float32", True, 0),
    Layout(5, 32, "float16", False, 16),
    Layout(5, 32, "int8", True, 0),
    Layout(6, 16, "int8", False, 32),
    Layout(6, 16, "float32", True, 32),
    Layout(8, 32, "float16", False, 128),
    Layout(8, 32, "float16", False, 128, full_range=True),
    Layout(8, 16, "float32", False, 128),
]


def reference_pack(layout: Layout, u, scale, min_=None, super_scale=None, super_min=None):
    """The layout spelled out with int32 arithmetic: shifts and sums, one bit at a time."""
    k = u.shape[1]
    stored = affine.row_blocks(u.astype(np.uint32), layout.zero)  # (blocks, k, 16)
    blocks = stored.shape[0]
    params = {}
    high = None
    if layout.planes:
        above = (stored >> 4).reshape(blocks, k // 32, 32, 1, ROW_BLOCK) >> np.arange(layout.planes)[:, None]
        bits = ((above & 1) << affine.FIFTH_BIT[None, None, :, None, None]).sum(axis=2, dtype=np.uint32)
        high = bits.reshape(blocks, k // 32 * layout.planes, ROW_BLOCK)
        stored = stored & 0xF
    if layout.bits != 8:
        octets = stored.reshape(blocks, k // 8, 2, 4, ROW_BLOCK)
        bytes_ = octets[:, :, 0] | (octets[:, :, 1] << 4)
    else:
        bytes_ = stored.reshape(blocks, k // 4, 4, ROW_BLOCK)
    shifts = (np.arange(4, dtype=np.uint32) * 8)[None, None, :, None]
    params["weight"] = np.ascontiguousarray((bytes_ << shifts).sum(axis=2, dtype=np.uint32))
    if high is not None:
        params["high"] = np.ascontiguousarray(high)
    params["scale"] = affine.row_blocks(scale.astype(layout.code))
    if layout.has_min:
        params["min"] = affine.row_blocks(np.asarray(min_).astype(layout.code))
    if layout.code == "int8":
        params["super_scale"] = affine.row_blocks(np.asarray(super_scale).astype(np.float16))
        if layout.has_min:
            params["super_min"] = affine.row_blocks(np.asarray(super_min).astype(np.float16))
    return params


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.tag)
@pytest.mark.parametrize("rows", [1, 16, 37, 100])
def test_pack_matches_the_plain_arithmetic(layout: Layout, rows: int) -> None:
    rng = np.random.default_rng(rows)
    k = 512
    u = rng.integers(0, 1 << layout.bits, (rows, k)).astype(np.int16)
    g = k // layout.group
    args = (
        rng.random((rows, g)) * 0.1,
        rng.random((rows, g)) if layout.has_min else None,
        (rng.random((rows, k // 256)) * 0.01).astype(np.float16) if layout.code == "int8" else None,
        (rng.random((rows, k // 256)) * 0.01).astype(np.float16)
        if layout.code == "int8" and layout.has_min
        else None,
    )
    got, want = affine.pack(layout, u, *args), reference_pack(layout, u, *args)
    assert list(got) == list(want)
    for key, arr in want.items():
        assert got[key].dtype == arr.dtype and got[key].shape == arr.shape, key
        assert got[key].flags.c_contiguous and got[key].tobytes() == arr.tobytes(), key
    # and the numpy twins read it back
    assert np.array_equal(affine.unpack_u(layout, got["weight"], rows, got.get("high")), u)


def test_pack_refuses_values_out_of_range() -> None:
    layout = Layout(5, 32, "float16", False, 16)
    with pytest.raises(ValueError, match="must lie in"):
        affine.pack(layout, np.full((16, 32), 32, np.int16), np.ones((16, 1)))
