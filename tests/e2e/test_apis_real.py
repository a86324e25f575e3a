"""The Anthropic Messages and OpenAI Responses routes on the real default model, through
`goinfer serve` and the real `anthropic` and `openai` SDKs."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sdk_models
from serve_process import serving

pytestmark = pytest.mark.slow
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

KEY, NAME = "test-key", "qwen"
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY = {"extra_body": {"temperature": 0}}  # this anthropic SDK dropped the sampling arguments
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city", "input_schema": CITY}


def _prompt(usage) -> int:
    """An Anthropic reply's whole prompt: the uncached input tokens and those read from cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


@pytest.fixture(scope="module")
def url(real_bundle) -> Iterator[str]:
    with serving(NAME, real_bundle("qwen2.5-coder-0.5b", "gguf"), KEY) as u:
        yield u


@pytest.fixture(scope="module")
def claude(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


def test_messages_create_stream_and_count(claude):
    raw = claude.messages.with_raw_response.create(
        model=NAME, max_tokens=40, messages=ASK, **GREEDY, system="You are terse."
    )
    sdk_models.message(raw.http_response.json())  # the SDK itself builds its object unchecked
    m = raw.parse()
    text = m.content[0].text
    assert "Paris" in text and m.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(
        model=NAME, max_tokens=40, messages=ASK, **GREEDY, system="You are terse."
    ) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and final.usage.output_tokens == m.usage.output_tokens
    counted = claude.messages.count_tokens(model=NAME, messages=ASK, system="You are terse.")
    assert counted.input_tokens == _prompt(m.usage)


def test_messages_stop_sequences(claude):
    m = claude.messages.create(model=NAME, max_tokens=40, messages=ASK, **GREEDY)
    word = m.content[0].text.split()[2]
    cut = claude.messages.create(model=NAME, max_tokens=40, messages=ASK, stop_sequences=[word], **GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == m.content[0].text[: m.content[0].text.index(word)]


def test_messages_forced_tool_use_then_result(claude):
    ask = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    m = claude.messages.create(model=NAME, max_tokens=80, messages=ask, tools=[WEATHER], **GREEDY,
                               tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and "paris" in use.input["city"].lower()
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 degrees Celsius"}
    turn = [*ask, {"role": "assistant", "content": m.content}, {"role": "user", "content": [result]}]
    answer = claude.messages.create(model=NAME, max_tokens=80, messages=turn, tools=[WEATHER], **GREEDY)
    assert answer.stop_reason in ("end_turn", "tool_use", "max_tokens") and answer.content
    # the call and its result were in the prompt (input_tokens counts the uncached part, as Anthropic's)
    assert _prompt(answer.usage) > _prompt(m.usage)


def test_messages_role_400_and_auth_401(url, claude):
    with pytest.raises(anthropic.BadRequestError, match="'system'"):
        claude.messages.create(model=NAME, max_tokens=8, messages=[{"role": "system", "content": "x"}])
    bad = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=NAME, max_tokens=8, messages=ASK)


def test_responses_plain_streamed_format_and_continued(oai):
    raw = oai.responses.with_raw_response.create(
        model=NAME, input=ASK[0]["content"], temperature=0, max_output_tokens=40
    )
    r = raw.parse()
    sdk_models.response(raw.http_response.json())
    assert "Paris" in r.output_text and r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    with oai.responses.stream(model=NAME, input=ASK[0]["content"], temperature=0, max_output_tokens=40) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response() if "response.completed" in kinds else None
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    if final is not None:
        assert final.output_text == r.output_text

    fmt = {"type": "json_schema", "name": "capital", "strict": True, "schema": {
        "type": "object", "properties": {"country": {"type": "string", "maxLength": 30},
                                         "capital": {"type": "string", "maxLength": 30}},
        "required": ["country", "capital"], "additionalProperties": False}}  # fmt: skip
    j = oai.responses.create(
        model=NAME, input="The capital of France, as JSON.", text={"format": fmt}, temperature=0
    )
    assert set(json.loads(j.output_text)) == {"country", "capital"}

    follow = oai.responses.create(model=NAME, input="And of Italy?", previous_response_id=r.id, temperature=0,
                                  max_output_tokens=40)  # fmt: skip
    assert follow.usage.input_tokens > r.usage.input_tokens  # the first turn was replayed
    assert oai.responses.retrieve(follow.id).output_text == follow.output_text
