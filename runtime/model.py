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
from goinfer.artifacts import giw
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


def tokenizer_json(bundle: giw.Bundle) -> str:
    """The bundle's tokenizers JSON: a byte tensor the manifest names, or (bundles built before
    it moved out of the manifest) a manifest string."""
    m = bundle.manifest
    if "tokenizer_tensor" not in m:
        if not isinstance(m.get("tokenizer"), str):
            raise giw.BundleError(f"bundle {bundle.path} has no tokenizer")
        return m["tokenizer"]
    name = m["tokenizer_tensor"]
    if name not in bundle.tensor_names():
        raise giw.BundleError(f"bundle {bundle.path}: no tokenizer tensor {name!r}, which its manifest names")
    try:
        return str(bundle.tensor(name).data, "utf-8")  # decoded straight from the mapping, no copy
    except UnicodeDecodeError as e:
        raise giw.BundleError(f"bundle {bundle.path}: tokenizer tensor {name!r} is not UTF-8 ({e})") from None


class Model:
    def __init__(
        self, bundle: giw.Bundle, vm, params, tokenizer: Tokenizer, tokenizer_text: str, load_seconds: float
    ):
        self.bundle, self.vm, self.params, self.tokenizer = bundle, vm, params, tokenizer
        m = bundle.manifest
        self.manifest: dict[str, Any] = m
        self.spec: dict[str, Any] = m["spec"]
        self.hidden = int(self.spec["hidden_size"])
        self.context_length = int(m["context_length"])
        self.stop_ids = frozenset(m["tokens"]["stop_ids"])
        self.bos_id = m["tokens"]["bos_id"]
        self.add_bos = bool(m["tokens"]["add_bos"])
        self.chat_template: str = m["chat_template"]
        kvc = m["kv_cache"]
        self.page_size = int(kvc["page_size"])
        self.max_prefill_chunk = int(kvc["max_prefill_chunk"]) or self.context_length
        self.load_seconds = load_seconds
        self.tier: str | None = None  # the CPU ISA tier the self-test chose
        self.self_test: selftest.SelfTestResult | None = None
        self._kv = None
        self._kv_len = 0  # tokens of sequence 0 held in the cache
        # Bundles built before the entry points took token ids have an `embed` entry, and their
        # entry points hand back (logits, cache).
        self._ids_in = m.get("forward_input") == "token_ids"
        try:
            self._entry = {name: vm[name] for name in m["entry_points"] if name != "create_kv_cache"}
        except AttributeError as e:  # tvm_ffi's answer for a function the module lacks
            raise giw.BundleError(f"bundle {bundle.path}: {e}") from None
        # A decode step's input: one token id, written into the same tensor every step (a fresh
        # aligned array a step cost ~80 us on the cold cache a step leaves behind, measured)
        self._token, self._token_tensor = rt.scalar_int32()
        # llguidance's view of the tokenizer, for constrained decoding; built when first started.
        self.grammar = GrammarTokenizer(tokenizer_text, int(self.spec["vocab_size"]), self.stop_ids)

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
        GOINFER_NO_SELFTEST=1 skips it and trusts the best tier)."""
        t0 = time.perf_counter()
        bundle = giw.open_bundle(path, verify=verify, private=True)
        vm, tier, result = cls._load_kernels(bundle, path, cache_dir, self_test)
        params = rt.tensor_list([rt.wrap(bundle.tensor(name)) for name in bundle.manifest["params"]])
        # The slowest step of a load (~0.5 s for Qwen's 151k-token vocabulary). It holds the GIL
        # throughout, so a thread beside the kernel load gains nothing (measured).
        text = tokenizer_json(bundle)
        tokenizer = Tokenizer.from_str(text)
        _release_freed_heap()
        model = cls(bundle, vm, params, tokenizer, text, time.perf_counter() - t0)
        model.tier, model.self_test = tier.get("tier"), result
        return model

    @staticmethod
    def _load_kernels(bundle: giw.Bundle, path: str | Path, cache_dir: Path | None, self_test: bool | None):
        modules = bundle.module_keys()
        if "llvm" not in modules:
            raise giw.BundleError(
                f"bundle {path} has no CPU (llvm) module; it has: {', '.join(modules) or 'none'}"
            )
        lib_dir = (cache_dir or giw.default_cache_dir()) / "libs"
        enabled = not selftest.disabled_by_env() if self_test is None else self_test
        tier, result = selftest.choose_tier(bundle, lib_dir, enabled)
        return rt.load_vm(str(bundle.extract_module(tier["module"], lib_dir))), tier, result

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
            self._kv = rt.create_kv_cache(
                self.vm, 1, self.context_length, min(self.max_prefill_chunk, 2048), self.page_size
            )
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
        else:
            x = rt.int32_tensor(ids)
        rt.begin_forward(self._kv, [0], [len(ids)])
        if self._ids_in:
            logits = self._entry[fn](x, self._kv, self.params)
        else:
            emb = rt.reshape(self._entry["embed"](x, self.params), (1, len(ids), self.hidden))
            logits, self._kv = self._entry[fn](emb, self._kv, self.params)
        rt.end_forward(self._kv)
        self._kv_len += len(ids)
        return rt.to_numpy(logits)[0]

    def prefill(self, ids: list[int], all_logits: bool = False) -> np.ndarray:
        """Feed a prompt; returns the last position's logits (vocab,), or every position's (n, vocab)."""
        self._ensure_kv()
        self.reset()
        if len(ids) > self.context_length:
            raise ValueError(f"prompt has {len(ids)} tokens; the context window is {self.context_length}")
        outs = []
        # Chunked so windowed layers stay exact (see kv_cache.max_prefill_chunk in FORMAT.md).
        for s in range(0, len(ids), self.max_prefill_chunk):
            chunk = ids[s : s + self.max_prefill_chunk]
            last = s + len(chunk) >= len(ids)
            if all_logits:
                outs.append(self._forward(chunk, "prefill_all" if len(chunk) > 1 else "decode"))
            else:
                out = self._forward(chunk, "prefill" if len(chunk) > 1 else "decode")
                if last:
                    outs.append(out)
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][-1]

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
