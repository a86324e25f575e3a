"""The hostile-input corpus (tests/fixtures/hostile/*.json) and a smaller schema fuzz, replayed
against `goinfer serve` on the real SmolLM2-135M: no case may be a 500, and the server's log may
hold no traceback. Replies are kept short: the corpus asks for 8 tokens, and a case that asks for
2**70 (clamped to the window) is sent streamed and hung up on after its first events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import hostile
import pytest
from serve_process import serving

pytestmark = pytest.mark.slow

CASES = hostile.load_corpus()
FUZZ = hostile.fuzz_cases(seed=7, n=16, max_tokens=8)


@pytest.fixture(scope="module")
def served(real_bundle, tmp_path_factory) -> Iterator[tuple[str, int, Path]]:
    log = tmp_path_factory.mktemp("hostile") / "serve.log"
    bundle = real_bundle("smollm2-135m")
    with serving(hostile.MODEL, bundle, hostile.KEY, "--allow-admin", log=log) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port), log


def _replay(served, case, check) -> None:
    host, port, log = served
    before = log.stat().st_size
    start = time.monotonic()
    if case.get("long"):  # up to the whole window: its status and first events, then hang up
        reply = hostile.send(host, port, hostile.streamed(case), timeout=300, events=3)
        assert reply.status == 200 and reply.content_type == "text/event-stream", (case["name"], reply)
    else:
        reply = hostile.send(host, port, case, timeout=300)
        check(case, reply)
    time.sleep(0.02)  # the log line of a failure is written before its response; let it land
    with log.open("rb") as f:
        f.seek(before)
        added = f.read().decode(errors="replace")
    assert "Traceback" not in added, (case["name"], added[-3000:])
    assert time.monotonic() - start < 120, case["name"]


@pytest.mark.parametrize("case", CASES, ids=[f"{c['file'][:-5]}: {c['name']}" for c in CASES])
def test_hostile_case_on_a_real_model(served, case):
    _replay(served, case, hostile.check)


@pytest.mark.parametrize("case", FUZZ, ids=[c["name"] for c in FUZZ])
def test_schema_fuzz_on_a_real_model(served, case):
    _replay(served, case, hostile.check_fuzz)


def test_the_server_log_holds_no_traceback(served):
    text = served[2].read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
