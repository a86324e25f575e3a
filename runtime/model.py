"""A loaded bundle: weights mapped zero-copy, the compiled module, the tokenizer and the KV cache.

model = Model.load("qwen.giw")
for event in model.generate(model.encode("The capital of France is"), SamplingParams(temperature=0)):
    print(event.text, end="")
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from goinfer.artifacts import cache, giw
from goinfer.artifacts.manifest import Manifest
from tokenizers import Tokenizer

from . import selftest
from . import tvm_runtime as rt
from .chat import render_chat
from .decode import sample_tokens
from .detokenizer import Detokenizer
from .grammar import Constraint, GrammarTokenizer
from .sampler import SamplingParams
from .stream import StepEvent

__all__ = ["Model", "StepEvent"]


def _release_freed_heap() -> None:
    """Hand the tokenizer parser's freed scratch back to the OS (glibc keeps it otherwise: Gemma's
    262k-token tokenizer leaves ~260 MB of freed heap in RSS)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def tokenizer_json(bundle: giw.Bundle, m: Manifest) -> str:
    """The bundle's tokenizers JSON, decoded straight from the mapped tensor (no copy)."""
    try:
        return str(bundle.tensor(m.tokenizer_tensor).data, "utf-8")
    except UnicodeDecodeError as e:
        raise giw.BundleError(
            f"bundle {bundle.path}: tokenizer tensor {m.tokenizer_tensor!r} is not UTF-8 ({e})"
        ) from None


# prefill_logits hands back at most this many bytes of logits a chunk: every position's logits of a
# long prompt at once would be tokens x vocab floats (6 GB for 10k tokens of Qwen's 152k vocabulary).
LOGITS_CHUNK_BYTES = 64 << 20


