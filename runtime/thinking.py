"""Thinking models: the control a chat template offers, the reasoning budget, and a reply split
into its reasoning and its answer.

- `detect` reads a checkpoint's own chat template: a template that names `enable_thinking`, writes
  `<think>`, renders differently with it on and off, over a vocabulary where `<think>` and
  `</think>` are one token each, is a thinking control, and what it renders when nothing is said
  is its default. Nothing is hard-wired per family; anything else has no control and is served as
  it always was.
- `ReasoningBudget` keeps a thinking reply room to answer: once its block has used its budget, the
  next token is forced to be the closing one (the decode loop masks every other, as a grammar
  does). The budget is the request's (or the server's) count of tokens inside a block, as
  llama.cpp's `--reasoning-budget` counts them, and the room rule: the block closes by three
  quarters of the reply's tokens and leaves at least 2. A reply under 4 tokens gets no room rule.
- `ReasoningSplit` turns a reply's tokens into reasoning and answer text, by token id: the markup
  never reaches either, the reasoning is trimmed of the blank lines around it and the answer of
  those after the block (as llama.cpp's parser does), and a stream's pieces join to the whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<think>", "</think>"
MODES = ("template", "asis", "on", "off")
FORMATS = ("deepseek", "auto", "none")  # llama.cpp's reasoning_format names (auto: deepseek)
ROOM_SHARE = (3, 4)  # a block closes by this share of the reply's tokens...
ANSWER_ROOM = 2  # ...and leaves at least this many
MIN_TURN = 4  # a reply shorter than this gets no room rule


@dataclass(frozen=True)
class ThinkingConfig:
    """How a server (or `goinfer chat`) treats a thinking model.

    `mode`: template renders what the checkpoint's template renders when thinking is unspecified;
    asis renders the prompt as it was before thinking was modelled (replayed reasoning ignored);
    on and off force it. A request overrides it. `budget`: auto applies the room rule only; N caps
    a block at N tokens too; unlimited applies neither (a request's own budget still holds)."""

    mode: str = "template"
    budget: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"thinking mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.budget not in ("auto", "unlimited") and not (self.budget.isdigit()):
            raise ValueError(f"reasoning budget {self.budget!r}: expected auto, unlimited or a token count")

    @property
    def tokens(self) -> int | None:
        """The server's own cap on a block (None: none)."""
        return int(self.budget) if self.budget.isdigit() else None

    @property
    def room(self) -> bool:
        return self.budget != "unlimited"

    def enable(self) -> bool | None:
        """enable_thinking as this mode renders it (None: the template's default)."""
        return {"on": True, "off": False}.get(self.mode)


@dataclass(frozen=True)
class ThinkingControl:
    """A template's thinking control: its delimiters (one token each) and its default."""

    open_id: int
    close_id: int
    default_on: bool  # the template thinks when enable_thinking is unspecified
    open_text: str = OPEN
    close_text: str = CLOSE

    def inside(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt leaves the model inside an open block (the template wrote `<think>`)."""
        opened = _last(prompt_ids, self.open_id)
        return opened >= 0 and opened > _last(prompt_ids, self.close_id)

    def budget(
        self, prompt_ids: list[int], config: ThinkingConfig, tokens: int | None = None
    ) -> ReasoningBudget:
        """A reply's budget: `tokens` (a request's) else the config's cap on a block, and the room
        rule unless the config's budget is unlimited."""
        cap = tokens if tokens is not None else config.tokens
        return ReasoningBudget(self.open_id, self.close_id, self.inside(prompt_ids), cap, config.room)

    def describe(self) -> str:
        return f"{self.open_text}…{self.close_text}, thinks by default: {'yes' if self.default_on else 'no'}"


def _last(ids: list[int], tok: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == tok:
            return i
    return -1


PROBE = [{"role": "user", "content": "Hi"}]


def detect(
    template: str, render: Callable[..., str], single_token: Callable[[str], int | None]
) -> ThinkingControl | None:
    """The template's thinking control, or None. `render(messages, **vars)` renders the template
    with its generation prompt; `single_token(text)` is the id `text` encodes to when it is
    exactly one token."""
    if not template or "enable_thinking" not in template or OPEN not in template:
        return None
    open_id, close_id = single_token(OPEN), single_token(CLOSE)
    if open_id is None or close_id is None:
        return None
    try:
        default, on, off = (
            render(PROBE, **v) for v in ({}, {"enable_thinking": True}, {"enable_thinking": False})
        )
    except ValueError:  # a template that refuses the probe: no control we can read
        return None
    if on == off:
        return None
    return ThinkingControl(open_id, close_id, default != off)


# -- the budget, in the decode loop ---------------------------------------------------------------
@dataclass(frozen=True)
class ReasoningBudget:
    """What the decode loop needs to close a block in time. `inside`: the prompt ends inside an
    open block. `tokens`: the most tokens a block may hold (None: no cap of its own). `room`: the
    block closes by three quarters of the reply's tokens, leaving at least 2."""

    open_id: int
    close_id: int
    inside: bool
    tokens: int | None = None
    room: bool = True

    def close_by(self, reply_tokens: int) -> int | None:
        """The reply position (1-based) the closing token must come by, from the room rule."""
        if not self.room or reply_tokens < MIN_TURN:
            return None
        return min(reply_tokens * ROOM_SHARE[0] // ROOM_SHARE[1], reply_tokens - ANSWER_ROOM)

    def tracker(self, reply_tokens: int) -> BlockTracker:
        return BlockTracker(self, self.close_by(reply_tokens))


class BlockTracker:
    """One reply's place in and out of its blocks: `forced(n)` says the token at position n + 1
    must close the block; `push(token)` follows each chosen token."""

    def __init__(self, budget: ReasoningBudget, close_by: int | None):
        self.b, self.close_by = budget, close_by
        self.inside, self.spent = budget.inside, 0

    def forced(self, n: int) -> bool:
        if not self.inside:
            return False
        cap = self.b.tokens
        return (cap is not None and self.spent >= cap) or (
            self.close_by is not None and n + 1 >= self.close_by
        )

    def push(self, tok: int) -> None:
        if tok == self.b.open_id and not self.inside:
            self.inside, self.spent = True, 0  # another block gets a budget of its own (llama.cpp's rule)
        elif tok == self.b.close_id and self.inside:
            self.inside = False
        elif self.inside:
            self.spent += 1


# -- the split, in the reply -------------------------------------------------------------------------
class ReasoningSplit:
    """A reply's token texts -> (reasoning, answer) pieces. `inside`: the prompt left the model in
    an open block. A block opens at `<think>` (wherever the model writes it) and closes at
    `</think>`; neither delimiter is text of either part. `reasoning_tokens` counts the block's
    tokens, delimiters included."""

    def __init__(self, control: ThinkingControl, inside: bool):
        self.c = control
        self.inside = inside
        self.reasoning_tokens = 0
        self.answered = False  # whether the last token pushed was the answer's (its logprob is shown)
        self._lead = inside  # strip the whitespace that opens a block
        self._held = ""  # reasoning whitespace that may end the block (dropped if it does)
        self._after_close = False  # strip the whitespace between the block and the answer

    def push(self, token_id: int | None, text: str) -> tuple[str, str]:
        """One token's text (token_id None: the reply's last text) -> (reasoning, answer) released."""
        c = self.c
        if token_id == c.open_id and not self.inside:
            before = text.replace(c.open_text, "", 1)
            answer = self._answer(before)
            self.inside, self._lead, self.answered = True, True, False
            self.reasoning_tokens += 1
            return "", answer
        if token_id == c.close_id and self.inside:
            thought = self._thought(text.replace(c.close_text, "", 1))
            self.inside, self._held, self._after_close, self.answered = False, "", True, False
            self.reasoning_tokens += 1
            return thought, ""
        if token_id == c.close_id:  # a stray closing tag in the answer: markup, never text
            text = text.replace(c.close_text, "", 1)
        if self.inside:
            self.reasoning_tokens += token_id is not None
            self.answered = False
            return self._thought(text), ""
        swallowed = self._after_close and not text.strip()  # the blank lines after the block
        self.answered = token_id is not None and not swallowed
        return "", self._answer(text)

    def _thought(self, text: str) -> str:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        return body

    def _answer(self, text: str) -> str:
        if self._after_close:
            text = text.lstrip()
            self._after_close = not text
        return text


def chat_vars(control: ThinkingControl | None, enable: bool | None) -> dict[str, Any]:
    """The template variables a choice of thinking renders with ({} for the template's default)."""
    return {} if control is None or enable is None else {"enable_thinking": enable}
