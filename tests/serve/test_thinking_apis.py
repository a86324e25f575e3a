"""A thinking model served through chat completions, messages and responses, on a real tiny bundle.

The model is tiny_gguf's qwen2 with `<think>`/`</think>` as tokens of their own and a Qwen3-style
template that thinks unless told not to (thinking_fixtures.py). Its forward passes, the scheduler,
the decode loop (the budget's forced token), the detokenizer and every API's reply are the real
ones; only the choice of each token is scripted (`ScriptedSampler` stands in for the runtime's
sampler), so the split, the budget and the stream shapes are checked exactly, each body and event
held to the openai and anthropic SDKs' types.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sdk_models
from goinfer.runtime import decode
from goinfer.runtime.thinking import ThinkingConfig
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from goinfer.serve.keys import REGISTRY
from sse import named_events
from thinking_fixtures import (
    ANSWER,
    QUESTION,
    REPLY,
    THOUGHT,
    Scripted,
    ScriptedSampler,
    build_thinking_bundle,
)

pytestmark = pytest.mark.asyncio

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
HEADERS = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def bundle(tiny_gguf, tmp_path_factory) -> Path:
    source = tiny_gguf("qwen2", "F32", 2048)  # room for a tools prompt
    return build_thinking_bundle(source, tmp_path_factory.mktemp("thinking"))


class Served(Scripted):
    """A fresh engine over the bundle (an app closes its engines when it stops), and the script."""

    def __init__(self, bundle: Path, config=None):
        from goinfer.serve.model_engine import ModelEngine

        self.engine = ModelEngine.load(bundle, self_test=False, config=config)
        super().__init__(self.engine.model)
        assert self.model.thinking.default_on  # read from the template

    def prompt_tokens(self, messages: list[dict[str, Any]], **variables: Any) -> int:
        return len(self.model.chat_prompt(messages, **variables))


@pytest.fixture
def served(bundle, monkeypatch):
    monkeypatch.setattr(decode, "Sampler", ScriptedSampler)
    return lambda config=None: Served(bundle, config)


async def client_for(aiohttp_client, s: Served, **config: Any):
    return await aiohttp_client(create_app({"m": s.engine}, ServeConfig(**{**FAST, **config})))


async def chat(client, stream: bool = False, **kw: Any) -> dict[str, Any]:
    body = {"model": "m", "messages": QUESTION, "max_tokens": 64, **kw}
    r = await client.post("/v1/chat/completions", json={**body, "stream": stream})
    assert r.status == 200, await r.text()
    if not stream:
        return sdk_models.chat(await r.json())
    chunks = [sdk_models.chunk(json.loads(line[6:])) for line in (await r.text()).split("\n\n")
              if line.startswith("data: {")]  # fmt: skip
    return {"chunks": chunks}


def message_of(reply: dict[str, Any]) -> dict[str, Any]:
    return reply["choices"][0]["message"]


def streamed(chunks: list[dict[str, Any]]) -> tuple[str, str, str | None]:
    """(reasoning, content, finish) joined from a chat stream's deltas; each delta carries one."""
    thought, text, finish = "", "", None
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            assert not ("reasoning_content" in d and d.get("content")), d
            assert not (text and "reasoning_content" in d), "the reasoning comes before the answer"
            thought += d.get("reasoning_content", "")
            text += d.get("content") or ""
            finish = ch["finish_reason"] or finish
    return thought, text, finish


async def test_chat_splits_the_reasoning_from_the_answer(aiohttp_client, served) -> None:
    s = served()
    script = s.say(REPLY)
    client = await client_for(aiohttp_client, s)
    reply = await chat(client)
    m = message_of(reply)
    assert m["content"] == ANSWER and m["reasoning_content"] == THOUGHT
    assert reply["choices"][0]["finish_reason"] == "stop"
    usage = reply["usage"]
    assert usage["completion_tokens"] == len(script) - 1  # the end of turn is not text
    assert usage["completion_tokens_details"] == {"reasoning_tokens": script.index(s.close_id) + 1}
    assert usage["prompt_tokens"] == s.prompt_tokens(QUESTION)  # the template's default: it thinks
    assert ScriptedSampler.forced == []  # room to spare: the budget never acted

    out = await chat(client, stream=True, stream_options={"include_usage": True})
    chunks = out["chunks"]
    assert streamed(chunks) == (THOUGHT, ANSWER, "stop")
    assert chunks[-1]["usage"] == {**usage, "prompt_tokens_details": {"cached_tokens": 24}}  # now warm
    assert sum("reasoning_content" in c["choices"][0]["delta"] for c in chunks if c["choices"]) > 1


