"""From a validated request to what a worker runs: messages for the template, prompt ids, sampling.

Every limit is checked here, before anything is queued, so a bad request is an error response and
never half a stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from goinfer.runtime.grammar import Constraint, GrammarConstraint
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.stream import StepEvent

from .confidence import recorded, with_confidence
from .deltas import Delta, text_deltas
from .engine import Engine
from .errors import bad_request, unsupported
from .schemas import ChatMessage, ChatRequest, CompletionRequest, SamplingRequest
from .structured import Structured, confidence_schema
from .structured import response_format as response_format_grammar
from .tools import ToolPlan, plan_tools
from .tools.stream import ToolDeltas

# OpenAI's documented defaults where the request leaves a knob out.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_COMPLETION_MAX_TOKENS = 16  # /v1/completions; chat defaults to the rest of the window


@dataclass(frozen=True)
class Rules:
    """What constrains a reply: a response format's grammar or tools (not both), and whether
    per-field confidence is captured (the schema it reads field kinds from)."""

    structured: Structured | None = None
    tools: ToolPlan | None = None
    confidence: dict[str, Any] | None = None

    def template_vars(self) -> dict[str, Any]:
        out = self.tools.template_vars() if self.tools else {}
        if self.structured is not None or (self.tools is not None and self.tools.forced):
            out["enable_thinking"] = False  # constrained from token 1: no open <think> block
        return out


def rules(
    engine: Engine,
    response_format: dict[str, Any] | None,
    confidence: bool,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
) -> Rules:
    """The request's constraints, checked (every 400 here comes before any prefill)."""
    plan = plan_tools(tools, tool_choice, parallel_tool_calls, engine.info.chat_template)
    fmt = response_format_grammar(response_format)
    schema = confidence_schema(confidence, fmt, bool(tools))
    if plan is not None and fmt is not None:
        raise unsupported(
            "tools with a JSON response_format in one request is not supported", "response_format"
        )
    if (plan is not None or fmt is not None) and engine.grammar is None:
        what = "tools" if plan is not None else "response_format"
        raise unsupported(f"{what}: this model cannot run grammar-constrained decoding", what)
    return Rules(fmt, plan, schema)


@dataclass(frozen=True)
class Plan:
    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    logprobs: bool
    top_logprobs: int
    rules: Rules = field(default_factory=Rules)

    @property
    def tools(self) -> ToolPlan | None:
        return self.rules.tools

    @property
    def confidence(self) -> dict[str, Any] | None:
        return self.rules.confidence

    def deltas(self, engine: Engine) -> Iterator[Delta]:
        """The one generation path: the engine's token events folded into client deltas."""
        capture = self.confidence is not None
        events = engine.generate(
            self.prompt_ids,
            self.params,
            self.top_logprobs if self.logprobs else None,
            constraint=self._constraint(engine),
            capture=capture,
        )
        steps: list[StepEvent] = []
        if capture:
            events = recorded(events, steps)
        end_at = self.tools.reply_end if self.tools is not None else None
        out = text_deltas(events, len(self.prompt_ids), self.stops, engine.token_text, self.logprobs, end_at)
        if self.tools is not None:
            out = ToolDeltas(self.tools.fmt, self.tools.names)(out)
        if self.confidence is not None:
            out = with_confidence(out, steps, self.confidence, engine.token_text)
        return out

    def _constraint(self, engine: Engine) -> Constraint | None:
        tok = engine.grammar
        if tok is None:
            return None  # a constrained request was refused before planning (see `rules`)
        if self.tools is not None:
            return self.tools.constraint(tok, engine.token_text)
        if self.rules.structured is not None:
            return GrammarConstraint(tok.matcher(self.rules.structured.grammar), tok.vocab_size)
        return None


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Request messages -> the dicts a chat template reads.

    `developer` is OpenAI's newer name for `system`: renamed in place. When several system
    messages are sent, the last one wins (earlier ones are dropped), wherever it stands.
    """
    out: list[dict[str, Any]] = []
    last_system = max((i for i, m in enumerate(messages) if m.role in ("system", "developer")), default=-1)
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role == "system" and i != last_system:
            continue
        d = m.model_dump(exclude_none=True)
        d["role"], d["content"] = role, _text(m, i)
        out.append(d)
    return out


def _text(m: ChatMessage, i: int) -> str:
    if m.content is None:
        if m.role == "assistant":
            return ""  # an assistant turn that only called tools
        raise bad_request(
            f"messages.{i}.content is required for role {m.role!r}", param=f"messages.{i}.content"
        )
    if isinstance(m.content, str):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            what = "image content needs a vision model (vision: false here)" if "image" in part.type else ""
            raise bad_request(
                f"messages.{i}.content.{j}: unsupported content part type {part.type!r}"
                + (f": {what}" if what else "; only text parts are accepted"),
                param=f"messages.{i}.content.{j}.type",
            )
        texts.append(part.text)
    return "\n".join(texts)


def refuse_unsupported(req: SamplingRequest) -> None:
    if req.n not in (None, 1):
        raise bad_request(f"n={req.n}: only n=1 is supported", param="n")
    if req.logit_bias:
        raise unsupported("logit_bias is not supported", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise unsupported("echo is not supported", "echo")
        if req.suffix:
            raise unsupported("suffix is not supported", "suffix")
        if req.best_of not in (None, 1):
            raise bad_request(f"best_of={req.best_of}: only 1 is supported", param="best_of")


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completions request: text, or token ids."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request(f"prompt: {len(p)} prompts given; only one per request is supported", "prompt")
        p = p[0]
    if not p:
        raise bad_request("prompt is empty", param="prompt")
    return p  # type: ignore[return-value]


@dataclass(frozen=True)
class Sampling:
    """Every route's sampling knobs in one shape (None: the default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"  # how the request spells it, for error messages
    default_max_tokens: int | None = None  # None: the rest of the context window
    stops: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0


