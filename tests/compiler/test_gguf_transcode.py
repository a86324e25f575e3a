"""The gguf scheme: each block type, and fused weights of mixed types, transcoded into the grouped
affine layouts dequantize to the float32 values gguf gives, bit for bit; and the layout it picks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from goinfer.compiler.kernels.affine import Layout
from goinfer.compiler.quant import affine, f32, gguf, int8int8, scheme_for
from goinfer.compiler.sources.base import SourceTensor

COLS = 512
# Byte offsets of the float16 fields (d, and m/dmin) inside one block.
F16_AT = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _tensor(name: str, rows: int, seed: int, *, minus_128: bool = False) -> SourceTensor:
    """Random valid blocks of `name` (float16 fields finite, of modest size), as the source gives."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    blocks = rng.integers(0, 256, (rows * COLS // block, size), dtype=np.uint8)
    for at in F16_AT.get(name, (0,)):
        halves = (rng.standard_normal(len(blocks)) * 10.0 ** rng.uniform(-4, 0, len(blocks))).astype(
            np.float16
        )
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    if name == "Q8_0" and not minus_128:
        q = blocks[:, 2:]
        q[q == 0x80] = 0x81
    raw = blocks.reshape(rows, -1)
    return SourceTensor(
        name=f"{name}.{seed}",
        shape=(rows, COLS),
        source_type=name,
        bits=size * 8 / block,
        load=lambda: dequantize(raw, GGMLQuantizationType[name]).reshape(rows, COLS),
        raw=lambda: raw,
    )


def _exact(parts: list[SourceTensor]) -> Layout:
    scheme = scheme_for("gguf", parts)
    assert isinstance(scheme, gguf.Transcode), scheme
    packed = scheme.transcode(parts)
    rows = sum(p.shape[0] for p in parts)
    assert {k: (v.shape, str(v.dtype)) for k, v in packed.items()} == scheme.param_specs(rows, COLS)
    got = affine.dequantize(scheme.layout, packed, rows)
    want = np.concatenate([p.load() for p in parts])
    # Equal values; the bits too but for the sign of some zeros (Q4_0 beside a min type: d*u - 8d
    # is +0 where gguf's d*(u - 8) is -0 for a negative d), which no product can tell apart.
    assert np.isfinite(want).all() and np.array_equal(got, want)
    if any(len(names_of(parts)) > 1 and signed in names_of(parts) for signed in ("Q4_0", "Q5_0")):
        return scheme.layout
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    return scheme.layout


def names_of(parts: list[SourceTensor]) -> set[str]:
    return {p.source_type for p in parts}


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("Q4_0", Layout(4, 32, "float16", False, 8)),
        ("Q4_1", Layout(4, 32, "float16", True, 0)),
        ("Q4_K", Layout(4, 32, "int8", True, 0)),
        ("Q5_0", Layout(5, 32, "float16", False, 16)),
        ("Q5_1", Layout(5, 32, "float16", True, 0)),
        ("Q5_K", Layout(5, 32, "int8", True, 0)),
        ("Q6_K", Layout(6, 16, "int8", False, 32)),
        ("Q8_0", Layout(8, 32, "float16", False, 128)),
    ],
)
def test_each_block_type_is_value_exact_in_its_own_layout(name: str, layout: Layout) -> None:
    assert _exact([_tensor(name, 37, 0)]) == layout  # 37 rows: a padded last row block


@pytest.mark.parametrize(
    ("names", "layout"),
    [
        # Qwen-0.5B's qkv: Q5_0 q and k, a Q8_0 v
        (("Q5_0", "Q5_0", "Q8_0"), Layout(8, 32, "float16", False, 128)),
        # Qwen-1.5B's: Q4_K q and k, a Q6_K v -> 6 bits, groups of 16, K codes with a min
        (("Q4_K", "Q4_K", "Q6_K"), Layout(6, 16, "int8", True, 32)),
        (("Q5_K", "Q6_K"), Layout(6, 16, "int8", True, 32)),
        (("Q6_K", "Q8_0"), Layout(8, 16, "float32", False, 128)),
        # Q4_0 beside a min type: d * (u - 8) as d * u - 8d
        (("Q4_0", "Q4_1"), Layout(4, 32, "float16", True, 0)),
        # float16 scales beside K codes: float32 values hold both
        (("Q4_0", "Q4_K"), Layout(4, 32, "float32", True, 0)),
        (("Q5_1", "Q6_K"), Layout(6, 16, "float32", True, 32)),
        # 5 bits: Q4_0 inside Q5_0's signed range; Q5_0 beside a min type: 16d as its min
        (("Q5_0", "Q4_0"), Layout(5, 32, "float16", False, 16)),
        (("Q5_0", "Q4_1"), Layout(5, 32, "float16", True, 0)),
    ],
)
def test_fused_parts_of_mixed_types_share_a_layout_that_holds_each_exactly(names, layout) -> None:
    assert _exact([_tensor(n, 16 + 5 * i, i) for i, n in enumerate(names)]) == layout


def test_q8_0_with_minus_128_is_marked_full_range() -> None:
    """AVX2's sign trick cannot negate -128, so such a weight takes that tier's portable steps."""
    layout = _exact([_tensor("Q8_0", 20, 3, minus_128=True)])
    assert layout.full_range
    assert not _exact([_tensor("Q8_0", 20, 3)]).full_range


