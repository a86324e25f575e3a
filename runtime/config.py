"""The runtime's defaults, in one place that imports nothing heavy: the CLI reads its option
defaults here at startup without loading TVM (tests/runtime/test_runtime_imports.py)."""

from __future__ import annotations

from dataclasses import dataclass

# Prompt tokens a forward, wherever a prompt is fed (Model.prefill, the server's scheduler). On
# the CPU a token computes the same in any chunk; a GPU cache reuses only whole chunks a cold run
# also has (runtime/kv_pool.py), and one size everywhere makes the CLI's reply the server's.
DEFAULT_PREFILL_CHUNK = 128


@dataclass(frozen=True)
class SchedulerConfig:
    max_concurrent: int = 4  # generations that run at once (more wait, first come first served)
    kv_sessions: int = 16  # warm sequences kept for prefix reuse (0: none, no reuse)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens a step; capped by the bundle's own
    batch: str = "auto"  # "on" | "off" | "auto": batch concurrent decode steps into one forward
    kv_tokens: int = 0  # the cache's capacity in tokens, all sequences together (0: the window)
    context: int = 0  # caps the model's context window (0: the bundle's)
    session_dir: str | None = None  # warm sessions persisted here and restored at start
    spec: str = "off"  # "off" | "ngram": prompt-lookup speculative decoding (runtime/speculate.py)
    drafter: str | None = None  # a .giw whose small model drafts for speculation (runtime/draft_model.py)
    prefix_reuse: str = "exact"  # "exact": bit-exact reuse (any token on the CPU) | "longest" (kv_pool.py)


@dataclass(frozen=True)
class EncoderConfig:
    # Tokens a forward of the encoder takes at most: inputs beyond it run in the next forward.
    # Smaller forwards keep a layer's activations in the caches: all-MiniLM-L6-v2 q8_0, 64 inputs
    # of 128 tokens, 2 threads (Intel Xeon): 494 ms in one forward of 8192 tokens, 460 in 4096s,
    # 421 in 2048s, 393 in 1024s, 410 in 512s; the vectors the same bits in every split (a row's
    # kernels never see the other inputs: tests/compiler/test_encoder.py).
    max_batch_tokens: int = 1024
