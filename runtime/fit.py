"""Does a model fit? Price it before it loads: weights, KV cache and scratch, against MemAvailable.

Pure arithmetic over figures a bundle's manifest gives (no TVM, no load); the memory source is a
callable, so tests price against fake figures. When the price is over what is available and the
context was not chosen by the user, the context gives up positions in halves down to MIN_CONTEXT
(each shrink logged); an explicit --ctx or --kv-tokens is never shrunk: that is a one-line refusal.

The prices are of host memory (the CPU path): a CUDA resident's KV lives on the device, which the
CUDA loader sizes itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from goinfer.artifacts.giw import Bundle
    from goinfer.artifacts.manifest import Manifest, ModelSpec

MiB, GiB = 1 << 20, 1 << 30
MIN_CONTEXT = 4096  # a shrink stops here: below it the model is of little use to a chat client
# Scratch is an estimate, not a measurement: a forward's f32 activations for one prefill chunk
# (hidden states, q/k/v and the gated MLP's two intermediates) and its logits at every position (the
# largest buffer for a 150k vocabulary), plus a fixed allowance for what is not the model's arrays:
# the TVM runtime and its workspace, the parsed tokenizer (~100 MB for Qwen's), Python's heap.
RUNTIME_ALLOWANCE = 256 * MiB

MemorySource = Callable[[], "int | None"]  # bytes available now (None: this OS does not say)


class FitError(ValueError):
    """The model does not fit, and the context may not (or can no longer) give up positions."""


def meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo's `Key: N kB` lines, in bytes."""
    return {k: int(v) * 1024 for k, v in re.findall(r"^(\w+):\s+(\d+) kB", text, re.M)}


def proc_meminfo() -> str:
    return Path("/proc/meminfo").read_text()


def mem_available(read: Callable[[], str] = proc_meminfo) -> int | None:
    """MemAvailable in bytes: the kernel's own estimate of what can be had without swapping."""
    try:
        return meminfo(read()).get("MemAvailable")
    except OSError:  # not Linux: no /proc/meminfo
        return None


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str) -> int:
    """A token's keys and values across every layer, in the cache's dtype."""
    width = 2 if kv_dtype == "float16" else 4
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * width


def scratch_bytes(spec: ModelSpec, chunk: int) -> int:
    """The estimate described at RUNTIME_ALLOWANCE, for a forward of `chunk` tokens."""
    per_token = 4 * spec.hidden_size + spec.num_heads * spec.head_dim + 2 * spec.intermediate_size
    return 4 * chunk * (per_token + spec.vocab_size) + RUNTIME_ALLOWANCE


@dataclass(frozen=True)
class ModelCost:
    """What a model costs whatever its context, and what a token of context costs."""

    name: str
    weights: int  # the bundle's parameter tensors, mapped from the file
    kv_per_token: int
    window: int  # the bundle's own context window
    scratch: int

    @classmethod
    def of(cls, name: str, bundle: Bundle, m: Manifest) -> ModelCost:
        weights = sum(bundle.tensor_info(p).nbytes for p in m.params)
        kv = kv_bytes_per_token(m.model, m.kv_cache.dtype)
        return cls(name, weights, kv, m.context_length, scratch_bytes(m.model, m.kv_cache.prefill_chunk))


@dataclass(frozen=True)
class Price:
    weights: int
    kv: int
    kv_tokens: int
    scratch: int
    available: int | None

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.scratch

    @property
    def fits(self) -> bool:
        return self.available is None or self.total <= self.available

    def describe(self) -> str:
        avail = "MemAvailable unknown" if self.available is None else f"{size(self.available)} available"
        return (
            f"weights {size(self.weights)} (mapped) + KV {size(self.kv)} ({self.kv_tokens:,} tokens) "
            f"+ scratch {size(self.scratch)} (estimate) = {size(self.total)}, against {avail}"
        )


@dataclass(frozen=True)
class Fit:
    context: int  # the context to load with: 0 leaves the model's own (SchedulerConfig.context)
    price: Price
    shrunk_from: int | None  # the window given up, when the context was shrunk
    lines: tuple[str, ...]  # the decisions, in words (logged at load, printed by `check --fit`)


def price(cost: ModelCost, context: int, kv_tokens: int, available: int | None) -> Price:
    tokens = kv_tokens or context
    return Price(cost.weights, tokens * cost.kv_per_token, tokens, cost.scratch, available)


def plan(
    cost: ModelCost,
    context: int = 0,
    kv_tokens: int = 0,
    memory: MemorySource | None = None,
    log: Callable[[str], None] = lambda _line: None,
) -> Fit:
    """`context`, `kv_tokens`: --ctx and --kv-tokens as given (0: not given); `memory`: None reads
    MemAvailable. The Fit to load with, or FitError in one line with the figures."""
    available = (memory or mem_available)()
    window = min(context, cost.window) if context else cost.window
    p = price(cost, window, kv_tokens, available)
    if p.fits:
        line = f"fit: {cost.name}: context {window:,}: {p.describe()}: " + (
            "not checked" if available is None else "fits"
        )
        return Fit(context, p, None, (line,))  # logged only when it changes something (a shrink)
    if context or kv_tokens:
        given = f"--ctx {context}" if context else f"--kv-tokens {kv_tokens}"
        raise FitError(
            f"{cost.name} does not fit with {given}: {p.describe()}; "
            "pass a smaller one, or leave --ctx out to let the context shrink"
        )
    ctx, lines = window, []
    while not p.fits and ctx > MIN_CONTEXT:
        smaller = max(MIN_CONTEXT, ctx // 2)
        p = price(cost, smaller, 0, available)
        line = f"fit: {cost.name}: context {ctx:,} -> {smaller:,} (does not fit at {ctx:,}): {p.describe()}"
        log(line)
        lines.append(line)
        ctx = smaller
    if not p.fits:
        raise FitError(f"{cost.name} does not fit even at context {ctx:,}: {p.describe()}")
    return Fit(ctx, p, window, tuple(lines))


def size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"
