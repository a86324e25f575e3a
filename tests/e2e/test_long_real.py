"""A long document with one fact buried in it (slow tier): the real models give llama.cpp's answer.

Goldens: tests/goldens/long_<model>.json, recorded by tests/goldens/record_long.py with llama-server
(8k window) on the same GGUF: about 6,000 prompt tokens for Qwen and Gemma, 5,000 for SmolLM2,
so the prompt runs in several prefill chunks. The answer is compared token by token as in
test_real_models.py: paths may part only where llama.cpp's own log-probs call it a near-tie.
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
    model = Model.load(real_bundle(name, "int8"))
    ids = case["prompt_ids"]
    assert model.encode(case["prompt"]) == ids
    assert len(ids) > 2 * model.prefill_chunk  # three chunks at least
    ours, want = _greedy(model, ids, len(case["tokens"])), case["tokens"]
    text = model.decode(ours)
    print(f"\n{name}: {len(ids)} prompt tokens; ours {text!r}, llama.cpp {case['text']!r}")
    for step, (a, b) in enumerate(zip(ours, want, strict=False)):
        if a != b:
            top = dict((tid, lp) for tid, lp in case["top_logprobs"][step])
            gap = top[b] - top.get(a, float("-inf"))
            assert gap < TIE, f"step {step}: we chose {a}, llama.cpp {b} by {gap:.2f} nats"
            break
    else:
        assert ours == want
    if case["fact"] in case["text"]:  # llama.cpp found the buried fact: so must we
        assert case["fact"] in text
