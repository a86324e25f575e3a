"""Hermes / ChatML `<tool_call>` calls (Qwen2.5, and our fallback for templates without tools):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Qwen2.5-Coder rarely writes the wrapper under auto and emits the call object alone, so an
unwrapped object naming a supplied tool is accepted too.
"""

from .base import CallFormat

FORMAT = CallFormat(
    name="hermes",
    opener="<tool_call>",
    call_open="\n",
    joiner="\n</tool_call>\n<tool_call>\n",
    close="\n</tool_call>",
    unwrapped=True,
)
