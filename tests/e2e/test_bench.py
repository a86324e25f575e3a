"""The benchmark's arithmetic and argument checks (no model, no llama.cpp)."""

from __future__ import annotations

import math

import numpy as np
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
    assert run.parse_list("int4, int8int8", run.KNOWN_QUANTS, "quant") == ["int4", "int8int8"]
    with pytest.raises(SystemExit, match="unknown model nope"):
        run.parse_list("nope", run.MODELS, "model")
    with pytest.raises(SystemExit, match="unknown quant"):
        run.parse_list("", run.KNOWN_QUANTS, "quant")


class _ScriptedModel:
    """Logits that put probability p_right on the next token of `text` and spread the rest evenly;
    records what each forward pass was fed (one call a chunk, in order)."""

    add_bos, bos_id, vocab = True, 0, 10

    def __init__(self, text: list[int], p_right: float) -> None:
        self.text, self.p_right, self.fed = text, p_right, []

    def prefill_logits(self, ids: list[int]):
        start = len(self.fed) * len(ids)  # chunks come in order, one call each
        self.fed.append(list(ids))
        rest = (1 - self.p_right) / (self.vocab - 1)
        rows = np.full((len(ids), self.vocab), np.log(rest))
        for j in range(len(ids)):
            if start + j + 1 < len(self.text):
                rows[j, self.text[start + j + 1]] = np.log(self.p_right)
        yield rows


def test_perplexity_scores_second_halves_as_llama_perplexity_does():
    from bench import quality

    tokens = list(np.random.default_rng(0).integers(1, 10, 40))
    model = _ScriptedModel(tokens, p_right=0.5)
    lps = list(quality.scored_logprobs(model, tokens, ctx=8, chunks=3))
    # 3 chunks of 8, BOS first in each; positions 4..6 score the tokens at 5..7
    assert [f[0] for f in model.fed] == [0, 0, 0] and [f[1:] for f in model.fed] == [
        tokens[i * 8 + 1 : (i + 1) * 8] for i in range(3)
    ]
    assert [list(t) for _, t in lps] == [tokens[i * 8 + 5 : (i + 1) * 8] for i in range(3)]
    assert quality.perplexity(lps) == pytest.approx(2.0)  # every scored token at p = 0.5
    kl, top1 = quality.against(lps, lps)
    assert kl == pytest.approx(0.0, abs=1e-12) and top1 == 1.0
    worse = list(quality.scored_logprobs(_ScriptedModel(tokens, p_right=0.25), tokens, ctx=8, chunks=3))
    kl, top1 = quality.against(worse, lps)
    assert kl > 0.1 and top1 == 1.0 and quality.perplexity(worse) == pytest.approx(4.0)


def _qrow(quant: str, mb: float, ppl: float, model: str = "m", text: str = "code"):
    from bench import quality

    return quality.Row(model, quant, text, ppl, ppl, 0.0, 1.0, mb, 10.0)


def test_quality_per_byte_frontier():
    from bench import quality

    assert quality.QUANTS[0] == "gguf"  # the default build leads the report
    assert "qwen2.5-coder-1.5b" in run.MODELS and set(quality.DEFAULT_MODELS) <= set(run.MODELS)
    rows = [
        _qrow("f32", 2000.0, 10.0),
        _qrow("int4", 300.0, 11.5),
        _qrow("gguf", 330.0, 10.6),
        _qrow("int4mix", 350.0, 10.8),  # bigger and worse than gguf: off
        _qrow("int8int8", 600.0, 10.6),  # as good as gguf but bigger: off (a tie does not save it)
        _qrow("f32", 2000.0, 9.0, text="seed"),
        _qrow("int4", 300.0, 9.5, text="seed"),
        _qrow("bad", 100.0, float("nan"), text="seed"),  # a failed score: never on, pushes none off
        _qrow("int4", 300.0, 20.0, model="other"),  # alone in its group: on
    ]
    got = [(r.model, r.text, r.quant, ok) for r, ok in quality.frontier(rows)]
    assert got == [
        ("m", "code", "int4", True),
        ("m", "code", "gguf", True),
        ("m", "code", "int4mix", False),
        ("m", "code", "int8int8", False),
        ("m", "code", "f32", True),
        ("m", "seed", "bad", False),
        ("m", "seed", "int4", True),
        ("m", "seed", "f32", True),
        ("other", "code", "int4", True),
    ]
    lines = quality.frontier_table(rows).splitlines()
    assert len(lines) == 2 + len(rows) and "MB/tok" in lines[0]
    assert lines[2].split() == ["m", "code", "int4", "300", "11.500", "*"]
    assert lines[4].split() == ["m", "code", "int4mix", "350", "10.800"]
