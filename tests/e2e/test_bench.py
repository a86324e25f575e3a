"""The benchmark's arithmetic and argument checks (no model, no llama.cpp)."""

from __future__ import annotations

import math

import pytest

from bench import run


def _row(**kw) -> run.Row:
    base = dict(
        model="m", quant="int4", ours_tg=30.0, peer_tg=20.0, ours_pp=50.0, peer_pp=100.0,
        ours_mb_per_token=300.0, peer_mb_per_token=450.0, bandwidth_gbs=10.0,
        rss_after_load_mb=400.0, bundle_mb=350.0, cold_first_token_s=0.4,
    )  # fmt: skip
    return run.Row(**{**base, **kw})


def test_ratios_and_roofline():
    r = _row()
    assert r.tg_ratio == pytest.approx(1.5) and r.pp_ratio == pytest.approx(0.5)
    # 300 MB/token at 30 tok/s = 9 GB/s of a 10 GB/s machine
    assert r.ours_roofline == pytest.approx(0.9)
    assert r.peer_roofline == pytest.approx(0.9)
    assert math.isnan(run.ratio(1.0, 0.0)) and math.isnan(run.roofline_fraction(1, 1, 0))
    # against the bandwidth over a buffer of the weights' size, where a cache holds part of them
    assert _row(bandwidth_at_size_gbs=18.0).ours_roofline_at_size == pytest.approx(0.5)
    assert math.isnan(r.ours_roofline_at_size)  # not measured


def test_median_and_table():
    assert run.median([3.0, 1.0, 2.0]) == 2.0 and math.isnan(run.median([]))
    text = run.table([_row(), _row(model="other", ours_tg=10.0)])
    lines = text.splitlines()
    assert len(lines) == 4 and "1.50x" in lines[2] and "0.50x" in lines[3] and "90%" in lines[2]
    assert "@size" in lines[0] and "45%" in run.table([_row(bandwidth_at_size_gbs=20.0)]).splitlines()[2]


def test_unknown_names_are_one_line_errors():
    assert run.parse_list("int4, int8int8", run.QUANTS, "quant") == ["int4", "int8int8"]
    with pytest.raises(SystemExit, match="unknown model nope"):
        run.parse_list("nope", run.MODELS, "model")
    with pytest.raises(SystemExit, match="unknown quant"):
        run.parse_list("", run.QUANTS, "quant")
