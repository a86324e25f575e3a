"""OpenAI's n on the real default model, through `goinfer serve` and the openai SDK: each choice is
the reply to the same request with n=1 and seed + i, streamed or not, with a JSON schema, and
under a 10k-token prompt that is prefilled once for four choices."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sdk_models
from serve_process import serving

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

KEY, NAME = "test-key", "qwen"
ASK = [{"role": "user", "content": "Write one sentence about a lighthouse."}]
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 40}


@pytest.fixture(scope="module")
def oai(real_bundle) -> Iterator[openai.OpenAI]:
    bundle = real_bundle("qwen2.5-coder-0.5b", "gguf")
    with serving(NAME, bundle, KEY, "--max-concurrent", "4", "--kv-tokens", "45000") as url:  # 4 x 10.5k
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)


def _alone(oai, messages, seed: int, **kw) -> str:
    r = oai.chat.completions.create(model=NAME, messages=messages, n=1, seed=seed, **kw)
    return r.choices[0].message.content


def test_each_choice_is_the_n1_reply_with_seed_plus_its_index(oai):
    raw = oai.chat.completions.with_raw_response.create(model=NAME, messages=ASK, n=4, seed=100, **SAMPLED)
    sdk_models.openai_reply(raw.http_response.json())
    r = raw.parse()
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in r.choices]
    assert texts == [_alone(oai, ASK, 100 + i, **SAMPLED) for i in range(4)]
    assert len(set(texts)) > 1, texts
    assert r.usage.completion_tokens > r.usage.prompt_tokens > 0


def test_streamed_choices_equal_the_whole_reply(oai):
    whole = oai.chat.completions.create(model=NAME, messages=ASK, n=3, seed=7, **SAMPLED)
    parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finishes: dict[int, str] = {}
    usage = None
    stream = oai.chat.completions.create(
        model=NAME, messages=ASK, n=3, seed=7, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )
    for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            parts[ch.index].append(ch.delta.content or "")
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert ["".join(parts[i]) for i in range(3)] == [c.message.content for c in whole.choices]
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_schema_constrained_choices(oai):
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 20}},
              "required": ["color"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    ask = [{"role": "user", "content": "Name a color as JSON."}]
    r = oai.chat.completions.create(model=NAME, messages=ask, n=3, seed=3, response_format=fmt, **SAMPLED)
    for i, c in enumerate(r.choices):
        assert set(json.loads(c.message.content)) == {"color"}
        assert c.message.content == _alone(oai, ask, 3 + i, response_format=fmt, **SAMPLED)


def test_a_10k_token_prompt_for_four_choices(oai):
    lines = [f"line {i}: the value of item {i} is {i * 7 % 101}." for i in range(560)]
    ask = [{"role": "user", "content": "\n".join(lines) + "\nWhat is the value of item 440? Answer briefly."}]
    params = {"temperature": 0.7, "max_tokens": 16}
    r = oai.chat.completions.create(model=NAME, messages=ask, n=4, seed=21, **params)
    assert r.usage.prompt_tokens > 10_000, r.usage.prompt_tokens
    assert [c.message.content for c in r.choices] == [_alone(oai, ask, 21 + i, **params) for i in range(4)]
