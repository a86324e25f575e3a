"""Each family's tool-call format on recorded model outputs: the streaming splitter (the one reader
of calls, under every chunking, the whole reply at once among them) and the call grammar (which
must accept what the splitter reads)."""

from __future__ import annotations

import json

import pytest
from fake_engine import byte_tokenizer_json
from goinfer.runtime import grammar as g
from goinfer.serve.events import Delta, Usage
from goinfer.serve.tools import Tool, call_format, call_grammar
from goinfer.serve.tools.formats import HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS, MISTRAL_TEKKEN
from goinfer.serve.tools.stream import ToolDeltas

WEATHER = Tool("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]})  # fmt: skip
TIME = Tool("get_time", "", {"type": "object", "properties": {"tz": {"type": "string"}}})
NAMES = {"get_weather", "get_time"}

# Recorded replies (Qwen2.5-Coder-0.5B for hermes; the families' documented forms for the others).
HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_TWO = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
HERMES_UNWRAPPED = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
HERMES_UNKNOWN = '{"name": "send_email", "arguments": {"to": "x"}}'
HERMES_PROSE = "The weather in Paris is usually mild. {not json} <tool_"
HERMES_FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
CODE = "```python\nprint({'name': 'get_weather'})\n```"
# Qwen2.5-Coder-1.5B under auto, explaining first (recorded; the tool renamed): the ```json block is
# the call, and what it wrote after the block is dropped (serving ends the reply there).
EXPLAINED = "To answer this, I need the `weather` in Paris. Here's how I can do it:\n\n"
HERMES_EXPLAINED = EXPLAINED + HERMES_FENCED + "\n\nAfter executing this function call, I will know."
PROSE_JSON = 'Here is the format:\n```json\n{"name": "send_email", "arguments": {}}\n```\nDone.'
PROSE_CODE = "Run this:\n```python\nprint(1)\n```\nand then ```\n{ x }\n``` too."
LLAMA3_TAGGED = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_BARE = ' {"name": "get_time", "parameters": {"tz": "UTC"}}'
MISTRAL_TWO = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"tz": "UTC"}}]'
)
# Mistral Nemo's form (its template's replay): no space, and each call's 9-character id after it.
MISTRAL_NEMO = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]'
# Mistral's v11+ form (Devstral, Mistral Small 3.2): name, maybe [CALL_ID], [ARGS], the arguments.
MISTRAL_NAMED_TWO = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
MISTRAL_NAMED_ID = 'Sure.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "unit": "c"}'
MISTRAL_NAMED_OTHER = '[TOOL_CALLS]send_email[ARGS]{"to": "x"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
# Qwen3's (Hermes) call after the reply's own prose, as its template replays one.
QWEN3_CALL = 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'

CASES = [
    (HERMES, HERMES_ONE, "", [("get_weather", {"city": "Paris"})]),
    (HERMES, HERMES_TWO, "Let me check.\n",
     [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "Europe/Paris"})]),
    (HERMES, HERMES_UNWRAPPED, "", [("get_weather", {"city": "Paris"})]),
    (HERMES, HERMES_UNKNOWN, HERMES_UNKNOWN, []),  # a name not supplied never becomes a call
    (HERMES, HERMES_PROSE, HERMES_PROSE, []),
    (HERMES, HERMES_FENCED, "", [("get_weather", {"city": "Paris"})]),  # Qwen2.5-Coder-0.5B, auto
    (HERMES, CODE, CODE, []),
    (HERMES, HERMES_EXPLAINED, EXPLAINED, [("get_weather", {"city": "Paris"})]),
    (HERMES, PROSE_JSON, PROSE_JSON, []),  # a fenced object that calls no supplied tool
    (HERMES, PROSE_CODE, PROSE_CODE, []),
    (LLAMA3, LLAMA3_TAGGED, "", [("get_weather", {"city": "Paris"})]),
    (LLAMA3, LLAMA3_BARE, "", [("get_time", {"tz": "UTC"})]),
    (MISTRAL, MISTRAL_TWO, "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    (MISTRAL_TEKKEN, MISTRAL_NEMO, "", [("get_weather", {"city": "Paris"})]),
    (HERMES, QWEN3_CALL, "Checking.\n", [("get_time", {"tz": "UTC"})]),
    (MISTRAL_ARGS, MISTRAL_NAMED_TWO, "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    (MISTRAL_ARGS, MISTRAL_NAMED_ID, "Sure.", [("get_weather", {"city": "Paris", "unit": "c"})]),
    (MISTRAL_ARGS, MISTRAL_NAMED_OTHER, "", [("get_time", {"tz": "UTC"})]),  # an unknown tool is no call
]  # fmt: skip


def _stream(fmt, pieces: list[str]) -> tuple[str, list[tuple[str, dict]], str]:
    deltas = [Delta(p) for p in pieces] + [Delta("", finish_reason="stop", usage=Usage(1, len(pieces)))]
    text, calls, finish = "", {}, None
    for d in ToolDeltas(fmt, NAMES)(deltas):
        text += d.text
        for t in d.tool_calls:
            if t.id is not None:
                assert t.id.startswith("call_") and t.name in NAMES
                calls[t.index] = [t.name, ""]
            calls[t.index][1] += t.arguments
        finish = d.finish_reason or finish
    return text, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))], finish


