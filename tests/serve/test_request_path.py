"""The path of one streaming chat with tools, file by file, on a real (tiny) bundle: at most 18 of
our source files run during it, and the runtime never calls back into serve (issue 32: it was 26
files, 16 serve and 10 runtime, with a call from the runtime into serve every token; 16 then, and
18 since every request passes the halt check (guards.py) and is observed for /metrics (metrics.py))."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
MOST_FILES = 18
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip


def _ours(path: str) -> str | None:
    path = os.path.realpath(path)
    rel = os.path.relpath(path, ROOT)
    return rel if rel.startswith(("serve/", "runtime/")) and rel.endswith(".py") else None


def test_a_streaming_chat_with_tools_runs_at_most_18_files(tiny_bundle) -> None:
    from aiohttp.test_utils import TestClient, TestServer
    from goinfer.serve.app import create_app
    from goinfer.serve.config import ServeConfig
    from goinfer.serve.model_engine import ModelEngine

    tracing, files, upcalls = [False], set(), set()

    def profile(frame, event, _arg):
        if not tracing[0] or event != "call":
            return
        callee = _ours(frame.f_code.co_filename)
        if callee is None:
            return
        files.add(callee)
        caller = _ours(frame.f_back.f_code.co_filename) if frame.f_back else None
        if caller and caller.startswith("runtime/") and callee.startswith("serve/"):
            upcalls.add(f"{caller} -> {callee}:{frame.f_code.co_name}")

    # Set before the engine starts its scheduler thread; the workers start on the first request.
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        engine = ModelEngine.load(tiny_bundle("qwen2", context=2048), self_test=False)
        engine.grammar.get()
        body = {"model": "m", "stream": True, "max_tokens": 12, "temperature": 0, "tools": [WEATHER],
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}  # fmt: skip

        async def chat() -> None:
            async with TestClient(TestServer(create_app({"m": engine}, ServeConfig()))) as client:
                for warm in (True, False):  # the first loads what a cold start loads lazily
                    tracing[0] = not warm
                    r = await client.post("/v1/chat/completions", json=body)
                    assert r.status == 200, await r.text()
                    assert (await r.read()).endswith(b"data: [DONE]\n\n")
                    tracing[0] = False

        asyncio.run(chat())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    print(f"\n{len(files)} files: " + ", ".join(sorted(files)))
    assert not upcalls, upcalls
    assert any(f.startswith("runtime/") for f in files), "the trace must see the scheduler's thread"
    assert len(files) <= MOST_FILES, sorted(files)
