"""A long document with one fact buried in it (slow tier): the real models give llama.cpp's answer.

Goldens: tests/goldens/long_<model>.json, recorded by tests/goldens/record_long.py with llama-server
(8k window) on the same GGUF: about 6,000 prompt tokens for Qwen and Gemma, 5,000 for SmolLM2,
so the prompt runs in several prefill chunks. The answer is compared token by token as in
test_real_models.py, over the answer's line: paths may part only where llama.cpp's own log-probs
call it a near-tie, and the answer must hold the fact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_real_models import MODELS, TIE, _greedy

pytestmark = pytest.mark.slow

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"


@pytest.mark.parametrize("name", MODELS)
def test_a_fact_buried_in_a_long_document_gets_llama_cpps_answer(name, real_bundle) -> None:
    from goinfer.runtime.model import Model

    golden = json.loads((GOLDENS / f"long_{name}.json").read_text())
    (case,) = golden["cases"]
    # int8int8: weights and activations in 8 bits, as llama.cpp computes Q4_K (int8's float
    # activations are the closest to it, but its matmuls are too slow for a 6k-token prefill).
    model = Model.load(real_bundle(name, "int8int8"))
    ids = case["prompt_ids"]
    assert model.encode(case["prompt"]) == ids
    assert len(ids) > 2 * model.prefill_chunk  # three chunks at least
    ours, want = _greedy(model, ids, len(case["tokens"])), _answer(model, case["tokens"])
    text = model.decode(ours)
    print(f"\n{name}: {len(ids)} prompt tokens; ours {text!r}, llama.cpp {case['text']!r}")
    for step, (a, b) in enumerate(zip(ours, want, strict=False)):
        if a != b:
            top = dict((tid, lp) for tid, lp in case["top_logprobs"][step])
            gap = top[b] - top.get(a, float("-inf"))
            assert gap < TIE, f"step {step}: we chose {a}, llama.cpp {b} by {gap:.2f} nats"
            break
    else:
        assert ours[: len(want)] == want
    assert case["fact"] in case["text"]  # llama.cpp found the buried fact, and so must we
    assert case["fact"] in text


def _answer(model, tokens: list[int]) -> list[int]:
    """llama.cpp's tokens up to the end of the answer's line: the stop token, which our events
    leave out, or the first newline (what follows it is the model inventing the next record)."""
    for i, t in enumerate(tokens):
        if t in model.stop_ids or "\n" in model.decode([t]):
            return tokens[:i]
    return tokens
