"""The Engine over a real bundle: runtime.model.Model behind the server's interface."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from goinfer.runtime.grammar import Constraint, GrammarTokenizer
from goinfer.runtime.model import Model
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.stream import StepEvent

from .engine import ModelInfo


class ModelEngine:
    def __init__(self, model: Model, path: str | Path):
        self.model: Model | None = model
        m = model.manifest
        quant, target = m.quant, m.build.target
        where = f"{target}/{model.tier}" if model.tier else target
        self.info = ModelInfo(
            path=str(path),
            quant=quant,
            target=where,
            context_window=model.context_length,
            decode_path=f"{where} {quant} decode (one token per step)",
            prefill_path=f"{where} {quant} prefill (chunks of {m.kv_cache.prefill_chunk} tokens)",
            family=m.family,
            vocab_size=m.model.vocab_size,
            chat_template=model.chat_template,
        )
        # llguidance's tokenizer view takes ~1.7 s for a 152k vocabulary: built now, off the request path.
        self.grammar: GrammarTokenizer | None = model.grammar.start()

    @classmethod
    def load(cls, path: str | Path, self_test: bool | None = None) -> ModelEngine:
        return cls(Model.load(path, self_test=self_test), path)

    def _model(self) -> Model:
        if self.model is None:
            raise RuntimeError("model was unloaded")
        return self.model

    def chat_ids(self, messages: list[dict[str, Any]], **template_vars: Any) -> list[int]:
        return self._model().chat_prompt(messages, add_generation_prompt=True, **template_vars)

    def text_ids(self, text: str) -> list[int]:
        return self._model().encode(text)

    def token_text(self, token_id: int) -> str:
        return self._model().decode([token_id])

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        logprobs: int | None,
        constraint: Constraint | None = None,
        capture: bool = False,
    ) -> Iterator[StepEvent]:
        return self._model().generate(prompt_ids, params, logprobs, constraint, capture)

    def close(self) -> None:
        # The last reference to the weights, kernels and KV cache goes; the mapping is freed with it.
        self.model = None
        self.grammar = None
