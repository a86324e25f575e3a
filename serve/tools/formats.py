"""Each family's tool-call syntax, as data: the opener, how calls are joined and closed, the key the
arguments sit under. The grammar that constrains a call (tools/__init__.py) and the splitter that
reads calls back (tools/stream.py) follow from these fields alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallFormat:
    """One family's call syntax: opener, one call object per call, joiner between calls, closer."""

    name: str
    opener: str  # the text (often one special token) that starts the calls
    call_open: str  # between the opener and the first call object
    joiner: str  # between two calls
    close: str  # after the last call
    args_key: str = "arguments"
    unwrapped: bool = False  # a reply that starts with a call object (no opener) is a call too
    id_key: str = ""  # a key a call object may carry its id under, after the arguments (Mistral's)
    # Named form (Mistral's v11+ tokenizers): a call is not a JSON object but the tool's name, an
    # optional `id_tag` and id, then `args_tag` and the arguments' JSON; calls are joined by `joiner`.
    args_tag: str = ""
    id_tag: str = ""


# Hermes / ChatML (Qwen2.5, and our fallback for templates without tools):
#     <tool_call>
#     {"name": "get_weather", "arguments": {"city": "Paris"}}
#     </tool_call>
# Qwen2.5-Coder rarely writes the wrapper under auto and emits the call object alone, so an unwrapped
# object naming a supplied tool is accepted too.
HERMES = CallFormat(
    name="hermes",
    opener="<tool_call>",
    call_open="\n",
    joiner="\n</tool_call>\n<tool_call>\n",
    close="\n</tool_call>",
    unwrapped=True,
)

# Llama 3.x: `<|python_tag|>` then {"name": ..., "parameters": {...}}; several calls joined by "; ".
# A reply that starts with the bare object is a call as well.
LLAMA3 = CallFormat(
    name="llama3",
    opener="<|python_tag|>",
    call_open="",
    joiner="; ",
    close="",
    args_key="parameters",
    unwrapped=True,
)

# Mistral: one JSON array of call objects after the (special) opener token:
#     [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
MISTRAL = CallFormat(
    name="mistral",
    opener="[TOOL_CALLS]",
    call_open=" [",
    joiner=", ",
    close="]",
)
# Mistral's tekken checkpoints (Nemo, Ministral-8B) write the array right after the opener, each call
# with the 9-character id their templates replay:
#     [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]
MISTRAL_TEKKEN = CallFormat(
    name="mistral",
    opener="[TOOL_CALLS]",
    call_open="[",
    joiner=", ",
    close="]",
    id_key="id",
)

# Mistral's v11+ tokenizers (Devstral, Mistral Small 3.2, Magistral): the opener, the tool's name, an
# optional [CALL_ID] and id, [ARGS] and the arguments; each further call opens again:
#     [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}
MISTRAL_ARGS = CallFormat(
    name="mistral",
    opener="[TOOL_CALLS]",
    call_open="",
    joiner="[TOOL_CALLS]",
    close="",
    args_tag="[ARGS]",
    id_tag="[CALL_ID]",
)
