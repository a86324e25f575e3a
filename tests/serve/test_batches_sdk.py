"""The real `openai` and `anthropic` SDKs' batch calls, unchanged, against the app on a fake engine
over loopback: files.create/retrieve/content/delete, batches.create/retrieve/list/cancel, and
messages.batches.create/retrieve/list/results/cancel."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from fake_engine import ScriptedEngine
from goinfer.serve.app import create_app
from goinfer.serve.config import BatchConfig, ServeConfig

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.asyncio
KEY = "k"


async def start(aiohttp_client, tmp_path: Path, engine: ScriptedEngine) -> str:
    cfg = ServeConfig(api_key=KEY, poll_s=0.01, max_concurrent=2, batch=BatchConfig(dir=str(tmp_path)))
    server = TestServer(create_app({"m": engine}, cfg))
    client = await aiohttp_client(server)
    return f"http://127.0.0.1:{client.server.port}"


def until(fn: Callable[[], Any], done: Callable[[Any], bool], timeout: float = 10.0) -> Any:
    end = time.monotonic() + timeout
    while not done(got := fn()):
        assert time.monotonic() < end, got
        time.sleep(0.02)
    return got


def chat_line(cid: str, text: str) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


async def test_openai_sdk_batch_flow(aiohttp_client, tmp_path: Path) -> None:
    base = await start(aiohttp_client, tmp_path, ScriptedEngine())

    def flow() -> None:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        data = "\n".join(chat_line(f"q{i}", f"question {i}") for i in range(3)).encode() + b"\n"
        f = client.files.create(file=("in.jsonl", data), purpose="batch")
        assert f.purpose == "batch" and f.bytes == len(data) and client.files.retrieve(f.id).id == f.id
        assert client.files.content(f.id).read() == data
        b = client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert b.status == "validating"
        b = until(lambda: client.batches.retrieve(b.id), lambda x: x.status == "completed")
        assert b.request_counts.total == 3 and b.request_counts.completed == 3 and b.error_file_id is None
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        assert [o["custom_id"] for o in out] == ["q0", "q1", "q2"]
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "question 0"}], max_tokens=8, temperature=0
        )
        assert (
            out[0]["response"]["body"]["choices"][0]["message"]["content"] == reply.choices[0].message.content
        )
        assert [x.id for x in client.batches.list().data] == [b.id]
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch_missing")
        with pytest.raises(openai.BadRequestError, match="line 1 is not valid JSON"):
            client.files.create(file=("bad.jsonl", b"{nope\n"), purpose="batch")
        assert client.files.delete(f.id).deleted is True

    await asyncio.to_thread(flow)


async def test_openai_sdk_cancel(aiohttp_client, tmp_path: Path) -> None:
    gate = threading.Event()
    base = await start(aiohttp_client, tmp_path, ScriptedEngine(gate=gate))

    def flow() -> None:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        data = "\n".join(chat_line(f"q{i}", "x") for i in range(4)).encode()
        f = client.files.create(file=("in.jsonl", data), purpose="batch")
        b = client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        until(lambda: client.batches.retrieve(b.id), lambda x: x.status == "in_progress")
        assert client.batches.cancel(b.id).status == "cancelling"
        gate.set()
        b = until(lambda: client.batches.retrieve(b.id), lambda x: x.status == "cancelled")
        assert b.request_counts.total == 4 and b.cancelled_at is not None

    await asyncio.to_thread(flow)


async def test_anthropic_sdk_message_batches(aiohttp_client, tmp_path: Path) -> None:
    base = await start(aiohttp_client, tmp_path, ScriptedEngine())

    def flow() -> None:
        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
        reqs = [
            {
                "custom_id": f"r{i}",
                "params": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            }
            for i in range(3)
        ]
        reqs.append(
            {
                "custom_id": "bad",
                "params": {
                    "model": "m",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                },
            }
        )
        b = client.messages.batches.create(requests=reqs)
        assert b.type == "message_batch" and b.processing_status == "in_progress"
        b = until(lambda: client.messages.batches.retrieve(b.id), lambda x: x.processing_status == "ended")
        assert b.request_counts.succeeded == 3 and b.request_counts.errored == 1 and b.ended_at is not None
        results = list(client.messages.batches.results(b.id))
        assert [r.custom_id for r in results] == ["r0", "r1", "r2", "bad"]
        live = client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert results[0].result.type == "succeeded" and results[0].result.message.content == live.content
        assert results[3].result.type == "errored" and "image" in results[3].result.error.error.message
        assert [x.id for x in client.messages.batches.list().data] == [b.id]
        with pytest.raises(anthropic.NotFoundError):
            client.messages.batches.retrieve("msgbatch_missing")

    await asyncio.to_thread(flow)


async def test_anthropic_sdk_cancel(aiohttp_client, tmp_path: Path) -> None:
    gate = threading.Event()
    base = await start(aiohttp_client, tmp_path, ScriptedEngine(gate=gate))

    def flow() -> None:
        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
        params = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        b = client.messages.batches.create(
            requests=[{"custom_id": f"r{i}", "params": params} for i in range(4)]
        )
        assert client.messages.batches.cancel(b.id).processing_status == "canceling"
        gate.set()
        b = until(lambda: client.messages.batches.retrieve(b.id), lambda x: x.processing_status == "ended")
        assert b.request_counts.canceled + b.request_counts.succeeded == 4 and b.request_counts.canceled >= 2
        kinds = {r.result.type for r in client.messages.batches.results(b.id)}
        assert kinds <= {"canceled", "succeeded"} and "canceled" in kinds

    await asyncio.to_thread(flow)
