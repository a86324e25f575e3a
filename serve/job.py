"""The one value every API parses its request body into: a Job, which pipeline.py runs.

Chat completions, completions, Anthropic Messages and Responses differ in how a request is spelled
and how a reply is shaped; everything between (rules, messages, prompt ids, sampling, plan, run)
is shared. A Job carries the first in one shape, and `reply` the second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .chunks import EventBuilder
    from .pipeline import Plan


@dataclass(frozen=True)
class Sampling:
    """Every API's sampling knobs in one shape (None: the default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    max_tokens: int | None = None
    default_max_tokens: int | None = None  # None: the rest of the context window
    stops: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True)
class Job:
    """One generation request, whichever API it came through.

    The prompt is `messages` (the chat APIs: OpenAI-shaped dicts, content already plain text) or
    `prompt` (/v1/completions: raw text or token ids). `reply(plan)` makes the API's event builder:
    its chunks or named events, and how they fold into one JSON reply.
    """

    model: str | None
    sampling: Sampling
    reply: Callable[[Plan], EventBuilder]
    messages: list[dict[str, Any]] | None = None
    prompt: str | tuple[int, ...] | None = None
    prompt_field: str = "messages"  # the request field the prompt came from, for errors
    stream: bool = False
    response_format: dict[str, Any] | None = None
    confidence: bool = False  # goinfer_confidence
    tools: list[dict[str, Any]] | None = None  # OpenAI's chat form, whatever the API spelled
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
