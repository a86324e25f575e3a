"""A loaded bundle: weights mapped zero-copy, the compiled module, the tokenizer and the KV cache.

model = Model.load("qwen.giw")
ids = model.encode("The capital of France is")
for event in model.generate(GenerationRequest(ids, SamplingParams(temperature=0))):
    print(event.text, end="")
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from goinfer.artifacts import cache, giw
from goinfer.artifacts.manifest import Manifest
from tokenizers import Tokenizer

from . import cuda, devices, fit, gpu_selftest, prompt, selftest, thinking
from . import tvm_runtime as rt
from .config import DEFAULT_PREFILL_CHUNK
from .decode import Detokenizer, GenerationRequest, StepEvent, generate_events
from .grammar import GrammarTokenizer
from .speculate import Lookahead, NgramDrafter

__all__ = ["Model", "StepEvent"]


def _release_freed_heap() -> None:
    """Hand the tokenizer parser's freed scratch back to the OS (glibc keeps it otherwise: Gemma's
    262k-token tokenizer leaves ~260 MB of freed heap in RSS)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def tokenizer_json(bundle: giw.Bundle, m: Manifest) -> str:
    """The bundle's tokenizers JSON, decoded straight from the mapped tensor (no copy)."""
    try:
        return str(bundle.tensor(m.tokenizer_tensor).data, "utf-8")
    except UnicodeDecodeError as e:
        raise giw.BundleError(
            f"bundle {bundle.path}: tokenizer tensor {m.tokenizer_tensor!r} is not UTF-8 ({e})"
        ) from None


def _closing(events: Iterator[StepEvent], look: Lookahead) -> Iterator[StepEvent]:
    """`events`, then the drafter's sequence goes back to its cache (warm for the next prompt)."""
    try:
        yield from events
    finally:
        look.close()


