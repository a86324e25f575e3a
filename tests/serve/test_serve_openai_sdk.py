"""The real `openai` SDK (sync, async, streaming) against `goinfer serve` on loopback, on a real model.

The server runs as its own process, started the way a user starts it; the same bundle is loaded in
this process too, so greedy replies and token counts are checked exactly, not just for plausibility.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import sdk_models
from serve_process import serving

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

KEY = "test-key"
NAME = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def bundle(real_bundle):
    return real_bundle("smollm2-135m", "int4")


@pytest.fixture(scope="module")
def server(bundle) -> Iterator[str]:
    with serving(NAME, bundle, KEY, "--max-queue", "4") as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def local(bundle):
    from goinfer.runtime.model import Model

    return Model.load(bundle)


def _greedy(model, ids: list[int], n: int) -> tuple[str, int]:
    from goinfer.runtime.decode import GenerationRequest
    from goinfer.runtime.sampler import SamplingParams

    events = list(model.generate(GenerationRequest(ids, SamplingParams(temperature=0, max_tokens=n))))
    return "".join(e.text for e in events), sum(e.token_id is not None for e in events)


def test_sync_chat_models_and_errors(server, local) -> None:
    client = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0)
    listed = client.models.list().data
    assert [m.id for m in listed] == [NAME]
    assert listed[0].model_extra["context_window"] == local.context_length
    assert listed[0].model_extra["vision"] is False

    raw = client.chat.completions.with_raw_response.create(
        model=NAME, messages=QUESTION, temperature=0, max_tokens=24
    )
    sdk_models.chat(raw.http_response.json())  # the SDK itself builds its object unchecked
    reply = raw.parse()
    text, n = _greedy(local, local.chat_prompt(QUESTION), 24)
    assert reply.choices[0].message.content == text
    assert "Paris" in text
    assert reply.usage.prompt_tokens == len(local.chat_prompt(QUESTION))
    assert reply.usage.completion_tokens == n
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + n

    a, b = (
        client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0.9, seed=42, max_tokens=16)
        .choices[0]
        .message.content
        for _ in range(2)
    )
    assert a == b

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match=f"context window of {local.context_length}"):
        long = [{"role": "user", "content": "word " * (local.context_length + 100)}]
        client.chat.completions.create(model=NAME, messages=long, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)


def test_streaming_chat_with_usage(server, local) -> None:
    client = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0)
    stream = client.chat.completions.create(
        model=NAME,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text, n = _greedy(local, local.chat_prompt(QUESTION), 24)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_async_completions_and_concurrent_chats(server, local) -> None:
    prompt = "The capital of France is"
    text, n = _greedy(local, local.encode(prompt), 8)
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string from the middle of the reply
    want, _ = _greedy(local, local.chat_prompt(QUESTION), 12)

    async def go():
        client = openai.AsyncOpenAI(base_url=server, api_key=KEY, max_retries=0)
        done = await client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=8)
        chats = await asyncio.gather(
            *(
                client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=12)
                for _ in range(3)
            )
        )
        stopped = await client.completions.create(
            model=NAME, prompt=prompt, temperature=0, max_tokens=8, stop=[stop]
        )
        await client.close()
        return done, chats, stopped

    done, chats, stopped = asyncio.run(go())
    assert done.choices[0].text == text and done.usage.completion_tokens == n
    assert done.usage.prompt_tokens == len(local.encode(prompt))
    assert [c.choices[0].message.content for c in chats] == [want] * 3  # queued one after another
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
