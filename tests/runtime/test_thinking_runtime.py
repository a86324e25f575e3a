"""Thinking models in the runtime: the control read from a template, the budget's forced closing
token in the decode loop, and the split of a reply into reasoning and answer."""

from __future__ import annotations

import numpy as np
import pytest
from goinfer.runtime import prompt, thinking
from goinfer.runtime.decode import sample_tokens
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.thinking import ReasoningBudget, ReasoningSplit, ThinkingConfig, ThinkingControl
from thinking_fixtures import OPEN_BLOCK_TEMPLATE, QWEN3_TEMPLATE, TEMPLATES
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tokenizer(delimiters: bool = True) -> Tokenizer:
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    if delimiters:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    return tok


def _detect(template: str, tok: Tokenizer) -> ThinkingControl | None:
    def single(text: str) -> int | None:
        ids = prompt.encode(tok, text)
        return ids[0] if len(ids) == 1 else None

    return thinking.detect(template, lambda m, **v: prompt.render_chat(template, m, **v), single)


def test_the_control_and_its_default_come_from_the_template() -> None:
    tok = _tokenizer()
    qwen3 = _detect(QWEN3_TEMPLATE, tok)
    assert qwen3 is not None and qwen3.default_on  # Qwen3 thinks unless told not to
    assert (qwen3.open_id, qwen3.close_id) == (tok.token_to_id("<think>"), tok.token_to_id("</think>"))
    small = _detect(OPEN_BLOCK_TEMPLATE, tok)
    assert small is not None and not small.default_on  # Qwen3.5-0.8B's shape does not
    # no control: a template without enable_thinking, or delimiters that are not one token each
    assert _detect(CHATML, tok) is None
    for other in ("llama3.2.jinja", "phi3.5.jinja", "mistral-nemo.jinja"):  # the other families' own
        assert _detect((TEMPLATES / other).read_text(), tok) is None, other
    assert _detect(QWEN3_TEMPLATE, _tokenizer(delimiters=False)) is None
    # enable_thinking named, but nothing it changes: no control
    assert _detect(CHATML + "{# enable_thinking <think> #}", tok) is None


def test_where_the_prompt_leaves_the_model() -> None:
    c = ThinkingControl(open_id=7, close_id=8, default_on=True)
    assert c.inside([1, 2, 7, 3])  # the template opened the block
    assert not c.inside([1, 7, 3, 8, 4])  # and closed it (thinking off)
    assert not c.inside([1, 2, 3])  # the model decides


# -- the budget ---------------------------------------------------------------------------------------
OPEN, CLOSE, WORD, ANSWER, EOS = 1, 2, 3, 4, 5
VOCAB = 6


def _run(script, budget: int, rule: ReasoningBudget | None, **kw) -> tuple[list[int], str]:
    """A fake model that writes `script(position)` (its favourite by a wide margin), greedy."""
    pos = 0

    def logits_at(i: int) -> np.ndarray:
        z = np.zeros(VOCAB, np.float32)
        z[script(i)] = 10.0
        return z

    def step(tok: int) -> np.ndarray:
        nonlocal pos
        pos += 1
        return logits_at(pos)

    events = list(
        sample_tokens(
            logits_at(0),
            step,
            budget,
            SamplingParams(temperature=0),
            frozenset([EOS]),
            str,
            reasoning=rule,
            **kw,
        )
    )
    return [e.token_id for e in events if e.token_id is not None], events[-1].finish_reason or ""


def thinker(think: int):
    """Opens a block, thinks `think` tokens, closes it, answers twice, ends: if it gets the room."""
    return lambda i: (
        OPEN
        if i == 0
        else WORD
        if i <= think
        else CLOSE
        if i == think + 1
        else ANSWER
        if i < think + 4
        else EOS
    )


def test_the_room_rule_forces_the_close_by_three_quarters_of_the_reply() -> None:
    rule = ReasoningBudget(OPEN, CLOSE, inside=False)
    # max_tokens 12: the block closes by token 9 (3/4), leaving 3 to answer
    toks, finish = _run(lambda i: OPEN if i == 0 else WORD, 12, rule)
    assert toks[:9] == [OPEN, *[WORD] * 7, CLOSE] and len(toks) == 12 and finish == "length"
    # at 4 tokens: 3/4 is 3, the room of 2 makes it 2: open, close, then two to answer
    toks, _ = _run(lambda i: OPEN if i == 0 else WORD, 4, rule)
    assert toks == [OPEN, CLOSE, WORD, WORD]
    # under 4 tokens: no rule, the reply may end inside its block
    toks, _ = _run(lambda i: OPEN if i == 0 else WORD, 3, rule)
    assert toks == [OPEN, WORD, WORD]
    # a block that closes in time is never touched
    toks, finish = _run(thinker(3), 40, rule)
    assert toks == [OPEN, WORD, WORD, WORD, CLOSE, ANSWER, ANSWER] and finish == "stop"


