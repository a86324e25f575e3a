"""What the server needs from a model: a small interface, so tests can serve a fake one.

An Engine (a decoder) and an Embedder (an encoder) are the two kinds of model served. An Engine's
methods are blocking (TVM calls, tokenizer work); the server calls `generate` from
the model's worker threads (up to --max-concurrent at once) and the tokenizing methods from a
thread pool, never on the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from goinfer.runtime.decode import GenerationRequest, StepEvent
from goinfer.runtime.grammar import GrammarTokenizer
from goinfer.runtime.thinking import ThinkingControl


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
    thinking: ThinkingControl | None = None  # its template's <think> control (runtime/thinking.py)


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

    def generate_choices(
        self, requests: list[GenerationRequest], cancel: threading.Event | None = None
    ) -> list[Iterator[StepEvent]]:
        """OpenAI's `n`: one event stream per request, all of one prompt, each iterated on a thread
        of its own; each stream is what `generate(request)` alone would give (the scheduler
        prefills the prompt once and copies its KV to the others)."""
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


class Embedder(Protocol):
    """What the server needs from an encoder: runtime.encoder.Encoder's interface, served as is.

    `embed_ids` is blocking and CPU-heavy: the server calls it from the encoder's own worker thread
    (embed_queue.py), one call at a time, never on the event loop; `tokenize` from a thread pool."""

    manifest: Any  # artifacts.manifest.Manifest: its quant
    spec: Any  # ModelSpec: family, vocab_size
    dimensions: int  # the vector's width
    max_tokens: int  # positions an input may take, special tokens included
    pooling: str  # "mean" | "cls" | "last"
    prompts: Mapping[str, str]  # task name -> the prefix its inputs get ({} where the card has none)
    device: str
    tier: str | None
    load_seconds: float
    self_test: Any  # runtime.selftest.SelfTestResult | None

    def tokenize(self, text: str) -> list[int]:
        """Text -> ids with the model's special tokens ([CLS] ... [SEP])."""
        ...

    def truncate(self, ids: list[int]) -> list[int]:
        """Cut to max_tokens, keeping the final special token."""
        ...

    def embed_ids(self, inputs: list[list[int]]) -> np.ndarray:
        """(len(inputs), dimensions) float32, L2-normalized; ValueError for an empty input or one
        over max_tokens."""
        ...

    def close(self) -> None:
        """Drop the bundle's mapping; called once no forward runs any more."""
        ...
