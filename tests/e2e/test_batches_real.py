"""One batch file on the real default model, three ways: the local runner (no server), a
`goinfer serve` process through the openai SDK's files and batches calls, and the same requests
through the anthropic SDK's message batches. At temperature 0 the replies are identical line for
line (the runners share the format, the pipeline and the scheduler), and each equals the live
route's reply to the same request."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from goinfer.cli.batch_run import run_batch_file
from serve_process import serving

pytestmark = pytest.mark.slow
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

KEY, NAME = "test-key", "qwen"
QUESTIONS = [
    "What is the capital of France?",
    "Name a prime number above 10.",
    "Write a haiku about rain.",
    "What does CPU stand for?",
]


def lines() -> list[dict[str, Any]]:
    out = []
    for i, q in enumerate(QUESTIONS):
        body = {"messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 20}
        out.append({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    out.append({**out[0], "custom_id": "tools", "body": {**out[0]["body"], "tools": [{"type": "function"}]}})
    return out


@pytest.fixture(scope="module")
def bundle(real_bundle) -> Path:
    return real_bundle("qwen2.5-coder-0.5b", "gguf")


@pytest.fixture(scope="module")
def url(bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    batch_dir = tmp_path_factory.mktemp("batches")
    with serving(NAME, bundle, KEY, "--batch-dir", str(batch_dir)) as u:
        yield u


def until(fn: Callable[[], Any], done: Callable[[Any], bool], timeout: float = 600.0) -> Any:
    end = time.monotonic() + timeout
    while not done(got := fn()):
        assert time.monotonic() < end, got
        time.sleep(0.5)
    return got


def contents(records: list[dict[str, Any]]) -> dict[str, str]:
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in records}


def counts(records: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    usage = {r["custom_id"]: r["response"]["body"]["usage"] for r in records}
    return {k: (u["prompt_tokens"], u["completion_tokens"]) for k, u in usage.items()}


def test_local_runner_and_server_agree_line_for_line(bundle: Path, url: str, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data = "".join(json.dumps(x) + "\n" for x in lines()).encode()
    src.write_bytes(data)
    said: list[str] = []
    assert run_batch_file(str(bundle), src, out, max_concurrent=4, overrides={}, progress=said.append) == 1
    local = [json.loads(x) for x in out.read_bytes().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_bytes().splitlines()]
    assert [e["custom_id"] for e in errors] == ["tools"] and "tools" in errors[0]["error"]["message"]
    assert sum(s.startswith("[") for s in said) == len(QUESTIONS) + 1

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = until(lambda: client.batches.retrieve(b.id), lambda x: x.status in ("completed", "failed"))
    assert b.status == "completed" and b.request_counts.completed == len(QUESTIONS)
    served = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    served_errors = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in served_errors] == ["tools"]

    assert contents(served) == contents(local)  # line for line, the same replies
    assert all(contents(local).values())
    assert counts(served) == counts(local)  # (cached_tokens may differ: what was warm in each)
    live = client.chat.completions.create(model=NAME, **lines()[0]["body"])
    assert live.choices[0].message.content == contents(served)["q0"]

    claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300)
    reqs = [
        {
            "custom_id": x["custom_id"],
            "params": {"model": NAME, "max_tokens": 20, "temperature": 0, "messages": x["body"]["messages"]},
        }
        for x in lines()[: len(QUESTIONS)]
    ]
    mb = claude.messages.batches.create(requests=reqs)
    mb = until(lambda: claude.messages.batches.retrieve(mb.id), lambda x: x.processing_status == "ended")
    assert mb.request_counts.succeeded == len(QUESTIONS)
    texts = {r.custom_id: r.result.message.content[0].text for r in claude.messages.batches.results(mb.id)}
    assert texts == contents(local)
