"""The token events the runtime yields: what `Model.generate` (and any Engine) hands the server.

`Model.generate` yields one StepEvent per token (its final text, maybe empty while a UTF-8
character is incomplete), then a final event with the finish reason. Everything a client sees
(stop strings, logprobs, tool calls, per-field confidence) is built from these in serve/.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepChoice:
    """What a grammar left open at one step, for per-field confidence: the chosen token's
    probability among the legal tokens (temperature 1), how many were legal, and, where few were,
    each legal token's probability."""

    legal: int
    prob: float
    options: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepEvent:
    """One generated token, or the end of the stream (token_id None, finish_reason set)."""

    token_id: int | None
    text: str
    logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length"
    timings: dict[str, float] = field(default_factory=dict)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the most likely alternatives, best first
    choice: StepChoice | None = None  # set when a grammar masked this step and capture was asked