async def test_each_of_n_choices_is_split_and_the_usage_sums_their_reasoning(aiohttp_client, served) -> None:
    """n > 1: every choice gets its own split (the script writes the same reply for each), streamed
    under its index; the usage counts the prompt once and every choice's reasoning tokens."""
    s = served()
    script = s.say(REPLY)
    client = await client_for(aiohttp_client, s)
    reply = await chat(client, n=2)
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    for c in reply["choices"]:
        assert c["message"]["content"] == ANSWER and c["message"]["reasoning_content"] == THOUGHT
    usage = reply["usage"]
    assert usage["completion_tokens"] == 2 * (len(script) - 1)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 2 * (script.index(s.close_id) + 1)}
    chunks = (await chat(client, stream=True, n=2))["chunks"]
    for i in (0, 1):
        mine = [{**c, "choices": [ch for ch in c["choices"] if ch["index"] == i]} for c in chunks]
        assert streamed(mine) == (THOUGHT, ANSWER, "stop")


async def test_logprobs_are_the_answer_s_tokens(aiohttp_client, served) -> None:
    s = served()
    s.say(REPLY)
    client = await client_for(aiohttp_client, s)
    for stream in (False, True):
        reply = await chat(client, stream=stream, logprobs=True, top_logprobs=2)
        chunks = reply["chunks"] if stream else [{"choices": [{"logprobs": reply["choices"][0]["logprobs"]}]}]
        entries = [
            e for c in chunks for ch in c["choices"] for e in (ch.get("logprobs") or {}).get("content", [])
        ]
        assert "".join(e["token"] for e in entries) == ANSWER, stream


async def test_the_budget_forces_the_close_and_the_answer_follows(aiohttp_client, served) -> None:
    s = served()
    script = s.say(REPLY)
    after = script[script.index(s.close_id) + 1 :]
    client = await client_for(aiohttp_client, s)

    # the room rule: max_tokens 12 closes the block by token 9 (3/4), leaving 3 to answer
    reply = await chat(client, max_tokens=12)
    m = message_of(reply)
    assert ScriptedSampler.forced == [8]
    assert m["reasoning_content"] == s.text(script[1:8]).strip()
    assert m["content"] == s.text(after[:3]).lstrip()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 12 and reply["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": 9
    }

    # the request's own budget: 3 tokens inside the block, then the whole answer
    for budget_field in ("thinking_token_budget", "thinking_budget_tokens"):
        reply = await chat(client, **{budget_field: 3})
        m = message_of(reply)
        assert ScriptedSampler.forced == [4]
        assert (m["reasoning_content"], m["content"]) == (s.text(script[1:4]).strip(), ANSWER)
        assert reply["choices"][0]["finish_reason"] == "stop"

    # streamed, the same reply
    out = await chat(client, stream=True, thinking_token_budget=3)
    assert streamed(out["chunks"]) == (s.text(script[1:4]).strip(), ANSWER, "stop")

    # a server's --reasoning-budget N is the budget of a request that names none
    s = served()
    s.say(REPLY)
    client = await client_for(aiohttp_client, s, thinking=ThinkingConfig(budget="2"))
    assert message_of(await chat(client))["reasoning_content"] == s.text(script[1:3]).strip()
    assert message_of(await chat(client, thinking_token_budget=5))["reasoning_content"] == (
        s.text(script[1:6]).strip()
    )


async def test_the_budget_holds_under_speculation(aiohttp_client, served) -> None:
    from goinfer.runtime.config import SchedulerConfig

    echo = [{"role": "user", "content": f"Say: {THOUGHT} {THOUGHT}"}]  # n-grams to draft the reasoning from
    replies = []
    for config in (None, SchedulerConfig(spec="ngram")):
        s = served(config)
        script = s.say(REPLY)
        client = await client_for(aiohttp_client, s)
        replies.append(message_of(await chat(client, messages=echo, thinking_token_budget=3)))
        assert ScriptedSampler.forced == [4]
    await client.server.app[REGISTRY].route("m").idle.wait()  # the run has closed its generation...
    s.engine.scheduler.sync()  # ...and the scheduler has released it, counting its drafts
    assert s.engine.scheduler.drafted > 0  # the drafts guessed the reasoning on; the close was forced
    assert replies[0] == replies[1] == {**replies[0], "reasoning_content": s.text(script[1:4]).strip()}