def openai_sampling(req: SamplingRequest) -> Sampling:
    """The knobs of /v1/chat/completions or /v1/completions."""
    if isinstance(req, ChatRequest):
        field, asked = (
            ("max_completion_tokens", req.max_completion_tokens)
            if req.max_completion_tokens is not None
            else ("max_tokens", req.max_tokens)
        )
        logprobs, top, default = req.logprobs, req.top_logprobs or 0, None
        if top and not logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        field, asked, default = "max_tokens", req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS
        logprobs, top = req.logprobs is not None, req.logprobs or 0
    return Sampling(
        req.temperature,
        req.top_p,
        req.top_k,
        req.min_p,
        req.seed,
        req.frequency_penalty,
        req.presence_penalty,
        asked,
        field,
        default,
        req.stops,
        logprobs,
        top,
    )


def make_plan(
    s: Sampling,
    prompt_ids: list[int],
    name: str,
    context_window: int,
    rules: Rules | None = None,
    prompt_field: str = "messages",
) -> Plan:
    """Check the prompt and budget against the window; fill the defaults."""
    n = len(prompt_ids)
    if n >= context_window:
        raise bad_request(
            f"the prompt is {n} tokens, over the context window of {context_window} tokens for model "
            f"{name!r} (prompt and completion must fit in {context_window})",
            param=prompt_field,
            code="context_length_exceeded",
        )
    if s.max_tokens is not None and s.max_tokens > context_window:
        raise bad_request(
            f"{s.max_tokens_field}={s.max_tokens} is over the context window of {context_window} tokens "
            f"for model {name!r}",
            param=s.max_tokens_field,
        )
    default = context_window - n if s.default_max_tokens is None else s.default_max_tokens
    params = SamplingParams(
        temperature=DEFAULT_TEMPERATURE if s.temperature is None else s.temperature,
        top_k=s.top_k or 0,
        top_p=1.0 if s.top_p is None else s.top_p,
        min_p=s.min_p or 0.0,
        seed=s.seed,
        frequency_penalty=s.frequency_penalty or 0.0,
        presence_penalty=s.presence_penalty or 0.0,
        max_tokens=s.max_tokens if s.max_tokens is not None else default,  # generate also stops at the window
    )
    return Plan(prompt_ids, params, s.stops, s.logprobs, s.top_logprobs, rules or Rules())
