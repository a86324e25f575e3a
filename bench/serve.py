"""Our server against llama-server through the streaming OpenAI API: `python -m bench.serve`.

Starts `goinfer serve` on the model's bundle and `llama-server` on the same GGUF (both with the
same thread count), then sends the same streaming chat request to each in turn (A/B/A/B), and
reports time to first token and decode tok/s (tokens after the first over the time after it),
medians and ratios. Greedy, so both generate a full `--max-tokens` reply unless one stops early.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import ExitStack

from bench import llama_cpp
from bench.run import MODELS, _ensure_bundle, median, parse_list, ratio

PROMPT = (
    "Here is a Python function:\n\n```python\ndef merge(a, b):\n    out = []\n    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n```\n\n"
    "Explain what it does, step by step, then write three unit tests for it."
)


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench: {what} exited with status {proc.returncode} before serving")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"bench: {what} did not become ready in {timeout_s:.0f}s")


def stream_once(port: int, model: str, max_tokens: int, extra: dict | None = None) -> dict[str, float]:
    """One streaming chat request: seconds to the first content token, and decode tok/s after it."""
    body = {
        **(extra or {}),
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"bench: server on port {port} answered {resp.status}: {resp.read()[:200]!r}")
    first = last = None
    tokens = 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            if (choice.get("delta") or {}).get("content"):
                tokens += 1  # both servers send one chunk per generated token
                last = time.perf_counter()
                first = first or last
    conn.close()
    if first is None:
        raise SystemExit(f"bench: server on port {port} streamed no content")
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return {"ttft_s": first - t0, "decode_tok_s": decode, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODELS[0])
    ap.add_argument("--quant", default="gguf")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    (name,) = parse_list(a.model, MODELS, "model")

    from goinfer.compiler.sources import zoo

    gguf = zoo.resolve(name)
    bundle = _ensure_bundle(gguf, a.quant)
    server_bin = llama_cpp.build() / "llama-server"
    env = {**os.environ, "TVM_NUM_THREADS": str(a.threads)}
    ours_port, peer_port = _free_port(), _free_port()
    goinfer = [sys.executable, "-m", "goinfer.cli.main", "serve"]
    with ExitStack() as stack:
        procs = {
            "goinfer": subprocess.Popen(
                [*goinfer, "--model", f"{name}={bundle}", "--addr", f"127.0.0.1:{ours_port}"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            ),
            "llama-server": subprocess.Popen(
                [
                    str(server_bin),
                    "-m",
                    str(gguf),
                    "--port",
                    str(peer_port),
                    "-t",
                    str(a.threads),
                    "-c",
                    "4096",
                    "--no-webui",
                ],
                env=llama_cpp.llama_env(server_bin),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            ),
        }
        for p in procs.values():
            stack.callback(p.wait)
            stack.callback(p.terminate)
        _wait_ready(ours_port, procs["goinfer"], "goinfer serve")
        _wait_ready(peer_port, procs["llama-server"], "llama-server")
        ours, peer = [], []
        # llama-server would reuse the repeated prompt's KV (we do not yet): make it prefill too
        no_cache = {"cache_prompt": False}
        stream_once(ours_port, name, 8), stream_once(peer_port, name, 8, no_cache)  # warm both
        for i in range(a.rounds):  # A/B/A/B
            _log(f"round {i + 1}/{a.rounds}")
            ours.append(stream_once(ours_port, name, a.max_tokens))
            peer.append(stream_once(peer_port, name, a.max_tokens, no_cache))

    def med(rows, key):
        return median([r[key] for r in rows])

    print(f"{name} {a.quant}, {a.threads} threads, streaming chat, max_tokens {a.max_tokens}, "
          f"median of {a.rounds}")  # fmt: skip
    print(f"{'':14}{'goinfer':>10}{'llama-server':>14}{'ratio':>8}")
    t_o, t_p = med(ours, "ttft_s"), med(peer, "ttft_s")
    d_o, d_p = med(ours, "decode_tok_s"), med(peer, "decode_tok_s")
    print(f"{'TTFT s':14}{t_o:>10.3f}{t_p:>14.3f}{ratio(t_p, t_o):>7.2f}x")  # >1: we answer sooner
    print(f"{'decode tok/s':14}{d_o:>10.1f}{d_p:>14.1f}{ratio(d_o, d_p):>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
