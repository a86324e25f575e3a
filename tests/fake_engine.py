"""Fake engines for the server's tests: the Engine interface without TVM or a checkpoint.

`ScriptedEngine` replies with fixed token pieces (so stop strings, logprobs and usage have exact
expected values); a `gate` holds it in "prefill" until the test opens it, which is how the
queueing, keep-alive, cancellation and unload tests control timing. `SampledEngine` draws its
tokens through the real runtime sampler over fixed pseudo-random logits, to check seeds end to end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from goinfer.runtime.sampler import Sampler, SamplingParams
from goinfer.runtime.stream import StepEvent
from goinfer.serve.engine import ModelInfo

PIECES = ("Hel", "lo", " wor", "ld", "!")


def render(messages: list[dict[str, Any]]) -> str:
    """The fake chat template: one `<role>content` per message, then the generation prompt."""
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class _Base:
    def __init__(self, context_window: int = 64, vocab_size: int = 1000):
        self.info = ModelInfo(
            path="fake.giw",
            quant="f32",
            target="fake",
            context_window=context_window,
            decode_path="fake decode",
            prefill_path="fake prefill",
            family="fake",
            vocab_size=vocab_size,
        )
        self.messages: list[dict[str, Any]] | None = None
        self.params: list[SamplingParams] = []
        self.started = threading.Event()  # a generation reached the engine
        self.finished = threading.Event()  # a generation's iterator was closed or ran out
        self.yielded = 0
        self.closed = False

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        self.messages = messages
        return self.text_ids(render(messages))

    def text_ids(self, text: str) -> list[int]:
        return [ord(c) % self.info.vocab_size for c in text]  # one token per character

    def close(self) -> None:
        self.closed = True


class ScriptedEngine(_Base):
    def __init__(
        self,
        pieces: Sequence[str] = PIECES,
        *,
        context_window: int = 64,
        step_s: float = 0.0,
        gate: threading.Event | None = None,
        fail: bool = False,
    ):
        super().__init__(context_window)
        self.pieces = tuple(pieces)
        self.vocab = sorted(set(self.pieces))
        self.step_s, self.gate, self.fail = step_s, gate, fail

    def token_text(self, token_id: int) -> str:
        return self.vocab[token_id]

    def logprob(self, i: int) -> float:
        return -0.25 * (i + 1)

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, logprobs: int | None
    ) -> Iterator[StepEvent]:
        self.params.append(params)
        self.started.set()
        try:
            if self.gate is not None:
                self.gate.wait(timeout=30)  # a long prefill, until the test lets it finish
            if self.fail:
                raise RuntimeError("kernel exploded at /secret/path.py line 3")
            budget = min(params.max_tokens, self.info.context_window - len(prompt_ids))
            for i, piece in enumerate(self.pieces):
                if i >= budget:
                    yield StepEvent(None, "", None, "length")
                    return
                time.sleep(self.step_s)
                tid = self.vocab.index(piece)
                self.yielded += 1
                if logprobs is None:  # like Model.generate: none unless asked for
                    yield StepEvent(tid, piece)
                    continue
                alts = tuple((t, self.logprob(i) - t) for t in range(min(logprobs, len(self.vocab))))
                yield StepEvent(tid, piece, self.logprob(i), top_logprobs=alts)
            yield StepEvent(None, "", None, "stop")  # the model's end-of-sequence token
        finally:
            self.finished.set()


class SampledEngine(_Base):
    """Tokens drawn by runtime.sampler.Sampler from fixed logits: a seed must reproduce a reply."""

    WORDS = tuple(f" w{i}" for i in range(32))

    def __init__(self, length: int = 24):
        super().__init__()
        self.length = length
        self.logits = np.random.default_rng(0).normal(size=(length, len(self.WORDS)))

    def token_text(self, token_id: int) -> str:
        return self.WORDS[token_id]

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, logprobs: int | None
    ) -> Iterator[StepEvent]:
        sampler = Sampler(params)
        for step in range(min(self.length, params.max_tokens)):
            tok = sampler(self.logits[step])
            yield StepEvent(tok, self.WORDS[tok], -1.0)
        yield StepEvent(None, "", None, "length")