def test_float_and_unencodable_parts_fall_back() -> None:
    q5 = _tensor("Q5_0", 16, 0)
    half = SourceTensor("h", (16, COLS), "F16", 16, q5.load)
    iq = SourceTensor("iq", (16, COLS), "IQ4_XS", 4.25, q5.load)
    assert scheme_for("gguf", [half]) is f32
    assert scheme_for("gguf", [q5, half]) is f32  # a float part keeps the whole fused weight exact
    assert scheme_for("gguf", [iq]) is int8int8  # no affine form: re-quantized


def test_scheme_names_carry_the_layout() -> None:
    """The compile cache and the manifest key on the name: each layout is its own kernel."""
    names = {scheme_for("gguf", [_tensor(n, 16, 0)]).NAME for n in ("Q4_1", "Q5_0", "Q6_K")}
    assert names == {"gguf:u4-g32-float16-z0-min", "gguf:u5-g32-float16-z16", "gguf:u6-g16-int8-z32"}


@pytest.mark.parametrize(
    "names", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K"), ("Q4_0", "Q4_1"), ("Q5_K",)]
)
def test_slices_of_rows_concatenate_to_the_whole_weight(names) -> None:
    """A build packs a weight a slice of row blocks at a time (quant/gguf.py `Rows`): the slices'
    parameters, concatenated, are the whole weight's, byte for byte, whichever part each slice
    starts or ends in (37, 21, 53 rows: part boundaries inside row blocks)."""
    parts = [_tensor(n, (37, 21, 53)[i], i) for i, n in enumerate(names)]
    scheme = scheme_for("gguf", parts)
    whole = scheme.transcode(parts)
    rows = scheme.rows(parts)
    for weights in (16 * COLS, 48 * COLS, 10**9):  # one block a slice, three, all
        pieces = [rows.pack(a, b) for a, b in rows.pieces(weights)]
        assert all(a % 16 == 0 for a, _b in rows.pieces(weights))
        for key, arr in whole.items():
            got = np.concatenate([p[key] for p in pieces])
            assert got.dtype == arr.dtype and got.shape == arr.shape and got.tobytes() == arr.tobytes(), key


def _matmuls(linear) -> list:
    """The QLinears a fused weight is built as, in order."""
    from goinfer.compiler.models.layers import QLinear

    return [linear] if isinstance(linear, QLinear) else linear.linears


def _fused_linear(quant: str, names: tuple[str, ...]) -> tuple[dict[str, SourceTensor], list]:
    """Parts of these types (whole row blocks each), and the QLinears `quant` builds them as."""
    from goinfer.compiler.models.layers import fused_linear

    parts = {f"blk.0.{i}": _tensor(n, 16 * (i + 1), i) for i, n in enumerate(names)}
    rows = sum(p.shape[0] for p in parts.values())
    linear = fused_linear(lambda ps: scheme_for(quant, ps), parts, COLS, rows, tuple(parts))
    return parts, _matmuls(linear)


def _packed_bytes(scheme, parts: list[SourceTensor]) -> int:
    return sum(a.nbytes for a in scheme.transcode(parts).values())


@pytest.mark.parametrize(
    ("names", "runs"),
    [
        (("Q4_K", "Q4_K", "Q6_K"), [2, 1]),  # Qwen-1.5B's qkv: q and k at 4 bits, not 6 in groups of 16
        (("Q5_0", "Q5_0", "Q8_0"), [2, 1]),  # Qwen-0.5B's: q and k at 5 bits, not 8
        (("Q4_0", "Q4_1"), [1, 1]),  # no min stored for Q4_0
        (("Q8_0", "Q5_0", "Q8_0"), [1, 1, 1]),  # runs of neighbours: the outputs keep their order
        (("Q5_0", "Q5_0", "Q5_0"), [3]),
    ],
)
def test_fused_parts_of_mixed_types_split_into_matmuls_in_their_own_layouts(names, runs) -> None:
    """Each part is stored as it would be alone: its own layout and bytes, fewer than in the one
    layout holding them all. Neighbours of one layout stay fused in one matmul."""
    parts, matmuls = _fused_linear("gguf", names)
    assert [len(q.sources) for q in matmuls] == runs
    assert [n for q in matmuls for n in q.sources] == list(parts)
    for q in matmuls:
        assert {scheme_for("gguf", [parts[n]]) for n in q.sources} == {q.scheme}
    split = sum(sum(a.nbytes for a in q.pack(parts).values()) for q in matmuls)
    own = sum(_packed_bytes(scheme_for("gguf", [p]), [p]) for p in parts.values())
    whole = list(parts.values())
    assert split == own
    assert (split < _packed_bytes(scheme_for("gguf", whole), whole)) == (len(runs) > 1)


@pytest.mark.parametrize(
    ("quant", "runs"),
    [("int4", [3]), ("int8", [3]), ("int8int8", [3]), ("f32", [3]), ("int4mix", [2, 1])],
)
def test_the_requantizing_modes_split_only_where_their_schemes_differ(quant, runs) -> None:
    """These give each part the mode's one scheme, so the weight stays one matmul; but int4mix's
    4-bit q and k beside a 6-bit v split like gguf's: int4 beside int8 (all int8 when fused)."""
    _parts, matmuls = _fused_linear(quant, ("Q4_K", "Q4_K", "Q6_K"))
    assert [len(q.sources) for q in matmuls] == runs
