"""bench.embed's arithmetic, inputs and worker protocol (no model, no torch, no llama.cpp)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import numpy as np

from bench import embed, embed_inputs


def _row(label: str, emb_s: float, query_ms: float, cos_min: float = 1.0) -> dict:
    return {"label": label, "emb_s": emb_s, "tok_s": emb_s * 128, "query_ms": query_ms, "idle_ms": query_ms,
            "cos_min": cos_min, "cos_mean": cos_min}  # fmt: skip


def test_targets_against_st_and_the_faster_llama_row():
    rows = [
        _row("ours q8_0", 150.0, 2.0),
        _row("ours f32", 150.0, 2.0, cos_min=0.998),
        _row("sentence-transformers", 70.0, 8.0),
        _row("llama-server f32", 45.0, 5.0),
        _row("llama-server q8_0", 40.0, 3.5),  # the faster llama row for latency: 1.75x, not 2.5x
    ]
    (ok, line), (bad, why) = embed.targets(rows)
    assert ok and "PASS ours q8_0" in line and "throughput 2.14x st ok" in line
    assert "latency 1.75x llama ok" in line and "throughput 3.33x llama ok" in line
    assert not bad and "cos min 0.99800 >= 0.999 MISSED" in why
    assert not embed.targets([_row("ours f32", 100.0, 2.0), *rows[2:]])[0][0]  # 1.43x st
    lines = embed.table(rows).splitlines()
    assert "xst" in lines[0] and "xl.f32" in lines[0] and "idle ms" in lines[0]
    assert "2.14x" in lines[2] and "4.00x" in lines[2]  # throughput and latency over st


def test_cosines():
    a = np.array([[1.0, 0.0], [0.0, 2.0]], dtype=np.float32)
    b = np.array([[2.0, 0.0], [1.0, 1.0]], dtype=np.float32)
    np.testing.assert_allclose(embed.cosines(a, b), [1.0, np.sqrt(0.5)], rtol=1e-6)


def test_inputs_land_on_their_lengths():
    def tokenize(text: str) -> list[int]:  # a word a token, and two specials
        return [0] * (len(text.split()) + 2)

    batch = embed_inputs.batch(tokenize, 8, 40)
    assert len(set(batch)) == 8 and all(len(tokenize(t)) == 40 for t in batch)
    assert batch == embed_inputs.batch(tokenize, 8, 40)  # deterministic
    assert len(tokenize(embed_inputs.query(tokenize, 12))) == 12
    assert embed_inputs.query(tokenize, 64) == embed_inputs.QUERY_TEXT  # shorter than asked: all of it
    assert len(embed_inputs.SENTENCES) == len(set(embed_inputs.SENTENCES)) == 50


def test_worker_protocol(tmp_path: Path):
    """A worker speaking bench.embed_timing's loop, driven by embed.Worker as the bench drives it
    (from the repo root, where `bench` imports)."""
    out = tmp_path / "v.npy"
    script = textwrap.dedent(f"""
        import numpy as np
        from bench import embed_timing
        embed_timing.SETTLE_S = 0.0
        np.save({str(out)!r}, np.ones((3, 4), dtype=np.float32))
        embed_timing.serve(lambda texts: None, ["a", "b"], "q", {{"batch_tokens": 6}})
    """)
    worker = embed.Worker("fake", [sys.executable, "-c", script], dict(os.environ), out)
    try:
        assert worker.meta == {"batch_tokens": 6} and worker.vectors.shape == (3, 4)
        assert worker.time("batch") >= 0 and worker.time("query") >= 0
        assert len(worker.burst(3)) == 3
    finally:
        worker.close()
    assert worker.proc.returncode == 0  # "quit" ended it