@pytest.mark.parametrize(("fmt", "text", "prose", "calls"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_the_splitter_reads_recorded_replies(fmt, text, prose, calls, size):
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    got_text, got_calls, finish = _stream(fmt, pieces)
    assert got_text == prose and got_calls == calls
    assert finish == ("tool_calls" if calls else "stop")


def test_prose_before_a_call_streams_before_the_call_ends():
    pieces = [
        *"Checking now. ",
        "<tool_call>",
        "\n",
        '{"name": "get_time", ',
        '"arguments": {"tz": "UTC"}}',
    ]
    deltas = iter([Delta(p) for p in pieces])
    out = ToolDeltas(HERMES, NAMES)(deltas)
    first = next(out)
    assert first.text == "C" and not first.tool_calls  # out before the model has finished the reply


def test_the_template_decides_the_format():
    assert call_format("{% if tools %}<tool_call>{% endif %}") == (HERMES, True)
    assert call_format("{{ messages }}") == (HERMES, False)  # the fallback
    assert call_format("{% for tool in tools %}[TOOL_CALLS]{% endfor %}")[0] is MISTRAL
    assert call_format("<|start_header_id|>{{ tools }}<|python_tag|>")[0] is LLAMA3


# The real checkpoints' templates (tests/fixtures/templates): each family's format, and whether the
# template renders tools itself (Phi-3.5's does not: the Hermes fallback).
REAL_TEMPLATES = {
    "qwen3.jinja": (HERMES, True),
    "llama3.2.jinja": (LLAMA3, True),
    "mistral-nemo.jinja": (MISTRAL_TEKKEN, True),
    "phi3.5.jinja": (HERMES, False),
    "mistral-small-3.2.jinja": (MISTRAL_ARGS, True),
}
# A tool conversation as an OpenAI client sends it back: our call id, the call turn's content null.
CALL_ID = "call_0123456789abcdef01234567"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": CALL_ID, "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "18C"},
]  # fmt: skip
# What each family's template replays of that conversation (transformers renders the same bytes).
REPLAYED = {
    "qwen3.jinja": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                    "<|im_start|>user\n<tool_response>\n18C\n</tool_response>"],
    "llama3.2.jinja": ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                       '<|start_header_id|>ipython<|end_header_id|>\n\n"18C"<|eot_id|>'],
    "mistral-nemo.jinja": ['[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather", '
                           '"description": "Weather in a city", "parameters": {',
                           '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
                           '"id": "f01234567"}]</s>[TOOL_RESULTS]{"content": 18C, "call_id": "f01234567"}'],
    "phi3.5.jinja": ['<|assistant|>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
                     "<|user|>\n<tool_response>\n18C\n</tool_response><|end|>"],
    "mistral-small-3.2.jinja": ['[TOOL_CALLS]get_weather[CALL_ID]f01234567[ARGS]{"city": "Paris"}</s>',
                                "[TOOL_RESULTS]f01234567[TOOL_CONTENT]18C[/TOOL_RESULTS]"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_real_templates_pick_their_format_and_replay_a_call(name):
    from goinfer.runtime.prompt import render_chat
    from goinfer.serve.tools import plan_tools, prepare_messages
    from tiny_gguf import TEMPLATES

    template = (TEMPLATES / name).read_text()
    assert call_format(template) == REAL_TEMPLATES[name]
    plan = plan_tools([WEATHER.openai()], "auto", None, template)
    messages = prepare_messages(CONVERSATION, plan, template)
    text = render_chat(template, messages, bos_token="<s>", eos_token="</s>", **plan.template_vars())
    for piece in REPLAYED[name]:
        assert piece in text, text
    assert "&#34;" not in text  # tojson's output joined with + stays unescaped (Nemo's keys)


@pytest.fixture(scope="module")
def tok() -> g.GrammarTokenizer:
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_str(byte_tokenizer_json()).get_vocab_size()
    return g.GrammarTokenizer(byte_tokenizer_json(), vocab, [vocab - 1]).start()


@pytest.mark.parametrize(
    ("fmt", "text"),
    [(HERMES, HERMES_TWO), (LLAMA3, LLAMA3_TAGGED), (MISTRAL, MISTRAL_TWO), (MISTRAL_TEKKEN, MISTRAL_NEMO),
     (MISTRAL_ARGS, MISTRAL_NAMED_TWO), (MISTRAL_ARGS, MISTRAL_NAMED_ID[len("Sure."):])],
)  # fmt: skip
def test_the_call_grammar_accepts_what_the_splitter_reads(tok, fmt, text):
    after = text[text.index(fmt.opener) + len(fmt.opener) :]
    m = tok.matcher(g.compile_lark(call_grammar(fmt, [WEATHER, TIME], parallel=True, tok=tok.get())))
    assert m.consume_tokens(tok.get().tokenize_str(after)), m.get_error()
    assert m.is_accepting()


def test_the_call_grammar_refuses_other_tools_and_bad_arguments(tok):
    grammar = g.compile_lark(call_grammar(HERMES, [WEATHER], parallel=False, tok=tok.get()))
    for bad in (
        '\n{"name": "get_time", "arguments": {}}',
        '\n{"name": "get_weather", "arguments": {"unit": "k"}}',
    ):
        m = tok.matcher(grammar)
        assert not m.consume_tokens(tok.get().tokenize_str(bad))


def test_double_encoded_arguments_stream():
    text = '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>'
    for size in (1, 5, 1000):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        deltas = [Delta(p) for p in pieces] + [Delta("", finish_reason="stop")]
        args = "".join(t.arguments for d in ToolDeltas(HERMES, NAMES)(deltas) for t in d.tool_calls)
        assert json.loads(json.loads(args)) == {"tz": "UTC"}


def test_a_code_reply_streams_once_it_cannot_be_a_fenced_call():
    pieces = ["``", "`py", "thon\n", "print(1)\n", "```"]
    out = list(ToolDeltas(HERMES, NAMES)(iter([Delta(p) for p in pieces])))
    assert out[0].text == "```py"  # held only while it could still open ```json


def test_a_fenced_call_after_prose_ends_the_reply():
    from goinfer.serve.tools import ToolPlan

    plan = ToolPlan((WEATHER, TIME), "auto", None, False, HERMES, True)
    end = plan.reply_end(HERMES_EXPLAINED)
    assert end is not None and HERMES_EXPLAINED[:end].endswith("}") and "After" not in HERMES_EXPLAINED[:end]
    assert plan.reply_end(PROSE_JSON) is None and plan.reply_end(EXPLAINED + "```json\n{") is None


def test_templates_get_transformers_tojson():
    from goinfer.runtime.prompt import render_chat

    # keys in the order given and no HTML escaping, as transformers renders tool schemas
    out = render_chat("{{ tools | tojson }}", [], add_generation_prompt=False, tools=[{"b": 1, "a": "<x>&"}])
    assert out == '[{"b": 1, "a": "<x>&"}]'


def test_schemas_are_closed_to_invented_keys_only_where_they_list_properties():
    s = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                          "free": {"type": "object"}, "open": {"type": "object",
                                          "properties": {}, "additionalProperties": True}},
         "allOf": [{"properties": {"x": {}}}]}  # fmt: skip
    c = g.closed(s)
    assert c["additionalProperties"] is False and c["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in c["properties"]["free"]  # lists no properties: any object
    assert c["properties"]["open"]["additionalProperties"] is True
    assert "additionalProperties" not in c["allOf"][0]
    assert "additionalProperties" not in s  # the request's schema is not changed
