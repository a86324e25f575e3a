"""The reuse contract on whole models (runtime/kv_pool.py, granule 1): a token's logits are the
same bits whichever forward computed it. A prompt prefilled from any cut point on, after its
prefix was prefilled in other chunks, gives a one-shot prefill's logits at every position; a
decoded token's logits are a prefill's; a batch of prompts cut at different points gives each
its lone logits. Every family, in both KV cache dtypes (gemma3's tiny window is 4 tokens, so
most of its layers attend across page and window edges at every cut); mistral and phi3 with a
window over every layer (8 and 48 tokens; phi3's longrope switching its factors at position 64)."""

from __future__ import annotations

import numpy as np
import pytest
from goinfer.runtime import tvm_runtime as rt
from goinfer.runtime.model import Model

CASES = [(f, d) for f in ("llama", "qwen2", "gemma3", "mistral") for d in ("float32", "float16")]
CASES += [("phi3", "float32"), ("qwen3", "float32")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{d}" for f, d in CASES])
def model(request, tiny_bundle) -> Model:
    family, kv_dtype = request.param
    return Model.load(tiny_bundle(family, "f32", kv_dtype=kv_dtype), self_test=False)


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, n)]


def _feed(m: Model, kv, seq: int, ids: list[int], every_position: bool = False) -> np.ndarray:
    """`ids` appended to `seq` in the bundle's prefill chunks from where it stands: the logits at
    every new position (or the last one's)."""
    outs = [m.run(kv, [seq], [ids[s : s + m.prefill_chunk]], every_position)
            for s in range(0, len(ids), m.prefill_chunk)]  # fmt: skip
    return np.concatenate(outs) if every_position else outs[-1][-1]


def _fresh(m: Model, n_seqs: int = 1):
    kv = m.create_cache(n_seqs, 1024)
    for s in range(n_seqs):
        rt.add_sequence(kv, s)
    return kv


def test_a_prompt_resumed_at_any_token_is_a_one_shot_prefill(model: Model) -> None:
    m = model
    n = 3 * m.prefill_chunk + 37
    ids = _ids(m.spec.vocab_size, n, 1)
    whole = _feed(m, _fresh(m), 0, ids, every_position=True)
    cuts = sorted(
        {1, 16, 17, m.prefill_chunk + 1, n - 1, *np.random.default_rng(2).integers(2, n - 1, 4).tolist()}
    )
    for cut in cuts:
        kv = _fresh(m)
        _feed(m, kv, 0, ids[:cut])
        rest = _feed(m, kv, 0, ids[cut:], every_position=True)
        assert np.array_equal(rest, whole[cut:]), f"resumed at token {cut}"


def test_a_decoded_token_is_a_prefilled_one(model: Model) -> None:
    """Decode steps (the static single-token entry) then a prefill of the same tokens: the same
    logits, so a chat's previous reply is reusable in its next turn."""
    m = model
    ids = _ids(m.spec.vocab_size, 2 * m.prefill_chunk + 5, 3)
    kv = _fresh(m)
    logits, decoded, steps = _feed(m, kv, 0, ids), [], []
    for _ in range(4):
        decoded.append(int(np.argmax(logits)))
        logits = m.run(kv, [0], [[decoded[-1]]])[-1]
        steps.append(logits)
    whole = _feed(m, _fresh(m), 0, ids + decoded, every_position=True)
    assert np.array_equal(np.stack(steps), whole[len(ids) :])


def test_a_batch_cut_at_different_points_gives_each_its_lone_logits(model: Model) -> None:
    m = model
    step = max(1, min(16, m.prefill_chunk // 2))  # a forward's tokens, both sequences', fit one chunk
    a, b = _ids(m.spec.vocab_size, 45 + 4 * step, 4), _ids(m.spec.vocab_size, 7 + 4 * step, 5)
    lone_a = _feed(m, _fresh(m), 0, a, every_position=True)
    lone_b = _feed(m, _fresh(m), 0, b, every_position=True)
    kv = _fresh(m, 2)
    _feed(m, kv, 0, a[:45])  # one mid-page, one on no chunk boundary of its lone run
    _feed(m, kv, 1, b[:7])
    for s in range(0, 4 * step, step):
        pa, pb = a[45 + s : 45 + s + step], b[7 + s : 7 + s + step]
        got = m.run(kv, [0, 1], [pa, pb])
        assert np.array_equal(got[0], lone_a[45 + s + step - 1])
        assert np.array_equal(got[1], lone_b[7 + s + step - 1])
