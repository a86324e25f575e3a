"""A 4 MiB prompt beside a live stream, on the real default model through `goinfer serve`
(issue 32 item 3): the prompt is a 400 before it is tokenized in full, and the stream beside it
keeps its pace. Qwen's 32k window is past the cheap character bound, so the prompt is counted in
pieces, with the tokenizer's GIL released (runtime/prompt.py)."""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from serve_process import serving

pytestmark = pytest.mark.slow
KEY = "test-key"
GAP_LIMIT_S = 0.1  # what the big prompt may add to the stream's largest gap between tokens
LINE = "the weather is sunny and the wind is low, said the forecast for today.\n"


def _post(url: str, body: dict) -> urllib.request.Request:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    data = json.dumps(body).encode()
    return urllib.request.Request(f"{url}/v1/chat/completions", data=data, headers=headers)


def test_a_4_mib_prompt_does_not_stall_a_live_stream(real_bundle) -> None:
    with serving("qwen", real_bundle("qwen2.5-coder-0.5b", "gguf"), KEY) as url:
        arrivals: list[float] = []
        ask = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
        stream = {"messages": ask, "max_tokens": 400, "temperature": 0, "stream": True}

        def read() -> None:
            with urllib.request.urlopen(_post(url, stream), timeout=300) as r:
                arrivals.extend(time.perf_counter() for line in r if line.startswith(b"data: {"))

        reader = threading.Thread(target=read)
        reader.start()
        while len(arrivals) < 20:  # decoding, at its steady pace
            time.sleep(0.05)
        big = (LINE * (4 * 2**20 // len(LINE)))[: 4 * 2**20 - 128 * 1024]
        t0 = time.perf_counter()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(_post(url, {"messages": [{"role": "user", "content": big}]}), timeout=300)
        t1 = time.perf_counter()
        reader.join(300)
    body = json.loads(refused.value.read())
    assert refused.value.code == 400 and body["error"]["code"] == "context_length_exceeded", body
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    before = sorted(g for g, at in zip(gaps, arrivals[1:], strict=False) if at < t0)
    during = [g for g, at in zip(gaps, arrivals[1:], strict=False) if t0 <= at <= t1 + 0.5]
    typical = before[len(before) // 2]
    print(f"\nrefused in {(t1 - t0) * 1e3:.0f} ms; stream gap typical {typical * 1e3:.0f} ms, "
          f"largest while refusing {max(during) * 1e3:.0f} ms")  # fmt: skip
    assert during, "the stream must still be running while the big prompt is refused"
    assert max(during) < typical + GAP_LIMIT_S
