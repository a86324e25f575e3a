"""Message content as the plain text a chat template reads, the same way for every API.

A string is the text; a list of parts is its text parts joined by newlines. No model here reads
images yet, so an image part is refused as needing a vision model; any other part as unsupported.
"""

from __future__ import annotations

from typing import Any

from .errors import APIError, bad_request

TEXT = frozenset({"text"})  # chat completions and Anthropic
RESPONSES_TEXT = frozenset({"text", "input_text", "output_text"})


def text_of(content: Any, where: str, kinds: frozenset[str] = TEXT) -> str:
    """`content` (a string, None, or a list of parts with `type` and `text`) as one string."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(text, str):
            raise refused(f"{where}.{j}", kind)
        texts.append(text)
    return "\n".join(texts)


def refused(at: str, kind: Any, why: str = "only text parts are accepted") -> APIError:
    """The 400 for a part (or block) of a kind that cannot be read here."""
    what = f"{at}: unsupported content part type {kind!r}"
    if isinstance(kind, str) and "image" in kind:
        return bad_request(f"{what}: image content needs a vision model (vision: false here)", f"{at}.type")
    return bad_request(f"{what}; {why}", param=f"{at}.type")
