"""Mistral `[TOOL_CALLS]` calls: one JSON array of call objects after the (special) opener token:

[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

from .base import CallFormat

FORMAT = CallFormat(
    name="mistral",
    opener="[TOOL_CALLS]",
    call_open=" [",
    joiner=", ",
    close="]",
)
