"""What the server needs from a model: a small interface, so tests can serve a fake one.

An Engine's methods are blocking (TVM calls, tokenizer work); the server calls `generate` from
the model's worker threads (up to --max-concurrent at once) and the tokenizing methods from a
thread pool, never on the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from goinfer.runtime.decode import GenerationRequest, StepEvent
from goinfer.runtime.grammar import GrammarTokenizer


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
    chat_template: str = ""  # the checkpoint's own (it decides the tool-call format)
    selftest: dict[str, Any] | None = None  # the load's self-test (CPU tier or GPU), for /health
    decisions: bool = False  # answers /v1/systemone (label scoring: `score` and `label_ids`)


class Engine(Protocol):
    info: ModelInfo
    grammar: GrammarTokenizer | None  # None: no grammar-constrained decoding on this engine

    def chat_ids(self, messages: list[dict[str, Any]], **template_vars: Any) -> list[int]:
        """Messages -> prompt ids through the model's own chat template, generation prompt added;
        `template_vars` are extra template variables (tools, enable_thinking). A prompt that
        cannot fit the context window may be refused before it is tokenized in full
        (runtime.prompt.PromptTooLong)."""
        ...

    def text_ids(self, text: str) -> list[int]:
        """Raw text -> prompt ids (BOS per the checkpoint's rule); refused as `chat_ids`."""
        ...

    def token_text(self, token_id: int) -> str: ...

    def generate(
        self, request: GenerationRequest, cancel: threading.Event | None = None
    ) -> Iterator[StepEvent]:
        """Token events as runtime.model.Model.generate yields them (the final one has finish_reason
        and timings, cached_tokens among them); `cancel` set stops the run at its next step
        (runtime.scheduler.Cancelled)."""
        ...

    def score(self, prompt_ids: list[int], cancel: threading.Event | None = None) -> tuple[Any, int]:
        """(logits after the prompt's last token as a (vocab,) array, tokens reused): a prefill, no
        decode; the prompt stays warm for the next that shares its prefix. Where info.decisions."""
        ...

    def label_ids(self, labels: list[str]) -> list[int]:
        """Each label's first token id as the model would write it, BOS never added."""
        ...

    def stats(self) -> dict[str, int]:
        """The KV cache's state for /health (sessions, pages); {} where there is none."""
        ...

    def close(self) -> None:
        """Drop the model's memory; called once no request uses it any more."""
        ...
