"""A Qwen3-shaped model thinks, splits and budgets through chat completions, messages and responses,
served from a GGUF and from a Hugging Face folder.

The checkpoints are tiny_gguf's and tiny_hf's qwen3 (q/k norms per head, `<think>`/`</think>` single
tokens, Qwen3-0.6B's own chat template, tests/fixtures/templates/qwen3.jinja), each built and
served as a user would; the tokens are scripted as in test_thinking_apis.py. Both sources must give
the same prompts and the same replies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sdk_models
from goinfer.runtime import decode
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from sse import named_events
from thinking_fixtures import ANSWER, QUESTION, REPLY, THOUGHT, Scripted, ScriptedSampler

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
HEADERS = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def bundles(tiny_bundle, tmp_path_factory) -> dict[str, Path]:
    from goinfer.compiler.build import BuildOptions, build
    from tiny_hf import write_tiny_hf_dir

    folder = write_tiny_hf_dir(tmp_path_factory.mktemp("qwen3-hf") / "Qwen3-tiny", "qwen3")
    out = folder.parent / "qwen3-hf.giw"
    build(folder, out, BuildOptions(quant="f32", num_cores=2, kv_dtype="float32"), progress=lambda _m: None)
    return {"gguf": tiny_bundle("qwen3", "f32"), "folder": out}


@pytest.fixture(params=["gguf", "folder"])
def served(request, bundles, monkeypatch) -> Scripted:
    from goinfer.serve.model_engine import ModelEngine

    monkeypatch.setattr(decode, "Sampler", ScriptedSampler)
    engine = ModelEngine.load(bundles[request.param], self_test=False)
    s = Scripted(engine.model)
    s.engine = engine
    return s


async def post(client, path: str, body: dict[str, Any]) -> Any:
    r = await client.post(path, json=body, headers=HEADERS)
    assert r.status == 200, await r.text()
    return await r.json() if not body.get("stream") else named_or_data(await r.text())


def named_or_data(raw: str) -> list[dict[str, Any]]:
    """A stream's events: OpenAI's `data:` chunks, or the named events of the other two APIs."""
    if raw.startswith("data:"):
        return [json.loads(block[6:]) for block in raw.strip().split("\n\n") if block.startswith("data: {")]
    return named_events(raw)


@pytest.mark.asyncio
async def test_qwen3_thinks_splits_and_budgets_on_every_api(aiohttp_client, served) -> None:
    s = served
    control = s.model.thinking
    assert control is not None and control.default_on  # read from Qwen3-0.6B's own template
    script = s.say(REPLY)
    budgeted = s.text(script[1:4]).strip()  # 3 tokens inside the block, then the close is forced
    client = await aiohttp_client(create_app({"m": s.engine}, ServeConfig(**FAST)))
    prompt = len(s.model.chat_prompt(QUESTION))

    chat = {"model": "m", "messages": QUESTION, "max_tokens": 64}
    reply = sdk_models.chat(await post(client, "/v1/chat/completions", chat))
    m = reply["choices"][0]["message"]
    assert (m["reasoning_content"], m["content"]) == (THOUGHT, ANSWER)
    assert reply["usage"]["prompt_tokens"] == prompt
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == script.index(s.close_id) + 1
    chunks = [
        sdk_models.chunk(c) for c in await post(client, "/v1/chat/completions", {**chat, "stream": True})
    ]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    reply = sdk_models.chat(await post(client, "/v1/chat/completions", {**chat, "thinking_token_budget": 3}))
    m = reply["choices"][0]["message"]
    assert ScriptedSampler.forced == [4] and (m["reasoning_content"], m["content"]) == (budgeted, ANSWER)
    reply = sdk_models.chat(await post(client, "/v1/chat/completions", {**chat, "max_tokens": 3}))
    assert (
        reply["choices"][0]["message"]["content"] == "" and reply["choices"][0]["finish_reason"] == "length"
    )

    msg = {"model": "m", "messages": QUESTION, "max_tokens": 64}
    m = sdk_models.message(await post(client, "/v1/messages", msg))
    assert m["content"] == [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                            {"type": "text", "text": ANSWER}]  # fmt: skip
    events = [
        sdk_models.message_event(e) for e in await post(client, "/v1/messages", {**msg, "stream": True})
    ]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    m = sdk_models.message(
        await post(client, "/v1/messages", {**msg, "thinking": {"type": "enabled", "budget_tokens": 3}})
    )
    assert ScriptedSampler.forced == [4] and m["content"][0]["thinking"] == budgeted

    resp = {"model": "m", "input": QUESTION[0]["content"], "max_output_tokens": 64}
    r = sdk_models.response(await post(client, "/v1/responses", resp))
    assert [o["type"] for o in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"][0]["text"] == THOUGHT and r["output"][1]["content"][0]["text"] == ANSWER
    events = [
        sdk_models.response_event(e) for e in await post(client, "/v1/responses", {**resp, "stream": True})
    ]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == THOUGHT
    r = sdk_models.response(await post(client, "/v1/responses", {**resp, "max_output_tokens": 12}))
    assert ScriptedSampler.forced == [8] and r["status"] == "incomplete"
    assert r["output"][0]["content"][0]["text"] == s.text(script[1:8]).strip()

    # thinking off: Qwen3's closed empty block in the prompt, the answer at once
    s.say(ANSWER)
    off = {**chat, "chat_template_kwargs": {"enable_thinking": False}}
    reply = sdk_models.chat(await post(client, "/v1/chat/completions", off))
    assert reply["usage"]["prompt_tokens"] == len(s.model.chat_prompt(QUESTION, enable_thinking=False))
    assert reply["choices"][0]["message"]["content"] == ANSWER


def test_both_sources_render_the_same_prompts(bundles) -> None:
    from goinfer.runtime.model import Model

    gguf, folder = (Model.load(bundles[k], self_test=False) for k in ("gguf", "folder"))
    assert gguf.thinking == folder.thinking
    for variables in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        assert gguf.chat_prompt(QUESTION, **variables) == folder.chat_prompt(QUESTION, **variables)
