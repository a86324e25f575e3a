"""--spec ngram and --drafter (Qwen2.5-Coder-0.5B, int4, as `serve --drafter` builds it) on both
Qwen coders: 20 prompts each (edits that copy code back, where drafts are taken, and questions,
where few are), greedy, every reply token for token plain decoding's; and drafts are made and
accepted. Through the scheduler, as the server runs it."""

from __future__ import annotations

import logging

import pytest
from goinfer.runtime.decode import GenerationRequest
from goinfer.runtime.model import Model
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.scheduler import Scheduler, SchedulerConfig

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
FUNCS = [
    "def area(w, h):\n    return w * h\n",
    "def mean(xs):\n    total = sum(xs)\n    return total / len(xs)\n",
    "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n"
    "    if x > hi:\n        return hi\n    return x\n",
    "def words(text):\n    parts = text.split()\n    return [p.lower() for p in parts]\n",
    "class Counter:\n    def __init__(self):\n        self.n = 0\n\n"
    "    def add(self):\n        self.n += 1\n",
]
ASKS = [
    "Return this code unchanged.",
    "Rename every variable to a longer, clearer name and return the code.",
    "Add type hints and return the code.",
    "What does this code do? One sentence.",
]


def prompts(m: Model) -> list[list[int]]:
    return [
        m.chat_prompt([{"role": "user", "content": f"```python\n{code}```\n{ask}"}])
        for code in FUNCS
        for ask in ASKS
    ]


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_speculation_replies_are_plain_decodings(real_bundle, name: str, caplog) -> None:
    m = Model.load(real_bundle(name))
    drafter = str(real_bundle("qwen2.5-coder-0.5b", "int4"))
    plain = Scheduler(m, SchedulerConfig(kv_sessions=0, kv_tokens=4096))
    try:
        want = [[e.token_id for e in plain.generate(GenerationRequest(ids, GREEDY))] for ids in prompts(m)]
    finally:
        plain.stop()
    for how in ({"spec": "ngram"}, {"drafter": drafter}):
        spec = Scheduler(m, SchedulerConfig(kv_sessions=0, kv_tokens=4096, **how))
        caplog.clear()
        try:
            with caplog.at_level(logging.INFO, logger="goinfer.runtime"):
                for i, ids in enumerate(prompts(m)):
                    got = [e.token_id for e in spec.generate(GenerationRequest(ids, GREEDY))]
                    assert got == want[i], f"{how}: prompt {i}"
                spec.sync()
        finally:
            spec.stop()
        counts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("speculation:")]
        accepted = sum(int(line.split(", ")[1].split()[0]) for line in counts)
        assert len(counts) == len(prompts(m)) and accepted > 0, (how, counts)