async def test_a_reply_that_ends_inside_its_block_has_no_answer(aiohttp_client, served) -> None:
    s = served()
    script = s.say(REPLY)
    client = await client_for(aiohttp_client, s)
    reply = await chat(client, max_tokens=3)  # under 4 tokens: no room rule
    m = message_of(reply)
    assert m["content"] == "" and m["reasoning_content"] == s.text(script[1:3]).strip()
    assert reply["choices"][0]["finish_reason"] == "length"


async def test_stop_strings_match_the_answer_only(aiohttp_client, served) -> None:
    s = served()
    s.say(REPLY)
    client = await client_for(aiohttp_client, s)
    m = message_of(await chat(client, stop=["make"]))  # in the reasoning only: nothing stops
    assert (m["reasoning_content"], m["content"]) == (THOUGHT, ANSWER)
    reply = await chat(client, stop=[" is"])
    assert message_of(reply)["content"] == "It" and reply["choices"][0]["finish_reason"] == "stop"
    out = await chat(client, stream=True, stop=[" is"])
    assert streamed(out["chunks"]) == (THOUGHT, "It", "stop")


async def test_modes_and_per_request_controls(aiohttp_client, served) -> None:
    s = served()
    on, off = s.prompt_tokens(QUESTION), s.prompt_tokens(QUESTION, enable_thinking=False)
    assert off > on  # off writes an empty closed block after the assistant tag
    client = await client_for(aiohttp_client, s)
    s.say(ANSWER)  # thinking off: the model answers at once
    for kw in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        reply = await chat(client, **kw)
        assert reply["usage"]["prompt_tokens"] == off, kw
        assert message_of(reply)["content"] == ANSWER and "reasoning_content" not in message_of(reply)
        assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    s.say(REPLY)
    for effort in ("low", "high", "medium"):  # any other effort changes nothing
        assert (await chat(client, reasoning_effort=effort))["usage"]["prompt_tokens"] == on
    # reasoning_format none: no split, the raw text in content, markup included
    reply = await chat(client, reasoning_format="none")
    assert message_of(reply)["content"] == REPLY and "reasoning_content" not in message_of(reply)
    assert "completion_tokens_details" not in reply["usage"]
    assert message_of(await chat(client, reasoning_format="deepseek"))["content"] == ANSWER
    flag = "chat_template_kwargs.enable_thinking"
    for bad, param in (({"reasoning_format": "raw"}, "reasoning_format"),
                       ({"chat_template_kwargs": {"enable_thinking": "yes"}}, flag),
                       ({"thinking_token_budget": -1}, "thinking_token_budget")):  # fmt: skip
        r = await client.post("/v1/chat/completions", json={"model": "m", "messages": QUESTION, **bad})
        assert r.status == 400, bad
        assert sdk_models.openai_error(await r.json())["error"]["param"] == param

    # the server's mode, and a request that overrides it
    s = served()
    s.say(ANSWER)
    client = await client_for(aiohttp_client, s, thinking=ThinkingConfig(mode="off"))
    assert (await chat(client))["usage"]["prompt_tokens"] == off
    s.say(REPLY)
    reply = await chat(client, chat_template_kwargs={"enable_thinking": True})
    assert reply["usage"]["prompt_tokens"] == on and message_of(reply)["reasoning_content"] == THOUGHT


async def test_constrained_replies_render_thinking_off(aiohttp_client, served) -> None:
    s = served()
    off = s.prompt_tokens(QUESTION, enable_thinking=False)
    s.say('{"a": 4}')
    client = await client_for(aiohttp_client, s)
    reply = await chat(client, response_format={"type": "json_object"})
    assert reply["usage"]["prompt_tokens"] == off and message_of(reply)["content"] == '{"a": 4}'


