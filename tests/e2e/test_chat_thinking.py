"""`goinfer chat` on a thinking model (a real tiny bundle, its tokens scripted as in
tests/serve/test_thinking_apis.py): the reasoning on stderr before the answer, only the answer on
stdout and in the conversation, --thinking and /think, the budget, and --json thinking-off."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from goinfer.cli.main import main
from goinfer.runtime import decode
from thinking_fixtures import ANSWER, REPLY, THOUGHT, Scripted, ScriptedSampler, build_thinking_bundle

QUESTION = "What is 2 + 2?"


@pytest.fixture(scope="module")
def bundle(tiny_gguf, tmp_path_factory) -> Path:
    return build_thinking_bundle(tiny_gguf("qwen2"), tmp_path_factory.mktemp("chat-thinking"))


@pytest.fixture(scope="module")
def model(bundle):
    from goinfer.runtime.model import Model

    return Model.load(bundle, self_test=False)


@pytest.fixture
def script(model, monkeypatch) -> Scripted:
    monkeypatch.setattr(decode, "Sampler", ScriptedSampler)
    monkeypatch.setenv("GOINFER_NO_SELFTEST", "1")
    return Scripted(model)


def chat(bundle: Path, *args: str, stdin: str | None = None):
    result = CliRunner().invoke(main, ["chat", str(bundle), *args], input=stdin)
    assert result.exit_code == 0, result.output + (result.stderr or "")
    return result


def test_one_answer_prints_the_reasoning_on_stderr_and_the_answer_on_stdout(bundle, script, model) -> None:
    script.say(REPLY)
    r = chat(bundle, QUESTION)
    assert r.stdout == ANSWER + "\n"
    assert THOUGHT in r.stderr and "<think>" not in r.stderr + r.stdout
    assert ScriptedSampler.prompt == model.chat_prompt([{"role": "user", "content": QUESTION}])  # template

    r = chat(bundle, QUESTION, "--show-thinking", "false")
    assert r.stdout == ANSWER + "\n" and THOUGHT not in r.stderr and "(thinking…)" in r.stderr

    script.say(ANSWER)
    chat(bundle, QUESTION, "--thinking", "off")
    assert ScriptedSampler.prompt == model.chat_prompt(
        [{"role": "user", "content": QUESTION}], enable_thinking=False
    )


def test_the_budget_leaves_the_answer_room(bundle, script) -> None:
    ids = script.say(REPLY)
    r = chat(bundle, QUESTION, "--max-tokens", "12")
    assert ScriptedSampler.forced == [8]  # 3/4 of 12: the block closed by token 9
    after = ids[ids.index(script.close_id) + 1 :]
    assert r.stdout == script.text(after[:3]).lstrip() + "\n"
    r = chat(bundle, QUESTION, "--reasoning-budget", "2")
    assert ScriptedSampler.forced == [3] and r.stdout == ANSWER + "\n"


def test_json_answers_render_thinking_off(bundle, script, model) -> None:
    script.say('{"a": 4}')
    r = chat(bundle, "--json", stdin=QUESTION)
    assert json.loads(r.stdout) == {"a": 4}
    assert ScriptedSampler.prompt == model.chat_prompt(
        [{"role": "user", "content": QUESTION}], enable_thinking=False
    )


def test_the_repl_keeps_only_the_answer_and_think_changes_the_mode(model, script, monkeypatch) -> None:
    from goinfer.cli.chat import REPL_ENGINE, ChatConfig, ChatEngine, Conversation, Repl

    said: list[str] = []
    engine = ChatEngine(model, REPL_ENGINE)
    try:
        out = io.StringIO()
        repl = Repl(engine, Conversation(ChatConfig(temperature=0)), out, verbose=False, tty=False)
        monkeypatch.setattr(repl, "say", said.append)
        script.say(REPLY)
        repl.turn(QUESTION)
        assert out.getvalue() == ANSWER + "\n"
        assert repl.conv.turns[-1] == {"role": "assistant", "content": ANSWER}  # the reasoning is not kept

        repl.command("/think off")
        repl.command("/think")
        repl.command("/think maybe")
        assert said[-3:] == [
            "(thinking off)",
            "thinking off (<think>…</think>, thinks by default: yes)",
            "error: /think takes one of template, asis, on, off, not 'maybe'",
        ]
        script.say(ANSWER)
        repl.turn("And 3 + 3?")
        messages = repl.conv.messages()
        assert ScriptedSampler.prompt == model.chat_prompt(messages[:-1], enable_thinking=False)
    finally:
        engine.close()


def test_a_batch_file_splits_each_reply_and_takes_the_mode(bundle, script, model, tmp_path: Path) -> None:
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 64}
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body})
    )
    script.say(REPLY)
    chat(bundle, "--batch", str(src), "-o", str(tmp_path / "out.jsonl"))
    reply = json.loads((tmp_path / "out.jsonl").read_text())["response"]["body"]
    message = reply["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)

    script.say(ANSWER)
    chat(bundle, "--batch", str(src), "-o", str(tmp_path / "off.jsonl"), "--thinking", "off")
    reply = json.loads((tmp_path / "off.jsonl").read_text())["response"]["body"]
    off = model.chat_prompt(body["messages"], enable_thinking=False)
    assert reply["choices"][0]["message"]["content"] == ANSWER and reply["usage"]["prompt_tokens"] == len(off)
