"""Incremental detokenization that never emits half a UTF-8 character.

Decoding token by token breaks multi-byte characters and SentencePiece spacing, so we decode the
whole suffix since the last emitted point and emit only text that is final: not ending in U+FFFD
(an incomplete byte sequence that later tokens will finish).
"""

from __future__ import annotations

from tokenizers import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prefix_ids: list[int] | None = None):
        self.tok = tokenizer
        # A little context before the new tokens keeps leading-space rules right.
        self.ids: list[int] = list(prefix_ids[-4:]) if prefix_ids else []
        self.start = len(self.ids)
        self.emitted = self._decode(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False) if ids else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the newly final text (maybe empty)."""
        self.ids.append(token_id)
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        self._compact()
        return new

    def flush(self) -> str:
        text = self._decode(self.ids)
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new

    def _compact(self) -> None:
        # Keep the window short so each push stays O(1) on long generations.
        if len(self.ids) > 16:
            self.ids = self.ids[-4:]
            self.emitted = self._decode(self.ids)
