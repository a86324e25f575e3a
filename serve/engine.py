"""What the server needs from a model: a small interface, so tests can serve a fake one.

An Engine's methods are blocking (TVM calls, tokenizer work); the server calls `generate` only
from that model's own worker thread and the tokenizing methods from a thread pool, never on the
event loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.stream import StepEvent


@dataclass(frozen=True)
class ModelInfo:
    path: str
    quant: str
    target: str
    context_window: int  # the exact prompt + completion limit a request is held to
    decode_path: str  # what runs each decode step (target, CPU tier, quant)
    prefill_path: str
    family: str = ""
    vocab_size: int = 0  # token ids a completions prompt may use (0: unchecked)
    vision: bool = False  # no model here accepts image parts yet


class Engine(Protocol):
    info: ModelInfo

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Messages -> prompt ids through the model's own chat template, generation prompt added."""
        ...

    def text_ids(self, text: str) -> list[int]:
        """Raw text -> prompt ids (BOS per the checkpoint's rule)."""
        ...

    def token_text(self, token_id: int) -> str: ...

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, logprobs: int | None
    ) -> Iterator[StepEvent]:
        """Token events as runtime.model.Model.generate yields them (the final one has finish_reason);
        `logprobs` None: no log-probabilities, k: each token's and its k top alternatives."""
        ...

    def close(self) -> None:
        """Drop the model's memory; called once no request uses it any more."""
        ...
