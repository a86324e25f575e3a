"""Llama 3.x JSON calls: `<|python_tag|>` then `{"name": ..., "parameters": {...}}`; several calls
are joined by "; ". A reply that starts with the bare object is a call as well.
"""

from .base import CallFormat

FORMAT = CallFormat(
    name="llama3",
    opener="<|python_tag|>",
    call_open="",
    joiner="; ",
    close="",
    args_key="parameters",
    unwrapped=True,
)
