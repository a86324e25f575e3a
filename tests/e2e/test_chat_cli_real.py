"""`goinfer chat` on the real 0.5B (slow tier): greedy turns typed into the REPL give the replies
`goinfer generate --chat` and a cold Model.generate give for the same conversation, while each
turn after the first takes the whole earlier prompt from the KV cache."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from goinfer.cli.main import main
from test_chat_cli import PROMPT, STATS, spawn

pexpect = pytest.importorskip("pexpect")
pytestmark = pytest.mark.slow

NAME = "qwen2.5-coder-0.5b"
TURNS = ["Write a Python function that reverses a string.", "Now add type hints.", "And a docstring."]
MAX = 24


def test_repl_turns_equal_cold_generations(real_bundle, tmp_path: Path) -> None:
    from goinfer.runtime.decode import GenerationRequest
    from goinfer.runtime.model import Model
    from goinfer.runtime.sampler import SamplingParams

    bundle = real_bundle(NAME, "gguf")
    child = spawn(bundle, "--temp", "0", "--max-tokens", str(MAX), "-v", cwd=tmp_path)
    log = io.StringIO()
    child.logfile_read = log
    stats = []
    for text in TURNS:
        child.sendline(text)
        child.expect(STATS, timeout=120)
        stats.append(tuple(int(child.match.group(i)) for i in (1, 2, 3)))
        child.expect_exact(PROMPT)
    child.sendline("/save conv.json")
    child.expect_exact(PROMPT)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    messages = json.loads((tmp_path / "conv.json").read_text())["messages"]
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(replies) == len(TURNS) and all(replies)
    shown = log.getvalue().replace("\r\n", "\n")
    assert all(r + "\n" in shown for r in replies)  # streamed as kept

    # prefix reuse: each later turn's prompt starts with the whole earlier one, taken from the cache
    assert stats[0][1] == 0
    for (p_before, _, _), (p, cached, _) in itertools.pairwise(stats):
        assert p_before <= cached < p, stats

    # turn 1 is `goinfer generate --chat`'s reply; every turn is a cold run's on its conversation
    first = CliRunner().invoke(
        main, ["generate", str(bundle), TURNS[0], "--chat", "--temperature", "0", "--max-tokens", str(MAX)]
    )
    assert first.exit_code == 0, first.stderr
    assert first.stdout == replies[0] + "\n"
    m = Model.load(bundle, self_test=False)
    greedy = SamplingParams(temperature=0, max_tokens=MAX)
    for k in range(len(TURNS)):
        ids = m.chat_prompt(messages[: 2 * k + 1])
        assert len(ids) == stats[k][0]
        cold = "".join(e.text for e in m.generate(GenerationRequest(ids, greedy)))
        assert cold == replies[k], k
