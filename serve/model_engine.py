"""The Engine over a real bundle: runtime.model.Model behind the server's interface, its
generations run by the model's scheduler (many at once, prefixes reused, runtime/scheduler.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from goinfer.runtime.decode import GenerationRequest, StepEvent
from goinfer.runtime.grammar import GrammarTokenizer
from goinfer.runtime.model import Model
from goinfer.runtime.scheduler import Scheduler, SchedulerConfig

from .engine import ModelInfo


class ModelEngine:
    def __init__(self, model: Model, path: str | Path, config: SchedulerConfig | None = None):
        config = config or SchedulerConfig()
        self.model: Model | None = model
        self.scheduler: Scheduler | None = Scheduler(model, config)  # it applies --ctx to the model
        s = self.scheduler
        m = model.manifest
        quant = m.quant
        if model.device == "cuda":
            where = "cuda/" + next(g.arch for g in m.gpu_modules if g.kind == "cuda")
        else:
            where = f"llvm/{model.tier}" if model.tier else "llvm"
        batched = f"batched up to {config.max_concurrent} sequences" if s.batch else "one sequence a forward"
        if s.probe is not None:  # --cpu-batch auto decided from a measurement: say which
            batched += (
                f"; measured: 2 sequences {s.probe[0] * 1e3:.1f} ms apart, {s.probe[1] * 1e3:.1f} ms batched"
            )
        self.info = ModelInfo(
            path=str(path),
            quant=quant,
            target=where,
            context_window=model.context_length,
            decode_path=f"{where} {quant} decode, KV cache {m.kv_cache.dtype} ({batched})",
            prefill_path=f"{where} {quant} prefill (chunks of {s.chunk} tokens)",
            family=m.family,
            vocab_size=m.model.vocab_size,
            chat_template=model.chat_template,
            selftest=model.self_test.to_json() if model.self_test else None,
            decisions=True,
            thinking=model.thinking,
        )
        # llguidance's tokenizer view takes ~1.7 s for a 152k vocabulary: built now, off the request path.
        self.grammar: GrammarTokenizer | None = model.grammar.start()
        # So is the bound a long prompt is first checked against (~80 ms, GIL held, for 152k tokens).
        threading.Thread(target=model.encoding_bound, name="encoding-bound", daemon=True).start()

    @classmethod
    def load(
        cls,
        path: str | Path,
        self_test: bool | None = None,
        config: SchedulerConfig | None = None,
        device: str = "auto",
    ) -> ModelEngine:
        return cls(Model.load(path, self_test=self_test, device=device), path, config)

    def _model(self) -> Model:
        if self.model is None:
            raise RuntimeError("model was unloaded")
        return self.model

    def chat_ids(self, messages: list[dict[str, Any]], **template_vars: Any) -> list[int]:
        window = self.info.context_window
        return self._model().chat_prompt(messages, add_generation_prompt=True, window=window, **template_vars)

    def text_ids(self, text: str) -> list[int]:
        return self._model().encode(text, window=self.info.context_window)

    def token_text(self, token_id: int) -> str:
        return self._model().decode([token_id])

    def generate(
        self, request: GenerationRequest, cancel: threading.Event | None = None
    ) -> Iterator[StepEvent]:
        if self.scheduler is None:
            raise RuntimeError("model was unloaded")
        return self.scheduler.generate(request, cancel)

    def generate_choices(
        self, requests: list[GenerationRequest], cancel: threading.Event | None = None
    ) -> list[Iterator[StepEvent]]:
        if self.scheduler is None:
            raise RuntimeError("model was unloaded")
        return self.scheduler.generate_choices(requests, cancel)

    def score(self, prompt_ids: list[int], cancel: threading.Event | None = None) -> tuple[np.ndarray, int]:
        if self.scheduler is None:
            raise RuntimeError("model was unloaded")
        return self.scheduler.score(prompt_ids, cancel)

    def label_ids(self, labels: list[str]) -> list[int]:
        """Each label's first token as the model would write it (no BOS)."""
        m = self._model()
        return [m.encode(label, add_bos=False)[0] for label in labels]

    def stats(self) -> dict[str, int]:
        return self.scheduler.stats() if self.scheduler is not None else {}

    def memory_line(self) -> str:
        """For the banner: what the KV cache holds and costs."""
        s, m = self.scheduler, self._model()
        assert s is not None
        mib = s.capacity * m.kv_bytes_per_token / (1 << 20)
        line = (
            f"KV cache {s.capacity} tokens x {m.kv_bytes_per_token // 1024} KiB "
            f"({m.manifest.kv_cache.dtype}) = {mib:.0f} MiB; {s.config.kv_sessions} warm sessions kept"
        )
        if s.draft is not None:  # --drafter: its own cache, as large
            d = s.draft.model
            mib = s.capacity * d.kv_bytes_per_token / (1 << 20)
            line += f"; drafter {d.bundle.path.name}: KV cache {mib:.0f} MiB"
        return line

    def close(self) -> None:
        # The last reference to the weights, kernels and KV cache goes; the mapping is freed with it.
        if self.scheduler is not None:
            self.scheduler.stop()
        self.scheduler = None
        self.model = None
        self.grammar = None
