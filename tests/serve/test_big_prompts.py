"""A prompt far over the window is refused cheaply and never stalls anyone else (issue 32 item 3).

A 4 MiB body used to be tokenized in full (2.1M tokens, the GIL held throughout) before the window
check: a stream already decoding froze for 5 s. Now the prompt is refused from a bound on its
characters, or after counting it in bounded pieces, with the tokenizer's GIL released
(runtime/prompt.py). GrammarEngine tokenizes with a real `tokenizers` tokenizer, as a bundle does.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from fake_engine import GrammarEngine, byte_tokenizer_json
from goinfer.runtime import prompt
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from tokenizers import Tokenizer

MiB = 1 << 20
FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
STEP_S = 0.01  # the stream's decode step
GAP_LIMIT_S = 0.1  # what a 4 MiB neighbour may add to the stream's gap between tokens


def big_prompt(n: int) -> str:
    line = "the weather is sunny and the wind is low, said the forecast for today.\n"
    return (line * (n // len(line) + 1))[:n]


async def _stream_gaps(client, tokens: int, gaps: list[float], started: asyncio.Event) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": tokens, "temperature": 0}  # fmt: skip
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 200
    last = None
    async for line in r.content:
        if not line.startswith(b"data: {"):
            continue
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        started.set()


@pytest.mark.asyncio
@pytest.mark.parametrize("window", [4096, 400_000], ids=["refused-by-the-bound", "counted-in-pieces"])
async def test_a_4_mib_prompt_beside_a_live_stream(aiohttp_client, window: int) -> None:
    """The big prompt is a 400 context_length_exceeded; the stream beside it keeps its pace."""
    streamer = GrammarEngine(script="the weather is sunny " * 40, context_window=window, step_s=STEP_S)
    client = await aiohttp_client(create_app({"fake": streamer}, ServeConfig(**FAST)))
    gaps: list[float] = []
    started = asyncio.Event()
    stream = asyncio.create_task(_stream_gaps(client, 150, gaps, started))
    await asyncio.wait_for(started.wait(), 10)
    baseline = len(gaps)
    t0 = time.perf_counter()
    big = {"model": "fake", "messages": [{"role": "user", "content": big_prompt(4 * MiB - 128 * 1024)}]}
    r = await client.post("/v1/chat/completions", json=big)
    refused_in = time.perf_counter() - t0
    body = await r.json()
    await stream
    assert r.status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "at least" in body["error"]["message"]
    during = gaps[baseline:]
    assert len(during) > 3, "the stream must still be running while the big prompt is refused"
    print(f"\nwindow {window}: refused in {refused_in * 1e3:.0f} ms; the stream's largest gap "
          f"{max(during) * 1e3:.0f} ms (step {STEP_S * 1e3:.0f} ms)")  # fmt: skip
    assert max(during) < STEP_S + GAP_LIMIT_S


def test_encode_within_refuses_early_and_is_exact_when_it_fits() -> None:
    tok = Tokenizer.from_str(byte_tokenizer_json())
    chars = prompt.longest_token(tok)
    # An added token of 14 characters, over and over, no space: a window that holds it is under a
    # quarter of its characters, so it is counted in pieces (each cut splitting a token) before
    # the exact encode.
    text = "<|python_tag|>" * 30_000
    exact = tok.encode(text, add_special_tokens=False).ids
    assert len(text) > prompt.WHOLE_CHARS_PER_TOKEN * (len(exact) + 1)
    # fits: the very ids of one whole encode, whatever path counted them
    assert prompt.encode_within(tok, text, len(exact) + 1, chars) == exact
    head = tok.encode(text[:1000], add_special_tokens=False).ids
    assert prompt.encode_within(tok, text[:1000], 10_000, chars) == head  # short: in one go
    # one token over: refused exactly (the pieces could not tell)
    with pytest.raises(prompt.PromptTooLong) as e:
        prompt.encode_within(tok, text, len(exact), chars)
    assert e.value.exact and e.value.tokens == len(exact) and e.value.window == len(exact)
    # far over, past what the character bound can tell: refused from the pieces, counting stopped early
    with pytest.raises(prompt.PromptTooLong) as e:
        prompt.encode_within(tok, text, 20_000, chars)
    assert not e.value.exact and 20_000 <= e.value.tokens < len(exact)
    # a prose prompt far over the window: counted in pieces cut at spaces
    with pytest.raises(prompt.PromptTooLong) as e:
        prompt.encode_within(tok, big_prompt(400_000), 20_000, chars)
    assert not e.value.exact and e.value.tokens >= 20_000
    # farther: refused from the character bound, before any tokenizing
    with pytest.raises(prompt.PromptTooLong) as e:
        prompt.encode_within(tok, text * 20, 1000, chars)
    assert not e.value.exact and e.value.tokens > 1000