class Model:
    def __init__(
        self,
        bundle: giw.Bundle,
        manifest: Manifest,
        vm,
        params,
        tokenizer: Tokenizer,
        tokenizer_text: str,
        load_seconds: float,
    ):
        self.bundle, self.vm, self.params, self.tokenizer = bundle, vm, params, tokenizer
        self.manifest = manifest
        self.spec = manifest.model
        self.context_length = manifest.context_length
        self.stop_ids = frozenset(manifest.tokens.stop_ids)
        self.bos_id = manifest.tokens.bos_id
        self.add_bos = manifest.tokens.add_bos
        self.chat_template = manifest.chat_template
        self.prefill_chunk = manifest.kv_cache.prefill_chunk
        self.load_seconds = load_seconds
        self.tier: str | None = None  # the CPU ISA tier the self-test chose
        self.self_test: selftest.SelfTestResult | None = None
        self._kv = None
        self._kv_len = 0  # tokens of sequence 0 held in the cache
        forwards = [e for e in manifest.entry_points if e != "create_kv_cache"]
        try:
            self._entry = {name: vm[name] for name in forwards}
        except AttributeError as e:  # tvm_ffi's answer for a function the module lacks
            raise giw.BundleError(f"bundle {bundle.path}: {e}") from None
        # A decode step's input: one token id, written into the same tensor every step (a fresh
        # aligned array a step cost ~80 us on the cold cache a step leaves behind, measured)
        self._token, self._token_tensor = rt.scalar_int32()
        # llguidance's view of the tokenizer, for constrained decoding; built when first started.
        self.grammar = GrammarTokenizer(tokenizer_text, self.spec.vocab_size, self.stop_ids)

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | Path,
        verify: str = "once",
        cache_dir: Path | None = None,
        self_test: bool | None = None,
    ) -> Model:
        """Map a bundle and pick its CPU tier by the startup self-test (`self_test=False` or
        GOINFER_NO_SELFTEST=1 skips it and trusts the best tier). `cache_dir` is the cache root."""
        t0 = time.perf_counter()
        bundle = giw.open_bundle(path, verify=verify, cache_dir=cache_dir, private=True)
        try:
            m = Manifest.of(bundle)
        except giw.BundleError:
            bundle.close()
            raise
        lib_dir = cache.folder("libs", cache_dir)
        enabled = not selftest.disabled_by_env() if self_test is None else self_test
        tier, result = selftest.choose_tier(bundle, m, lib_dir, enabled)
        vm = rt.load_vm(str(bundle.extract_module(tier.module, lib_dir)))
        params = rt.tensor_list([rt.wrap(bundle.tensor(name)) for name in m.params])
        # The slowest step of a load (~0.5 s for Qwen's 151k-token vocabulary). It holds the GIL
        # throughout, so a thread beside the kernel load gains nothing (measured).
        text = tokenizer_json(bundle, m)
        tokenizer = Tokenizer.from_str(text)
        _release_freed_heap()
        model = cls(bundle, m, vm, params, tokenizer, text, time.perf_counter() - t0)
        model.tier, model.self_test = tier.tier, result
        return model

    # -- tokens --------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Raw text -> ids, special-token strings recognised, BOS per the checkpoint's rule."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.add_bos if add_bos is None else add_bos
        if bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def chat_prompt(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """Messages -> ids through the checkpoint's chat template; `extra` are template variables
        (tools, enable_thinking)."""
        text = render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.decode([self.bos_id]) if self.bos_id is not None else "",
            eos_token=self.decode([min(self.stop_ids)]) if self.stop_ids else "",
            **extra,
        )
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- forward passes (sequence 0; the server's batching builds on these) ---------------
    def _ensure_kv(self) -> None:
        if self._kv is None:
            # Created for the manifest's prefill chunk: no forward pass may feed more tokens.
            page = self.manifest.kv_cache.page_size
            self._kv = rt.create_kv_cache(self.vm, 1, self.context_length, self.prefill_chunk, page)
            rt.add_sequence(self._kv, 0)

    def reset(self) -> None:
        if self._kv is not None:
            rt.remove_sequence(self._kv, 0)
            rt.add_sequence(self._kv, 0)
        self._kv_len = 0

    def _forward(self, ids: list[int], fn: str) -> np.ndarray:
        if len(ids) == 1:
            self._token[0] = ids[0]
            x = self._token_tensor
            fn = "decode"  # one token: the decode graph, whatever was asked
        else:
            x = rt.int32_tensor(ids)
        rt.begin_forward(self._kv, [0], [len(ids)])
        logits = self._entry[fn](x, self._kv, self.params)
        rt.end_forward(self._kv)
        self._kv_len += len(ids)
        return rt.to_numpy(logits)[0]

    def _chunks(self, ids: list[int], size: int) -> Iterator[list[int]]:
        """A fresh sequence 0, then `ids` in pieces of at most `size` tokens, each fed as it is taken."""
        if len(ids) > self.context_length:
            raise ValueError(f"prompt has {len(ids)} tokens; the context window is {self.context_length}")
        self._ensure_kv()
        self.reset()
        for s in range(0, len(ids), size):
            yield ids[s : s + size]

    def prefill(self, ids: list[int]) -> np.ndarray:
        """Feed a prompt of any length up to the window; returns the last position's logits (vocab,)."""
        out = None
        for chunk in self._chunks(ids, self.prefill_chunk):
            out = self._forward(chunk, "prefill")
        if out is None:
            raise ValueError("empty prompt")
        return out[-1]

    def prefill_logits(self, ids: list[int]) -> Iterator[np.ndarray]:
        """Feed a prompt; yields every position's logits, (n, vocab) a piece, in order.

        Pieces stay under LOGITS_CHUNK_BYTES, so scoring a long text never holds its whole
        tokens x vocab logits at once.
        """
        rows = max(1, min(self.prefill_chunk, LOGITS_CHUNK_BYTES // (4 * self.spec.vocab_size)))
        for chunk in self._chunks(ids, rows):
            yield self._forward(chunk, "prefill_all")

    def decode_step(self, token_id: int) -> np.ndarray:
        if self._kv_len >= self.context_length:
            raise ValueError("context window is full")
        return self._forward([token_id], "decode")[-1]

    # -- generation ----------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
        capture: bool = False,
    ) -> Iterator[StepEvent]:
        """Stream tokens; the final event carries finish_reason and timings (see `sample_tokens`)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        detok = Detokenizer(self.tokenizer, prompt_ids)
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids)
        t_prefill = time.perf_counter() - t0
        budget = min(params.max_tokens, self.context_length - len(prompt_ids))
        t1 = time.perf_counter()
        for ev in sample_tokens(
            logits, self.decode_step, budget, params, self.stop_ids, detok.push, logprobs, constraint, capture
        ):
            if ev.token_id is not None:
                yield ev
                continue
            t_decode, n = time.perf_counter() - t1, ev.timings["completion_tokens"]
            timings = {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": n,
                "prefill_s": t_prefill,
                "decode_s": t_decode,
                "prefill_tok_s": len(prompt_ids) / t_prefill if t_prefill > 0 else 0.0,
                "decode_tok_s": (n - 1) / t_decode if n > 1 and t_decode > 0 else 0.0,
            }
            yield StepEvent(None, detok.flush(), None, ev.finish_reason, timings)
