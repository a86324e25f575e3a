"""Thinking on the serving side: what a request asks for (each API spells it its own way), what its
prompt is rendered with, and the budget and split its run gets (runtime/thinking.py does the work).

Every API's ask becomes one `ThinkingAsk`:
- chat completions: `chat_template_kwargs.enable_thinking`, `reasoning_effort: "none"` (off; any
  other effort changes nothing: clients send a bare effort to every endpoint), `reasoning_format`
  (deepseek, its alias auto, or none: no split, the raw text in content, markup included), and
  `thinking_token_budget` (llama.cpp's `thinking_budget_tokens` too);
- Anthropic: `thinking: {type: enabled, budget_tokens}` (on, with that budget) or `{type: disabled}`;
  adaptive leaves it to the server;
- Responses: `reasoning: {effort: "none"}` (off; others change nothing).
A request's explicit choice wins over the server's `--thinking` mode; a constrained request (a
JSON format or a tool call forced from the first token) renders thinking-off whatever was asked
(pipeline.Rules). A model with no recognised control ignores all of it and is served as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from goinfer.runtime.thinking import (
    FORMATS,
    ReasoningBudget,
    ReasoningSplit,
    ThinkingConfig,
    ThinkingControl,
    chat_vars,
)

from .errors import bad_request


@dataclass(frozen=True)
class ThinkingAsk:
    """What one request asked of thinking (None: nothing)."""

    enable: bool | None = None
    budget: int | None = None  # tokens a block may hold
    split: bool = True  # reasoning_format none: False


NO_ASK = ThinkingAsk()
SERVER_DEFAULT = ThinkingConfig()  # `goinfer serve`'s, and an app made in a test


def openai_ask(
    template_kwargs: dict[str, Any] | None,
    effort: str | None,
    fmt: str | None,
    budget: int | None,
) -> ThinkingAsk:
    """Chat completions' fields; a bad value is a 400 naming its field."""
    enable = None
    if effort == "none":
        enable = False
    flag = (template_kwargs or {}).get("enable_thinking")
    if flag is not None:
        if not isinstance(flag, bool):
            where = "chat_template_kwargs.enable_thinking"
            raise bad_request(f"{where} must be true or false, not {flag!r}", param=where)
        enable = flag
    if fmt is not None and fmt not in FORMATS:
        raise bad_request(
            f"reasoning_format {fmt!r} is not one of {', '.join(map(repr, FORMATS))}",
            param="reasoning_format",
        )
    return ThinkingAsk(enable, budget, fmt != "none")


def anthropic_ask(thinking: dict[str, Any] | None) -> ThinkingAsk:
    """Messages' `thinking` object."""
    if thinking is None:
        return ThinkingAsk()
    kind = thinking.get("type")
    if kind == "disabled":
        return ThinkingAsk(enable=False)
    if kind == "adaptive":
        return ThinkingAsk()
    if kind != "enabled":
        raise bad_request(
            f"thinking.type {kind!r} is not one of 'enabled', 'disabled', 'adaptive'", param="thinking.type"
        )
    budget = thinking.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise bad_request(
            f"thinking.budget_tokens must be a whole number of tokens, not {budget!r}",
            param="thinking.budget_tokens",
        )
    return ThinkingAsk(enable=True, budget=budget)


def responses_ask(reasoning: dict[str, Any] | None) -> ThinkingAsk:
    """Responses' `reasoning` object: only effort "none" means anything here."""
    return ThinkingAsk(enable=False) if (reasoning or {}).get("effort") == "none" else ThinkingAsk()


def template_vars(
    control: ThinkingControl | None, ask: ThinkingAsk, config: ThinkingConfig
) -> dict[str, Any]:
    """enable_thinking as the request (else the server's mode) renders it; {} for the template's
    default, and for a model with no control."""
    return chat_vars(control, ask.enable if ask.enable is not None else config.enable())


def replayed(messages: list[dict[str, Any]], control: ThinkingControl | None, config: ThinkingConfig):
    """The messages as the template should see them: under asis (the prompt as it was before
    thinking was modelled) replayed reasoning is dropped; otherwise the template renders it."""
    if control is None or config.mode != "asis":
        return messages
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]


@dataclass(frozen=True)
class Thinking:
    """One run's thinking: where its prompt left the model, its budget, and whether it splits."""

    control: ThinkingControl
    inside: bool
    budget: ReasoningBudget
    split: bool

    def splitter(self) -> ReasoningSplit | None:
        return ReasoningSplit(self.control, self.inside) if self.split else None


def plan(
    control: ThinkingControl | None, ask: ThinkingAsk, config: ThinkingConfig, ids: list[int]
) -> Thinking | None:
    """The run's thinking (None: a model without a control). The budget is the request's, else
    the server's --reasoning-budget N, with the room rule unless --reasoning-budget unlimited."""
    if control is None:
        return None
    inside = control.inside(ids)
    tokens = ask.budget if ask.budget is not None else config.tokens
    budget = ReasoningBudget(control.open_id, control.close_id, inside, tokens, config.room)
    return Thinking(control, inside, budget, ask.split)
