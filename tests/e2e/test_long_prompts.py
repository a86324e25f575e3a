"""Prompts longer than one prefill chunk (2,048 tokens), on every family: the runtime, `goinfer
generate` and the HTTP server, on tiny models with an 8k window.

A 3,000-token prompt takes two chunks on llama and qwen2 and a thousand on gemma3 (its tiny
sliding window is 4, so its chunks are 3 tokens). The last logits must match the numpy reference
forward pass over the whole prompt at once, so a cache that loses or misplaces a chunk fails.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner
from goinfer.cli.main import main
from reference import reference_logits

CONTEXT = 8192
FAMILIES = ("llama", "qwen2", "gemma3")
PROMPT_TOKENS = 3000


def _ids(vocab: int, n: int = PROMPT_TOKENS) -> list[int]:
    return np.random.default_rng(7).integers(0, vocab, n).tolist()


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _long_text(model, tokens: int) -> str:
    """Text of at least `tokens` prompt tokens, in words the tiny vocabulary has."""
    text = "hello world "
    while len(model.encode(text)) < tokens:
        text *= 2
    return text


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_past_one_chunk_matches_the_reference(family, tiny_bundle, tiny_gguf) -> None:
    from goinfer.runtime.model import Model

    m = Model.load(tiny_bundle(family, "f32", context=CONTEXT), self_test=False)
    assert m.context_length == CONTEXT and m.prefill_chunk < PROMPT_TOKENS
    ids = _ids(m.spec.vocab_size)
    want = reference_logits(tiny_gguf(family, "F32", CONTEXT), ids)
    got = m.prefill(ids)
    assert _cos(got, want[-1]) > 0.9999
    assert int(np.argmax(got)) == int(np.argmax(want[-1]))
    # Every position, in pieces: the positions each side of a chunk boundary agree too.
    pieces = list(m.prefill_logits(ids))
    assert sum(len(p) for p in pieces) == len(ids)
    rows = np.concatenate(pieces)
    for pos in (0, m.prefill_chunk - 1, m.prefill_chunk, len(ids) - 1):
        assert _cos(rows[pos], want[pos]) > 0.9999, pos
    # Decoding goes on after the long prompt, from the same cache.
    step = m.decode_step(int(np.argmax(got)))
    ref_step = reference_logits(tiny_gguf(family, "F32", CONTEXT), [*ids, int(np.argmax(got))])[-1]
    assert _cos(step, ref_step) > 0.9999


def test_prefill_logits_come_in_bounded_pieces(tiny_bundle, monkeypatch) -> None:
    from goinfer.runtime import model as model_mod

    m = model_mod.Model.load(tiny_bundle("llama", "f32", context=CONTEXT), self_test=False)
    monkeypatch.setattr(model_mod, "LOGITS_CHUNK_BYTES", 4 * m.spec.vocab_size * 100)
    sizes = [len(p) for p in m.prefill_logits(_ids(m.spec.vocab_size, 250))]
    assert sizes == [100, 100, 50]


def test_generate_takes_a_long_prompt(tiny_bundle) -> None:
    from goinfer.runtime.model import Model

    bundle = tiny_bundle("qwen2", "f32", context=CONTEXT)
    text = _long_text(Model.load(bundle, self_test=False), PROMPT_TOKENS)
    args = ["generate", str(bundle), text, "--max-tokens", "4", "--temperature", "0", "--no-selftest"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


def test_the_server_answers_a_long_prompt_and_refuses_one_over_the_window(tiny_bundle, monkeypatch) -> None:
    from goinfer.runtime.model import Model
    from goinfer.serve import server

    bundle = tiny_bundle("llama", "f32", context=CONTEXT)
    model = Model.load(bundle, self_test=False)
    long_text, too_long = _long_text(model, PROMPT_TOKENS), _long_text(model, CONTEXT + 1)
    got = {}
    monkeypatch.setattr(server, "run", lambda app, config, ctx: got.update(app=app))
    result = CliRunner().invoke(main, ["serve", "--model", f"tiny={bundle}", "--no-selftest"])
    assert result.exit_code == 0, result.output

    async def ask(*contents: str) -> list[tuple[int, dict]]:
        replies = []
        async with TestClient(TestServer(got["app"])) as client:
            for content in contents:
                body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 3}
                resp = await client.post("/v1/chat/completions", json={**body, "temperature": 0})
                replies.append((resp.status, await resp.json()))
        return replies

    (status, reply), (status_over, over) = asyncio.run(ask(long_text, too_long))
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] > PROMPT_TOKENS and reply["usage"]["completion_tokens"] >= 1
    status, reply = status_over, over
    assert status == 400, reply
    assert reply["error"]["code"] == "context_length_exceeded"
    assert f"context window of {CONTEXT} tokens" in reply["error"]["message"]