def test_a_token_budget_counts_the_tokens_inside_the_block() -> None:
    # llama.cpp's count: the delimiters are not in it; 0 closes the block at once
    for cap, words in ((3, 3), (0, 0), (5, 5)):
        toks, _ = _run(thinker(10), 40, ReasoningBudget(OPEN, CLOSE, inside=False, tokens=cap))
        assert toks[: words + 2] == [OPEN, *[WORD] * words, CLOSE], cap
    # whichever comes first of the cap and the room rule
    toks, _ = _run(thinker(30), 12, ReasoningBudget(OPEN, CLOSE, inside=False, tokens=20))
    assert toks.index(CLOSE) == 8
    # unlimited: no room rule, only the request's own cap
    toks, _ = _run(thinker(30), 12, ReasoningBudget(OPEN, CLOSE, inside=False, room=False))
    assert CLOSE not in toks
    # the prompt opened the block: every token counts from the first
    toks, _ = _run(lambda i: WORD if i < 30 else EOS, 40, ReasoningBudget(OPEN, CLOSE, inside=True, tokens=4))
    assert toks[:5] == [WORD] * 4 + [CLOSE]


def test_the_forced_close_is_chosen_whatever_the_sampler() -> None:
    rule = ReasoningBudget(OPEN, CLOSE, inside=True, tokens=2)
    for params in (SamplingParams(temperature=1.5, seed=3), SamplingParams(temperature=1.0, top_k=3, seed=4)):
        pos = 0

        def step(tok: int) -> np.ndarray:
            nonlocal pos
            pos += 1
            return np.random.default_rng(pos).normal(size=VOCAB).astype(np.float32)

        events = list(sample_tokens(step(0), step, 3, params, frozenset(), str, reasoning=rule))
        toks = [e.token_id for e in events if e.token_id is not None]
        assert toks[2] == CLOSE


def test_config_refuses_what_it_cannot_mean() -> None:
    assert ThinkingConfig().room and ThinkingConfig().tokens is None
    assert ThinkingConfig(budget="64").tokens == 64 and not ThinkingConfig(budget="unlimited").room
    assert ThinkingConfig(mode="off").enable() is False and ThinkingConfig().enable() is None
    with pytest.raises(ValueError, match="thinking mode 'maybe'"):
        ThinkingConfig(mode="maybe")
    with pytest.raises(ValueError, match="reasoning budget '-3'"):
        ThinkingConfig(budget="-3")


# -- the split ------------------------------------------------------------------------------------------
C = ThinkingControl(open_id=OPEN, close_id=CLOSE, default_on=True)


def _split(pieces: list[tuple[int | None, str]], inside: bool = False) -> tuple[list[str], list[str], int]:
    s = ReasoningSplit(C, inside)
    thoughts, answers = [], []
    for tok, text in pieces:
        t, a = s.push(tok, text)
        thoughts.append(t)
        answers.append(a)
    return thoughts, answers, s.reasoning_tokens


def test_the_split_drops_the_markup_and_the_blank_lines_around_the_block() -> None:
    pieces = [(OPEN, "<think>"), (WORD, "\n"), (WORD, "Let"), (WORD, " me"), (WORD, " \n"),
              (CLOSE, "</think>"), (WORD, "\n\n"), (ANSWER, "Four"), (ANSWER, ".\n"), (None, "")]  # fmt: skip
    thoughts, answers, n = _split(pieces)
    assert "".join(thoughts) == "Let me" and "".join(answers) == "Four.\n" and n == 6
    # a stream's pieces: the whitespace that might end the block is held until it does not
    assert thoughts == ["", "", "Let", " me", "", "", "", "", "", ""]


def test_only_the_answer_s_tokens_count_as_answered() -> None:
    s = ReasoningSplit(C, inside=False)
    answered = []
    for tok, text in [(OPEN, "<think>"), (WORD, "Hm"), (CLOSE, "</think>"), (WORD, "\n\n"), (ANSWER, "Four")]:
        s.push(tok, text)
        answered.append(s.answered)
    assert answered == [False, False, False, False, True]  # the blank line after the block is not


def test_a_reply_that_ends_inside_its_block_has_no_answer() -> None:
    thoughts, answers, n = _split([(WORD, "\nHmm"), (WORD, " so "), (None, "")], inside=True)
    assert "".join(thoughts) == "Hmm so" and "".join(answers) == "" and n == 2


def test_an_answer_without_a_block_is_the_whole_reply() -> None:
    thoughts, answers, n = _split([(ANSWER, "  Hi"), (CLOSE, "</think>"), (ANSWER, "!"), (None, "")])
    assert "".join(answers) == "  Hi!" and "".join(thoughts) == "" and n == 0  # a stray close is markup
