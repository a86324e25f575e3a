"""A loaded encoder bundle: texts (or token ids) in, one L2-normalized vector each out.

enc = Encoder.load("minilm.giw")
vectors = enc.embed(["a query", "a document"])     # (2, 384) float32, rows of norm 1

Inputs are packed into forwards of at most `max_batch_tokens` tokens, one after another with no
padding (the module's `embed` takes their offsets). A vector depends on its own input only:
attention and pooling stay inside it, and every other kernel computes a row alone, so an input
gives the same bits alone or batched with others (tests/compiler/test_encoder.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from goinfer.artifacts import cache, giw
from goinfer.artifacts.manifest import Manifest
from tokenizers import Tokenizer

from . import devices, selftest
from . import tvm_runtime as rt
from .config import EncoderConfig
from .model import load_on_cpu, tokenizer_json


class EncoderInputError(ValueError):
    """An input the encoder cannot take (empty, too long, an id outside the vocabulary)."""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Encoder:
    def __init__(self, bundle: giw.Bundle, manifest: Manifest, vm, params, tokenizer: Tokenizer,
                 load_seconds: float, config: EncoderConfig | None = None):  # fmt: skip
        if manifest.embedding is None:  # Encoder.load refuses a decoder before this
            raise giw.BundleError(f"bundle {bundle.path}: not an encoder")
        self.bundle, self.manifest, self.vm, self.params = bundle, manifest, vm, params
        self.tokenizer, self.load_seconds = tokenizer, load_seconds
        self.config = config or EncoderConfig()
        self.spec = manifest.model
        e = manifest.embedding
        self.dimensions, self.max_tokens, self.pooling = e.dimensions, e.max_tokens, e.pooling
        self.prompts: Mapping[str, str] = e.prompts
        self.device = "cpu"
        self.tier: str | None = None
        self.self_test: selftest.SelfTestResult | None = None
        try:
            self._embed = vm["embed"]
        except AttributeError as err:  # tvm_ffi's answer for a function the module lacks
            raise giw.BundleError(f"bundle {bundle.path}: {err}") from None
        # The tokenizer's own special tokens: [CLS] and [SEP] around a BERT input.
        self._specials = len(tokenizer.encode("", add_special_tokens=True).ids)

    @classmethod
    def load(
        cls,
        path: str | Path,
        verify: str = "once",
        cache_dir: Path | None = None,
        self_test: bool | None = None,
        device: str = "auto",
        config: EncoderConfig | None = None,
    ) -> Encoder:
        """Map an encoder bundle and pick its CPU tier by the startup self-test (encoders have
        CPU modules only; `device` "cuda" is refused)."""
        t0 = time.perf_counter()
        name = Path(path).name
        bundle = giw.open_bundle(path, verify=verify, cache_dir=cache_dir, private=True)
        try:
            m = Manifest.of(bundle)
            if m.kind != "encoder":
                raise giw.BundleError(
                    f"bundle {name} is a {m.kind} ({m.family}), not an embedding model: "
                    "serve it with --model, and an encoder with --embed-model"
                )
            devices.choose(m, "cpu" if device == "auto" else device, name, _say)
            lib_dir = cache.folder("libs", cache_dir)
            enabled = not selftest.disabled_by_env() if self_test is None else self_test
            tier, result, vm, params = load_on_cpu(bundle, m, lib_dir, enabled)
            tokenizer = Tokenizer.from_str(tokenizer_json(bundle, m))
        except BaseException:
            bundle.close()
            raise
        enc = cls(bundle, m, vm, params, tokenizer, time.perf_counter() - t0, config)
        enc.tier, enc.self_test = tier.tier, result
        return enc

    # -- tokens --------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """The model's input for `text`: its tokens between the tokenizer's special ones."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def truncate(self, ids: list[int]) -> list[int]:
        """`ids` cut to max_tokens, the trailing special token ([SEP]) kept at the end."""
        if len(ids) <= self.max_tokens:
            return ids
        tail = self._specials - 1 if self._specials else 0  # the specials after the text
        return ids[: self.max_tokens - tail] + (ids[len(ids) - tail :] if tail else [])

    def check(self, index: int, ids: Sequence[int]) -> None:
        """Refuse input `index` as the module would not take it (EncoderInputError)."""
        if not ids:
            raise EncoderInputError(f"input {index} is empty")
        if len(ids) > self.max_tokens:
            raise EncoderInputError(
                f"input {index} has {len(ids)} tokens; {self.spec.family} takes at most {self.max_tokens}"
            )
        bad = next((t for t in ids if not 0 <= t < self.spec.vocab_size), None)
        if bad is not None:
            raise EncoderInputError(
                f"input {index}: token id {bad} is outside the vocabulary (0..{self.spec.vocab_size - 1})"
            )

    # -- vectors -------------------------------------------------------------------------
    def embed_ids(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """(len(inputs), dimensions) float32, each row its input's L2-normalized vector."""
        for i, ids in enumerate(inputs):
            self.check(i, ids)
        out = np.empty((len(inputs), self.dimensions), np.float32)
        for lo, hi in self._forwards([len(ids) for ids in inputs]):
            out[lo:hi] = self._forward(inputs[lo:hi])
        return out

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=True)  # threads in Rust
        return self.embed_ids([e.ids for e in encodings])

    def _forwards(self, lengths: list[int]) -> list[tuple[int, int]]:
        """Consecutive runs of inputs, each at most max_batch_tokens tokens (one input may fill
        a run alone: max_tokens is below the cap)."""
        runs, lo, total = [], 0, 0
        for i, n in enumerate(lengths):
            if i > lo and total + n > self.config.max_batch_tokens:
                runs.append((lo, i))
                lo, total = i, 0
            total += n
        if lo < len(lengths):
            runs.append((lo, len(lengths)))
        return runs

    def _forward(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        lengths = [len(ids) for ids in inputs]
        ids = np.fromiter((t for x in inputs for t in x), np.int32, sum(lengths))
        positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        out = self._embed(
            rt.int32_tensor(ids), rt.int32_tensor(positions), rt.int32_tensor(offsets), self.params
        )
        return rt.to_numpy(out)

    def close(self) -> None:
        self.bundle.close()
