"""`goinfer chat` as a person meets it: the REPL driven in a pseudo-terminal (pexpect) on a tiny
model, keys typed as a person types them; the one-shot JSON answer and the --batch delegation
through click's runner."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from goinfer.cli.main import main
from goinfer.runtime.thinking import ThinkingConfig

pexpect = pytest.importorskip("pexpect")

STATS = re.compile(r"\[prompt (\d+) tok, (\d+) cached \| ttft [\d.]+ s \| (\d+) tok, [\d.]+ tok/s \| (\w+)\]")
PROMPT = ">>> "


def spawn(bundle: Path, *args: str, cwd: Path) -> pexpect.spawn:
    env = {**os.environ, "TERM": "dumb", "GOINFER_NO_SELFTEST": "1"}
    env.pop("TVM_USE_RUNTIME_LIB", None)  # as a user runs it: the runtime-only TVM library
    argv = ["-m", "goinfer.cli.main", "chat", str(bundle), *args]
    child = pexpect.spawn(
        sys.executable, argv, env=env, cwd=str(cwd), encoding="utf-8", codec_errors="replace", timeout=60
    )
    child.expect("/help for commands")
    child.expect_exact(PROMPT)
    return child


def say(child: pexpect.spawn, line: str) -> tuple[int, int, int, str]:
    """Type a message; (prompt tokens, cached, reply tokens, finish) from the -v line."""
    child.sendline(line)
    child.expect(STATS)
    prompt, cached, n = (int(child.match.group(i)) for i in (1, 2, 3))
    finish = child.match.group(4)
    child.expect_exact(PROMPT)
    return prompt, cached, n, finish


def command(child: pexpect.spawn, line: str, answer: str) -> None:
    child.sendline(line)
    child.expect_exact(answer)
    child.expect_exact(PROMPT)


def test_repl_turns_commands_and_save_load(tiny_bundle, tmp_path: Path) -> None:
    child = spawn(tiny_bundle("qwen2", "f32"), "--temp", "0", "--max-tokens", "6", "-v", cwd=tmp_path)
    p1, cached1, n1, _ = say(child, "hello there")
    assert cached1 == 0 and n1 >= 1
    # the second turn's prompt extends the first: its whole prompt comes from the cache
    p2, cached2, _, _ = say(child, "and again")
    assert p2 > p1 and cached2 >= p1, (p1, p2, cached2)

    command(child, "/temp 0.5", "(temperature 0.5)")
    command(child, "/temp hot", "error: /temp takes a number from 0 to 2")
    command(child, "/frob", "unknown command /frob: /help lists them")
    command(child, "/save", "usage: /save FILE")
    command(child, "/temp 0", "(temperature 0.0)")
    command(child, "/system Be brief.", "(system prompt set)")
    # multi-line: a line ending in \ goes on
    child.sendline("line one \\")
    child.expect_exact("... ")
    child.sendline("line two")
    child.expect(STATS)
    p_multi = int(child.match.group(1))
    child.expect_exact(PROMPT)

    command(child, "/save a.json", "(saved 7 messages to a.json)")
    saved = json.loads((tmp_path / "a.json").read_text())
    assert saved["settings"] == {
        "temperature": 0.0,
        "top_p": 0.95,
        "top_k": 40,
        "seed": None,
        "max_tokens": 6,
    }
    roles = [m["role"] for m in saved["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert saved["messages"][0]["content"] == "Be brief."
    assert saved["messages"][5]["content"] == "line one \nline two"

    command(child, "/clear", "(conversation cleared)")
    command(child, "/save b.json", "(saved 1 messages to b.json)")
    command(child, "/load nope.json", "error: nope.json:")
    command(child, "/load a.json", "(loaded 7 messages from a.json)")
    command(child, "/save c.json", "(saved 7 messages to c.json)")
    assert json.loads((tmp_path / "c.json").read_text()) == saved
    # the loaded conversation is the one still warm: the next turn reuses all of it
    p3, cached3, _, _ = say(child, "one more")
    assert cached3 >= p_multi and p3 > cached3, (p_multi, p3, cached3)

    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(tiny_bundle, tmp_path: Path) -> None:
    # a greedy tiny model loops without end: 8000 tokens take seconds, and fill the terminal's buffer
    bundle = tiny_bundle("qwen2", "f32", context=8192)
    child = spawn(bundle, "--temp", "0", "--max-tokens", "8000", "-v", cwd=tmp_path)
    child.sendline("tell me everything")
    time.sleep(0.5)  # not read meanwhile: the reply is mid-stream, or blocked on a full terminal
    child.sendintr()
    child.expect_exact("(reply stopped)")
    child.expect(STATS)
    assert child.match.group(4) == "interrupted" and int(child.match.group(3)) < 8000
    child.expect_exact(PROMPT)
    command(child, "/max", "unknown command /max")  # still alive, and still reading commands
    child.sendline("/save s.json")
    child.expect_exact(PROMPT)
    saved = json.loads((tmp_path / "s.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]  # the partial reply stays
    child.sendintr()  # at the prompt: once warns, twice leaves
    child.expect_exact("Ctrl-C again")
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_d_leaves(tiny_bundle, tmp_path: Path) -> None:
    child = spawn(tiny_bundle("qwen2", "f32"), cwd=tmp_path)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_history_is_trimmed_to_the_window(tiny_bundle, tmp_path: Path) -> None:
    child = spawn(
        tiny_bundle("qwen2", "f32"), "--ctx", "96", "--temp", "0", "--max-tokens", "4", "-v", cwd=tmp_path
    )
    dropped = re.compile(r"\(dropped the (\d+) oldest exchange\(s\) to fit the 96-token window\)")
    prompts: list[int] = []
    for i in range(10):  # until the history no longer fits
        child.sendline(f"{i} hello")
        if child.expect([dropped, STATS]) == 0:
            break
        prompts.append(int(child.match.group(1)))
        child.expect_exact(PROMPT)
    assert len(prompts) >= 2 and prompts == sorted(prompts), prompts
    child.expect(STATS)
    assert int(child.match.group(1)) + 4 <= 96
    child.expect_exact(PROMPT)
    command(child, "/save t.json", "(saved")
    users = [
        m["content"] for m in json.loads((tmp_path / "t.json").read_text())["messages"] if m["role"] == "user"
    ]
    assert users[-1] == f"{i} hello" and "0 hello" not in users
    # one message that cannot fit at all is refused and forgotten; the history stays whole
    child.sendline("hello " * 40)
    child.expect_exact("error: the message makes a prompt of")
    child.expect_exact(PROMPT)
    command(child, "/save t2.json", "(saved")
    assert (tmp_path / "t2.json").read_text() == (tmp_path / "t.json").read_text()
    child.sendline("/quit")
    child.expect(pexpect.EOF)


# -- one answer --------------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
}


def _run(*args: object, input: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def test_schema_answer_validates(tiny_bundle, tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    bundle = tiny_bundle("qwen2", "f32")
    common = ("--temp", "0", "--max-tokens", "64", "--no-selftest")
    r = _run("chat", bundle, "--schema", schema, *common, input="Pick a color.\n")  # the prompt from stdin
    assert r.exit_code == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), SCHEMA)
    assert r.stdout.count("\n") == 1
    r = _run("chat", bundle, "Anything.", "--json", *common)
    assert r.exit_code == 0, r.stderr
    assert isinstance(json.loads(r.stdout), dict)


def test_schema_and_flag_errors_are_one_line(tiny_bundle, tmp_path: Path) -> None:
    bundle = tiny_bundle("qwen2", "f32")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    unsat = tmp_path / "unsat.json"
    unsat.write_text(json.dumps({"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}))
    cases = [
        (("chat", bundle, "x", "--schema", bad), "not JSON"),
        (("chat", bundle, "x", "--schema", unsat), "not a usable JSON schema"),
        (("chat", bundle, "x", "--schema", tmp_path / "missing.json"), "missing.json"),
        (("chat", bundle, "--json"), "need a PROMPT"),
        (("chat", tmp_path / "none.giw"), "none.giw"),
        (("chat", bundle, "--temp", "9"), "--temp"),
    ]
    for args, needle in cases:
        r = _run(*args, input="")
        assert r.exit_code == 2, (args, r.output)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("goinfer: error: ") and needle in lines[0], r.stderr


def test_one_prompt_is_one_reply(tiny_bundle) -> None:
    from goinfer.runtime.decode import GenerationRequest
    from goinfer.runtime.model import Model
    from goinfer.runtime.sampler import SamplingParams

    bundle = tiny_bundle("qwen2", "f32")
    m = Model.load(bundle, self_test=False)
    ids = m.chat_prompt([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    greedy = SamplingParams(temperature=0, max_tokens=10)
    expected = "".join(e.text for e in m.generate(GenerationRequest(ids, greedy))) + "\n"
    r = _run("chat", bundle, "Hi", "--system", "S", "--temp", "0", "--max-tokens", "10", "--no-selftest")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == expected


# -- --batch: handed to goinfer.cli.batch_run ------------------------------------------------------
@pytest.fixture
def batch_runner(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple, dict]]:
    import goinfer.cli

    calls: list[tuple[tuple, dict]] = []

    def run_batch_file(*args, **kwargs):
        calls.append((args, kwargs))
        kwargs["progress"]("[1/1] a ok")
        return 1

    fake = types.ModuleType("goinfer.cli.batch_run")
    fake.run_batch_file = run_batch_file
    monkeypatch.setitem(sys.modules, "goinfer.cli.batch_run", fake)
    monkeypatch.setattr(goinfer.cli, "batch_run", fake, raising=False)
    return calls


def test_batch_is_delegated_with_only_the_flags_given(batch_runner, tmp_path: Path) -> None:
    r = _run("chat", "some-model", "--batch", "in.jsonl", "-o", "out.jsonl", "--temp", "0", "--seed", "3")
    assert r.exit_code == 1, r.output  # the runner's own exit status
    assert "[1/1] a ok" in r.stderr
    ((args, kwargs),) = batch_runner
    assert args == ("some-model", Path("in.jsonl"), Path("out.jsonl"))
    assert kwargs == {
        "max_concurrent": 4,
        "overrides": {"temperature": 0.0, "seed": 3},
        "self_test": True,
        "progress": kwargs["progress"],
        "thinking": ThinkingConfig(),  # --thinking template, --reasoning-budget auto: the defaults
    }
    r = _run(
        "chat", "m", "--batch", "i", "-o", "o", "--max-concurrent", "2", "--system", "S", "--max-tokens", "9",
        "--top-p", "0.5", "--top-k", "3", "--no-selftest",
    )  # fmt: skip
    kwargs = batch_runner[1][1]
    assert kwargs["max_concurrent"] == 2 and kwargs["self_test"] is False
    r = _run("chat", "m", "--batch", "i", "-o", "o", "--thinking", "off", "--reasoning-budget", "64")
    assert batch_runner[2][1]["thinking"] == ThinkingConfig(mode="off", budget="64")
    assert kwargs["overrides"] == {"system": "S", "max_tokens": 9, "top_p": 0.5, "top_k": 3}


def test_batch_refusals(batch_runner, monkeypatch: pytest.MonkeyPatch) -> None:
    for args, needle in [
        (("--batch", "in.jsonl"), "-o OUT.jsonl"),
        (("--batch", "in.jsonl", "-o", "o", "--json"), "--batch takes no"),
    ]:
        r = _run("chat", "m", *args)
        assert r.exit_code == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    import goinfer.cli

    monkeypatch.setitem(sys.modules, "goinfer.cli.batch_run", None)  # a goinfer without the runner
    monkeypatch.delattr(goinfer.cli, "batch_run")
    r = _run("chat", "m", "--batch", "in.jsonl", "-o", "o")
    assert r.exit_code == 2 and "no batch runner" in r.stderr, r.stderr
    assert not batch_runner


def test_batch_file_runs_through_the_runner(tiny_bundle, tmp_path: Path) -> None:
    """The real goinfer.cli.batch_run behind the flag: lines answered, a rerun has nothing to do."""
    pytest.importorskip("goinfer.cli.batch_run")
    lines = [
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [m]}}
        for cid, m in (("a", {"role": "user", "content": "hi"}), ("b", {"role": "user", "content": "yo"}))
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = (
        "chat",
        tiny_bundle("qwen2", "f32"),
        "--batch",
        src,
        "-o",
        out,
        "--max-tokens",
        "4",
        "--no-selftest",
    )
    r = _run(*args)
    assert r.exit_code == 0, r.stderr
    done = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(d["custom_id"] for d in done) == ["a", "b"]
    assert all(
        d["response"]["body"]["usage"]["completion_tokens"] <= 4 for d in done
    )  # --max-tokens passed on
    r = _run(*args)
    assert r.exit_code == 0 and "nothing to do" in r.stderr
    r = _run("chat", "m", "--batch", tmp_path / "none.jsonl", "-o", out)
    assert r.exit_code == 2 and "none.jsonl: No such file" in r.stderr, r.stderr
