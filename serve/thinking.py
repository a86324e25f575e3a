"""A thinking model's request: what its prompt is rendered with, and the budget and split its run
gets (runtime/thinking.py does the work). The pipeline calls here only for a model whose template
has a thinking control; any other is served as before, and its requests never come this way.

What a request asked (pipeline.ThinkingAsk) is read by each API beside its own schema:
- chat completions (routes.py): `chat_template_kwargs.enable_thinking`, `reasoning_effort: "none"`
  (off; any other effort changes nothing: clients send a bare effort to every endpoint),
  `reasoning_format` (deepseek, its alias auto, or none: no split, the raw text in content, markup
  included), and `thinking_token_budget` (llama.cpp's `thinking_budget_tokens` too);
- Anthropic (messages.py): `thinking: {type: enabled, budget_tokens}` (on, with that budget) or
  `{type: disabled}`; adaptive leaves it to the server;
- Responses (responses.py): `reasoning: {effort: "none"}` (off; others change nothing).
A request's explicit choice wins over the server's `--thinking` mode; a constrained request (a
JSON format or a tool call forced from the first token) renders thinking-off whatever was asked
(pipeline.Rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from goinfer.runtime.thinking import (
    ReasoningBudget,
    ReasoningSplit,
    ThinkingConfig,
    ThinkingControl,
    chat_vars,
)

if TYPE_CHECKING:
    from .pipeline import ThinkingAsk


SERVER_DEFAULT = ThinkingConfig()  # `goinfer serve`'s, and an app made in a test


def template_vars(control: ThinkingControl, ask: ThinkingAsk, config: ThinkingConfig) -> dict[str, Any]:
    """enable_thinking as the request (else the server's mode) renders it; {} for the template's
    default."""
    return chat_vars(control, ask.enable if ask.enable is not None else config.enable())


# Marks a user turn's text that came in one Anthropic message with tool results (messages.py)
AFTER_RESULTS = "goinfer_after_tool_results"


def replayed(messages: list[dict[str, Any]], config: ThinkingConfig) -> list[dict[str, Any]]:
    """The messages as the template should see them. Under asis (the prompt as it was before
    thinking was modelled) replayed reasoning is dropped. Otherwise the template renders it, and
    text that came with tool results (Claude Code's reminders) is read as part of the last result:
    as a user turn of its own it would be a new query, and the templates drop the reasoning of the
    turns before the last query, so the tool loop's reasoning would be lost at its first result."""
    if config.mode == "asis":
        return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get(AFTER_RESULTS) and out and out[-1]["role"] == "tool":
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{m['content']}"}
        else:
            out.append(m)
    return out


@dataclass(frozen=True)
class Thinking:
    """One run's thinking: where its prompt left the model, its budget, and whether it splits."""

    control: ThinkingControl
    inside: bool
    budget: ReasoningBudget
    split: bool

    def splitter(self) -> ReasoningSplit | None:
        return ReasoningSplit(self.control, self.inside) if self.split else None


def plan(control: ThinkingControl, ask: ThinkingAsk, config: ThinkingConfig, ids: list[int]) -> Thinking:
    """The run's thinking. The budget is the request's, else the server's --reasoning-budget N,
    with the room rule unless --reasoning-budget unlimited."""
    budget = control.budget(ids, config, ask.budget)
    return Thinking(control, budget.inside, budget, ask.split)