async def test_a_tool_call_follows_the_reasoning(aiohttp_client, served) -> None:
    s = served()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    s.say(f"<think>\nI should look it up.\n</think>\n\n{call}")
    client = await client_for(aiohttp_client, s)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
    reply = await chat(client, tools=[weather], max_tokens=200)  # a byte-level vocabulary spells it long
    m = message_of(reply)
    assert m["reasoning_content"] == "I should look it up." and m["content"] is None
    assert [c["function"] for c in m["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    assert reply["choices"][0]["finish_reason"] == "tool_calls"


# -- Anthropic's Messages -------------------------------------------------------------------------------
async def messages(client, stream: bool = False, **kw: Any):
    body = {"model": "m", "max_tokens": 64, "messages": QUESTION, **kw}
    r = await client.post("/v1/messages", json={**body, "stream": stream}, headers=HEADERS)
    assert r.status == 200, await r.text()
    if not stream:
        return sdk_models.message(await r.json())
    return [sdk_models.message_event(e) for e in named_events((await r.read()).decode())]


def prompt_of(m: dict[str, Any]) -> int:
    """A message's prompt tokens: Anthropic's input_tokens count those not read from the cache."""
    return m["usage"]["input_tokens"] + m["usage"].get("cache_read_input_tokens", 0)


async def test_messages_answer_with_a_thinking_block(aiohttp_client, served) -> None:
    s = served()
    script = s.say(REPLY)
    client = await client_for(aiohttp_client, s)
    m = await messages(client)
    assert m["content"] == [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                            {"type": "text", "text": ANSWER}]  # fmt: skip
    assert m["stop_reason"] == "end_turn" and m["usage"]["output_tokens"] == len(script) - 1

    events = await messages(client, stream=True)
    kinds = [e["type"] for e in events]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert starts == ["thinking", "text"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert deltas == sorted(deltas, key=lambda t: t != "thinking_delta")  # every thinking delta first
    assert (
        "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
        == THOUGHT
    )

    # the anthropic SDK reads the stream into the same message
    from anthropic import AsyncAnthropic

    sdk = AsyncAnthropic(base_url=str(client.make_url("")), api_key="none", max_retries=0)
    async with sdk.messages.stream(model="m", max_tokens=64, messages=QUESTION) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == (THOUGHT, ANSWER)


async def test_messages_thinking_controls_and_budget(aiohttp_client, served) -> None:
    s = served()
    script = s.say(REPLY)
    client = await client_for(aiohttp_client, s)
    m = await messages(client, thinking={"type": "enabled", "budget_tokens": 3})
    assert ScriptedSampler.forced == [4]
    assert m["content"][0]["thinking"] == s.text(script[1:4]).strip() and m["content"][1]["text"] == ANSWER
    # cut inside its block: max_tokens, and only the thinking block
    m = await messages(client, max_tokens=3)
    assert m["stop_reason"] == "max_tokens" and [b["type"] for b in m["content"]] == ["thinking"]
    s.say(ANSWER)
    off = s.prompt_tokens(QUESTION, enable_thinking=False)
    m = await messages(client, thinking={"type": "disabled"})
    assert m["content"] == [{"type": "text", "text": ANSWER}] and prompt_of(m) == off
    bad = {"model": "m", "max_tokens": 9, "messages": QUESTION, "thinking": {"type": "sometimes"}}
    r = await client.post("/v1/messages", json=bad, headers=HEADERS)
    assert r.status == 400 and "thinking.type" in (await r.json())["error"]["message"]


# -- OpenAI's Responses --------------------------------------------------------------------------------
async def responses(client, stream: bool = False, **kw: Any):
    body = {"model": "m", "input": QUESTION[0]["content"], "max_output_tokens": 64, **kw}
    r = await client.post("/v1/responses", json={**body, "stream": stream})
    assert r.status == 200, await r.text()
    if not stream:
        return sdk_models.response(await r.json())
    return [sdk_models.response_event(e) for e in named_events((await r.read()).decode())]


async def test_responses_answer_with_a_reasoning_item(aiohttp_client, served) -> None:
    s = served()
    script = s.say(REPLY)
    client = await client_for(aiohttp_client, s)
    resp = await responses(client)
    reasoning, message = resp["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert (
        reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}] and reasoning["summary"] == []
    )
    assert message["type"] == "message" and message["content"][0]["text"] == ANSWER
    details = resp["usage"]["output_tokens_details"]
    assert details == {"reasoning_tokens": script.index(s.close_id) + 1}

    events = await responses(client, stream=True)
    kinds = [e["type"] for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.reasoning_text.delta"]  # fmt: skip
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done : done + 3] == ["response.reasoning_text.done", "response.content_part.done",
                                      "response.output_item.done"]  # fmt: skip
    assert all(k != "response.output_text.delta" for k in kinds[:done])
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == THOUGHT
    final = events[-1]["response"]["output"]  # the stream's response holds what the reply holds
    assert [(o["type"], o["content"]) for o in final] == [(o["type"], o["content"]) for o in resp["output"]]

    # the openai SDK reads the stream into the same response
    from openai import AsyncOpenAI

    sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)
    async with sdk.responses.stream(model="m", input=QUESTION[0]["content"], max_output_tokens=64) as st:
        final = await st.get_final_response()
    assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER

    # effort none: thinking off; any other effort changes nothing
    s.say(ANSWER)
    resp = await responses(client, reasoning={"effort": "none"})
    assert [o["type"] for o in resp["output"]] == ["message"]
    assert resp["usage"]["input_tokens"] == s.prompt_tokens(QUESTION, enable_thinking=False)
    s.say(REPLY)
    resp = await responses(client, reasoning={"effort": "high"}, max_output_tokens=12)
    assert resp["usage"]["input_tokens"] == s.prompt_tokens(QUESTION) and resp["status"] == "incomplete"
    assert ScriptedSampler.forced == [8]


