"""Chat templates: the checkpoint's own jinja2 template, rendered the way HF transformers does."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from markupsafe import Markup


class ChatTemplateError(ValueError):
    pass


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> Markup:
    # transformers' tojson, not jinja2's: keys in the given order, no HTML escaping (tool schemas).
    from markupsafe import Markup

    text = json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return Markup(text)


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
