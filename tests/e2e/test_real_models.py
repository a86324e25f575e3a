"""The real models (slow tier): bundles built from the zoo's GGUFs, checked against llama.cpp.

Goldens: tests/goldens/generate_<model>.json, recorded by tests/goldens/record_generate.py with
llama-server on the same GGUF (greedy, top-5 log-probs per step). The default gguf mode computes
with the file's own weights, as llama.cpp does; both round activations to 8 bits, in different
groups, so a greedy path may still part ways where two tokens are nearly tied: a divergence is
accepted only where llama.cpp's own log-probs put our token within TIE of its choice. int8 and
int4 re-quantize the weights, and part earlier.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
MODELS = ("qwen2.5-coder-0.5b", "gemma-3-270m", "smollm2-135m")
TIE = 0.5  # nats between llama.cpp's top token and ours where we part (its own 8-bit rounding moves ~0.4)
# gguf, measured: 96/96 (qwen), 63/96 (gemma: parts at gaps 0.02 and 0.07), 77/96 (smollm); with
# the KV cache in float16 (the default since issue 21) smollm 55/96, parting at gaps 0.005, 0.061 and
# 0.148 (one early near-tie costs a whole continuation; its perplexity moved +0.15% on the 0.5B).
GGUF_AGREEMENT = 0.55
# gguf's worst |log-prob difference| on llama.cpp's top-3 first tokens: measured 0.13 (qwen), 0.18
# (gemma), 0.28 (smollm); int8's was 0.21, 0.35 and 0.72.
MAX_LOGPROB_GAP = 0.4
# Share of llama.cpp's greedy tokens we reproduce before a near-tie. int8 (the dequantized GGUF
# re-quantized per row): 53/96 (qwen), 63/96 (gemma), 46/96 (smollm), all at gaps < 0.35.
MIN_AGREEMENT = {"gguf": GGUF_AGREEMENT, "int8": 0.45}


def _golden(name: str) -> dict:
    return json.loads((GOLDENS / f"generate_{name}.json").read_text())


def _greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    from goinfer.runtime.decode import GenerationRequest
    from goinfer.runtime.sampler import SamplingParams

    events = model.generate(GenerationRequest(prompt_ids, SamplingParams(temperature=0, max_tokens=n)))
    return [e.token_id for e in events if e.token_id is not None]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module", params=MODELS)
def name(request) -> str:
    return request.param


@pytest.mark.parametrize("quant", list(MIN_AGREEMENT))
def test_greedy_continuations_agree_with_llama_cpp(name, quant, real_bundle) -> None:
    from goinfer.runtime.model import Model

    golden = _golden(name)
    model = Model.load(real_bundle(name, quant))
    agreed = total = 0
    for case in golden["cases"]:
        # Same prompt tokens as llama.cpp (our tokenizer and BOS rule are tested separately too).
        assert model.encode(case["prompt"]) == case["prompt_ids"], case["prompt"]
        ours = _greedy(model, case["prompt_ids"], len(case["tokens"]))
        want = case["tokens"]
        n = next(
            (i for i, (a, b) in enumerate(zip(ours, want, strict=False)) if a != b), min(len(ours), len(want))
        )
        total += len(want)
        agreed += n
        if n < min(len(ours), len(want)):
            top = dict((tid, lp) for tid, lp in case["top_logprobs"][n])
            gap = top[want[n]] - top.get(ours[n], float("-inf"))
            print(f"\n{name} {quant} {case['prompt']!r}: parts at token {n} (llama.cpp gap {gap:.3f})")
            assert gap < TIE, (
                f"{case['prompt']!r}: step {n} we chose {ours[n]}, llama.cpp {want[n]} by {gap:.2f}"
            )
    share = agreed / total
    print(f"\n{name} {quant}: {agreed}/{total} greedy tokens agree with llama.cpp before a near-tie")
    assert share >= MIN_AGREEMENT[quant]


def test_int4_stays_on_llama_cpp_top_choices(name, real_bundle, request) -> None:
    """int4 re-quantizes a 4-bit source onto another grid, so paths part earlier; each prompt's
    first token must still be one of llama.cpp's top 3. The agreement is printed."""
    from goinfer.runtime.model import Model

    if name == "smollm2-135m":
        # Known: symmetric int4 cannot hold Q4_1's asymmetric (offset) grid, and the 135M model
        # is too small to absorb the error (first tokens leave llama.cpp's top 5). int4mix keeps
        # it at int8. strict: when a better int4 lands, this starts passing and must be unmarked.
        request.applymarker(pytest.mark.xfail(reason="symmetric int4 of a Q4_1 source", strict=True))

    model = Model.load(real_bundle(name, "int4"))
    agreed = total = 0
    for case in _golden(name)["cases"]:
        ours = _greedy(model, case["prompt_ids"], len(case["tokens"]))
        top3 = [tid for tid, _ in case["top_logprobs"][0][:3]]
        assert ours and ours[0] in top3, (
            f"{case['prompt']!r}: first token {ours[:1]} not in llama.cpp's {top3}"
        )
        want = case["tokens"]
        agreed += _common_prefix(ours, want)
        total += len(want)
    print(f"\n{name} int4: {agreed}/{total} greedy tokens agree with llama.cpp before parting")


def test_first_token_logprobs_close_to_llama_cpp(name, real_bundle) -> None:
    from goinfer.runtime.model import Model
    from goinfer.runtime.sampler import log_softmax

    model = Model.load(real_bundle(name, "gguf"))
    worst = 0.0
    for case in _golden(name)["cases"]:
        lp = log_softmax(model.prefill(case["prompt_ids"]))
        for tid, want in case["top_logprobs"][0][:3]:
            worst = max(worst, abs(lp[tid] - want))
    print(f"\n{name} gguf: max |Δ logprob| of llama.cpp's top-3 first tokens: {worst:.3f}")
    assert worst < MAX_LOGPROB_GAP


def test_chat_generation_stops_at_end_of_turn(name, real_bundle) -> None:
    from goinfer.runtime.decode import GenerationRequest
    from goinfer.runtime.model import Model
    from goinfer.runtime.sampler import SamplingParams

    model = Model.load(real_bundle(name, "gguf"))
    ids = model.chat_prompt([{"role": "user", "content": "Say hello in one word."}])
    events = list(model.generate(GenerationRequest(ids, SamplingParams(temperature=0, max_tokens=48))))
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason in ("stop", "length")
    assert text.strip(), "empty reply"
    print(f"\n{name} chat reply: {text!r} ({events[-1].finish_reason})")