# -- replayed reasoning -----------------------------------------------------------------------------------
WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should look it up.",
        "tool_calls": [WEATHER_CALL],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


async def test_replayed_reasoning_renders_as_the_template_does(aiohttp_client, served) -> None:
    s = served()
    s.say(REPLY)
    kept = s.prompt_tokens(LOOP)  # the turn after the last query keeps its reasoning
    bare = [LOOP[0], {k: v for k, v in LOOP[1].items() if k != "reasoning_content"}, LOOP[2]]
    dropped = s.prompt_tokens(bare)
    assert kept > dropped
    client = await client_for(aiohttp_client, s)
    assert (await chat(client, messages=LOOP))["usage"]["prompt_tokens"] == kept
    renamed = [LOOP[0], {**bare[1], "reasoning": "I should look it up."}, LOOP[2]]  # vLLM's name
    assert (await chat(client, messages=renamed))["usage"]["prompt_tokens"] == kept

    anthropic = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should look it up.", "signature": "c2ln"},
            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]},
    ]  # fmt: skip
    assert prompt_of(await messages(client, messages=anthropic)) == kept
    # Claude Code's shape: reminder text beside the tool result is no new query; it is read with the result
    reminder = "<system-reminder>Keep going.</system-reminder>"
    anthropic[2] = {**anthropic[2], "content": [*anthropic[2]["content"], {"type": "text", "text": reminder}]}
    with_reminder = [*LOOP[:2], {**LOOP[2], "content": f"sunny\n\n{reminder}"}]
    await messages(client, messages=anthropic)
    assert ScriptedSampler.prompt == s.model.chat_prompt(with_reminder)
    assert "<think>\nI should look it up.\n</think>" in s.text(ScriptedSampler.prompt)  # kept

    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I should look it up."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]  # fmt: skip
    assert (await responses(client, input=items))["usage"]["input_tokens"] == kept

    # --thinking asis: the prompt as before thinking was modelled, replayed reasoning ignored
    s = served()
    s.say(REPLY)
    client = await client_for(aiohttp_client, s, thinking=ThinkingConfig(mode="asis"))
    assert (await chat(client, messages=LOOP))["usage"]["prompt_tokens"] == dropped
    assert message_of(await chat(client))["reasoning_content"] == THOUGHT  # the split holds


async def test_a_stored_response_carries_its_reasoning_into_the_next_turn(aiohttp_client, served) -> None:
    s = served()
    s.say(REPLY)
    client = await client_for(aiohttp_client, s)
    first = await responses(client)
    s.say(ANSWER)
    second = await responses(client, input="And 3 + 3?", previous_response_id=first["id"])
    history = [*QUESTION, {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
               {"role": "user", "content": "And 3 + 3?"}]  # fmt: skip
    assert second["usage"]["input_tokens"] == s.prompt_tokens(history)
