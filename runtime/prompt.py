"""Prompts: messages through the checkpoint's chat template, and text -> token ids, bounded.

- `render_chat` renders the checkpoint's own jinja2 template the way HF transformers does.
- `encode_within` turns a prompt's text into ids, or refuses one that cannot fit the context
  window from a cheap bound (characters over the longest token), or else after counting it in
  pieces: never by tokenizing megabytes in full. The tokenizer runs through `encode_batch`, which
  releases the GIL (`encode` holds it: a 4 MiB prompt froze every other thread, streams and the
  event loop alike, for seconds).
"""

from __future__ import annotations

import functools
import json
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer


# -- chat templates -----------------------------------------------------------------------------
class ChatTemplateError(ValueError):
    pass


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson, not jinja2's: keys in the given order, no HTML escaping (tool schemas),
    # and a plain str: a Markup would escape the text a template joins to it with `+` (Mistral
    # Nemo's '"' + key + '": ' + value|tojson came out as &#34;parameters&#34;).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    # jinja2 is imported here, not at the top: ~50 ms that a raw-text cold start does not need.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Same settings as transformers' apply_chat_template, so renders match byte for byte.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    from jinja2 import TemplateError

    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None


# -- text -> ids, bounded by the window ----------------------------------------------------------
PIECE_CHARS = 1 << 14  # the pieces a long prompt is counted in
# A prompt of up to this many characters a window token is tokenized in one go (text runs ~4 a
# token: most that fit are under it, and counting them first would tokenize them twice).
WHOLE_CHARS_PER_TOKEN = 4
# A breath between pieces: on a machine whose cores all decode, a long count in one go stalls a
# decode step for its whole length (measured: +73 ms on a 15 ms step); in short pieces, a few ms.
PIECE_PAUSE_S = 0.002


class PromptTooLong(ValueError):
    """The prompt has more tokens than the window leaves: `tokens` of them, or at least that many
    where counting stopped early (`exact` False)."""

    def __init__(self, tokens: int, window: int, exact: bool = False):
        count = str(tokens) if exact else f"at least {tokens}"
        super().__init__(f"the prompt is {count} tokens, over the context window of {window}")
        self.tokens, self.window, self.exact = tokens, window, exact


def longest_token(tokenizer: Tokenizer) -> int:
    """The most characters one token spells (byte-level and byte-fallback spellings are never
    shorter than the text they stand for)."""
    return max(len(t) for t in tokenizer.get_vocab(with_added_tokens=True))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """All of `text`'s ids, special-token strings recognised, no template tokens added."""
    return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


def encode_within(tokenizer: Tokenizer, text: str, window: int, token_chars: int) -> list[int]:
    """`text`'s ids, or PromptTooLong when they cannot leave a token of `window` for the reply.

    `token_chars` is `longest_token(tokenizer)`. Normalizers can shrink text (NFC joins accents), so
    the cheap bound allows each token twice its spelling."""
    limit = window - 1
    at_least = len(text) // (2 * max(token_chars, 1))
    if at_least > limit:
        raise PromptTooLong(at_least, window)
    if len(text) <= max(PIECE_CHARS, WHOLE_CHARS_PER_TOKEN * window):  # bounded work: in one go
        return _fits(encode(tokenizer, text), window)
    # A cut can only add tokens where it splits one: at most the characters on either side of it,
    # each its own token, in place of what spelled them. Pieces are cut before a newline or a
    # space where there is one near (pre-tokenizers split there anyway, so usually nothing is).
    slack = 2 * token_chars
    counted, cuts, start = 0, 0, 0
    while start < len(text):
        end = _cut(text, start + PIECE_CHARS)
        counted += len(encode(tokenizer, text[start:end]))
        time.sleep(PIECE_PAUSE_S)
        start, cuts = end, cuts + (end < len(text))
        if counted - slack * cuts > limit:
            raise PromptTooLong(counted - slack * cuts, window)
    return _fits(encode(tokenizer, text), window)  # near or under: the exact ids, in one piece


def _fits(ids: list[int], window: int) -> list[int]:
    if len(ids) >= window:
        raise PromptTooLong(len(ids), window, exact=True)
    return ids


def _cut(text: str, at: int) -> int:
    """A cut near `at`: before the next newline, else the next space, within a short look-ahead."""
    if at >= len(text):
        return len(text)
    for sep in ("\n", " "):
        i = text.find(sep, at, at + 4096)
        if i > 0:
            return i
    return at