def load_on_cpu(bundle: giw.Bundle, m: Manifest, lib_dir: Path, self_test: bool):
    """The CPU tier the self-test picks, its result, the module's VM and the weights (mapped, no
    copy): a decoder's and an encoder's CPU load alike."""
    tier, result = selftest.choose_tier(bundle, m, lib_dir, self_test)
    vm = rt.load_vm(str(bundle.extract_module(tier.module, lib_dir)))
    return tier, result, vm, rt.tensor_list([rt.wrap(bundle.tensor(name)) for name in m.params])


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
        device: str = "cpu",
    ):
        self.bundle, self.vm, self.params, self.tokenizer = bundle, vm, params, tokenizer
        self.device = device  # "cpu" | "cuda": where the weights, the KV cache and the kernels are
        self.manifest = manifest
        self.spec = manifest.model
        self.context_length = manifest.context_length
        self.stop_ids = frozenset(manifest.tokens.stop_ids)
        self.bos_id = manifest.tokens.bos_id
        self.add_bos = manifest.tokens.add_bos
        self.chat_template = manifest.chat_template
        self.prefill_chunk = manifest.kv_cache.prefill_chunk  # the most a forward may feed
        self.chunk = min(DEFAULT_PREFILL_CHUNK, self.prefill_chunk)  # what prompts are fed in
        self.load_seconds = load_seconds
        self._token_chars: int | None = None  # the longest token's spelling, when first needed
        self.tier: str | None = None  # the CPU ISA tier the self-test chose (None on a GPU)
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
        # The template's thinking control (<think> blocks), read from the template itself; None: none
        self.thinking = thinking.detect(self.chat_template, self.render_chat, self.single_token)

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | Path,
        verify: str = "once",
        cache_dir: Path | None = None,
        self_test: bool | None = None,
        device: str = "auto",
    ) -> Model:
        """Map a bundle and run it on `device` ("auto" | "cpu" | "cuda", runtime/devices.py).

        On the CPU the startup self-test picks the ISA tier; on a GPU it runs the bundle's fixed
        prompt against the CPU module's logits, and a GPU that disagrees hands the model to the CPU
        (`self_test=False` or GOINFER_NO_SELFTEST=1 skips either). `cache_dir` is the cache root."""
        t0 = time.perf_counter()
        bundle = giw.open_bundle(path, verify=verify, cache_dir=cache_dir, private=True)
        try:
            m = Manifest.of(bundle)
            if m.kind != "decoder":
                raise giw.BundleError(
                    f"bundle {Path(path).name} is an {m.kind} ({m.family}), not a generative model: "
                    "serve it with --embed-model"
                )
            where = devices.choose(m, device, Path(path).name, _say)
        except (giw.BundleError, devices.DeviceError):
            bundle.close()
            raise
        lib_dir = cache.folder("libs", cache_dir)
        enabled = not selftest.disabled_by_env() if self_test is None else self_test
        tier = result = None
        if where == "cuda":
            try:
                vm, params, result = gpu_selftest.load_cuda(bundle, m, lib_dir, enabled, _say)
            except cuda.CudaError as e:  # the driver loaded, but the device refused (memory, a fault)
                if device != "auto" or not m.cpu_tiers:
                    bundle.close()
                    raise devices.DeviceError(f"bundle {Path(path).name}: {e}") from None
                _say(f"goinfer: {Path(path).name}: running on the CPU: {e}")
                vm = None
            except selftest.SelfTestError:  # wrong on this GPU, and no CPU module to run instead
                bundle.close()
                raise
            if vm is None:  # the GPU failed or disagreed with the CPU module: run on the CPU
                where = "cpu"
        if where == "cpu":
            tier, result, vm, params = load_on_cpu(bundle, m, lib_dir, enabled)
        # The slowest step of a load (~0.5 s for Qwen's 151k-token vocabulary). It holds the GIL
        # throughout, so a thread beside the kernel load gains nothing (measured).
        text = tokenizer_json(bundle, m)
        tokenizer = Tokenizer.from_str(text)
        _release_freed_heap()
        model = cls(bundle, m, vm, params, tokenizer, text, time.perf_counter() - t0, where)
        model.tier, model.self_test = (tier.tier if tier else None), result
        return model

    # -- tokens --------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None, window: int | None = None) -> list[int]:
        """Raw text -> ids, special-token strings recognised, BOS per the checkpoint's rule. With
        `window`, a text that cannot fit it is refused early (prompt.PromptTooLong)."""
        if window is None:
            ids = prompt.encode(self.tokenizer, text)
        else:
            ids = prompt.encode_within(self.tokenizer, text, window, self.encoding_bound())
        bos = self.add_bos if add_bos is None else add_bos
        if bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def encoding_bound(self) -> int:
        """The longest token's spelling, which bounds a text's token count from below."""
        if self._token_chars is None:
            self._token_chars = prompt.longest_token(self.tokenizer)
        return self._token_chars

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        window: int | None = None,
        **extra: Any,
    ) -> list[int]:
        """Messages -> ids through the checkpoint's chat template; `extra` are template variables
        (tools, enable_thinking); `window` as `encode`'s."""
        text = self.render_chat(messages, add_generation_prompt, **extra)
        return self.encode(text, window=window)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Messages -> the prompt's text through the checkpoint's chat template."""
        return prompt.render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.decode([self.bos_id]) if self.bos_id is not None else "",
            eos_token=self.decode([min(self.stop_ids)]) if self.stop_ids else "",
            **extra,
        )

    def single_token(self, text: str) -> int | None:
        """The id `text` encodes to when it is exactly one token, else None."""
        ids = prompt.encode(self.tokenizer, text)
        return ids[0] if len(ids) == 1 else None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- the KV cache ---------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return fit.kv_bytes_per_token(self.spec, self.manifest.kv_cache.dtype)

    def create_cache(self, max_batch: int, tokens: int):
        """A paged KV cache for up to `max_batch` sequences a forward and `tokens` tokens in all,
        allocated now. Created for the manifest's prefill chunk: no forward may feed more tokens."""
        page = self.manifest.kv_cache.page_size
        return rt.create_kv_cache(self.vm, max_batch, tokens, self.prefill_chunk, page)

    def run(
        self, kv, seq_ids: list[int], chunks: list[list[int]], every_position: bool = False
    ) -> np.ndarray:
        """One forward: each sequence's new tokens appended to its KV. Returns the logits at each
        sequence's last new token, (len(seq_ids), vocab), or with `every_position` at every new
        token, (total, vocab).

        The entry point follows the shape: one token of one sequence runs the static `decode`;
        one token each of several, `batch_decode` (every weight read once for all); anything
        else the prefill graphs. `begin_forward` commits pages before the model runs, so a call
        that fails is rolled back: the cache is as it was."""
        lengths = [len(c) for c in chunks]
        ids = self._ids
        if every_position:
            fn, args = "prefill_all", [ids([t for c in chunks for t in c])]
        elif lengths == [1] and self.device == "cpu":
            self._token[0] = chunks[0][0]
            fn, args = "decode", [self._token_tensor]
        elif lengths == [1]:
            fn, args = "decode", [ids(chunks[0])]
        elif all(n == 1 for n in lengths):
            fn, args = "batch_decode", [ids([c[0] for c in chunks])]
        else:
            fn, args = "batch_prefill", [ids([t for c in chunks for t in c]), ids(np.cumsum(lengths) - 1)]
        rt.begin_forward(kv, seq_ids, lengths)
        try:
            logits = self._entry[fn](*args, kv, self.params)
            rt.end_forward(kv)
        except BaseException:
            for seq, n in zip(seq_ids, lengths, strict=True):
                rt.pop_tokens(kv, seq, n)
            raise
        return (rt.to_numpy(logits) if self.device == "cpu" else cuda.download(logits))[0]

    def _ids(self, values):
        """int32 token ids (or positions) where the model runs."""
        return rt.int32_tensor(values) if self.device == "cpu" else cuda.upload(np.asarray(values, np.int32))

    # -- forward passes on one sequence (the CLI, benches, tests; the server's scheduler
    # drives `run` on its own cache) -------------------------------------------------------
    def _ensure_kv(self) -> None:
        if self._kv is None:
            self._kv = self.create_cache(1, self.context_length)
            rt.add_sequence(self._kv, 0)

    def reset(self) -> None:
        if self._kv is not None:
            rt.remove_sequence(self._kv, 0)
            rt.add_sequence(self._kv, 0)
        self._kv_len = 0

    def _forward(self, ids: list[int], every_position: bool = False) -> np.ndarray:
        out = self.run(self._kv, [0], [ids], every_position)
        self._kv_len += len(ids)
        return out

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
        for chunk in self._chunks(ids, self.chunk):
            out = self._forward(chunk)
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
            yield self._forward(chunk, every_position=True)

    def decode_step(self, token_id: int) -> np.ndarray:
        if self._kv_len >= self.context_length:
            raise ValueError("context window is full")
        return self._forward([token_id])[-1]

    # -- generation ----------------------------------------------------------------------
    def generate(self, request: GenerationRequest, spec: str = "off", drafter=None) -> Iterator[StepEvent]:
        """Stream tokens on sequence 0; the final event carries finish_reason and timings (see
        `decode.generate_events`). `spec` "ngram" and/or a `drafter` (runtime/draft_model.py's
        DraftModel): speculative decoding, the same tokens (on the CPU; runtime/speculate.py)."""
        ids = list(request.prompt_ids)
        if not ids:
            raise ValueError("empty prompt")
        drafters = [NgramDrafter(ids)] if spec == "ngram" else []
        if drafter is not None:
            drafters.append(drafter.follow(ids))
        look = Lookahead(drafters) if drafters and self.device == "cpu" else None

        def prefill() -> tuple[np.ndarray, int]:
            logits = self.prefill(ids)
            if look is not None:  # a drafter's own cache takes the prompt too
                for at in range(self.chunk, len(ids) + self.chunk, self.chunk):
                    look.catch_up(min(at, len(ids)))
            return logits, 0

        events = generate_events(
            request,
            Detokenizer(self.tokenizer, ids),
            prefill,
            self._speculative_step(look) if look is not None else self.decode_step,
            self.context_length,
            self.stop_ids,
        )
        return events if look is None else _closing(events, look)

    def _speculative_step(self, spec: Lookahead) -> Callable[[int], np.ndarray]:
        """`decode_step` with drafts fed beside each token (the scheduler's rule)."""

        def step(token: int) -> np.ndarray:
            row = spec.take(token)
            if row is not None:
                return row
            n = spec.dropped()
            if n:
                rt.pop_tokens(self._kv, 0, n)
                self._kv_len -= n
            if self._kv_len >= self.context_length:
                raise ValueError("context window is full")
            feed = spec.feed(token, min(self.prefill_chunk - 1, self.context_length - self._kv_len - 2))
            rows = self._forward(feed, every_position=len(feed) > 1)
            spec.fed(feed, rows)
            return rows[0]  # the logits after `token`

        return step
