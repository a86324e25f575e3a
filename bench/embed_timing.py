"""How bench.embed times every embedder, the same code in each process: standard library only.

Ours runs it in the project's venv, sentence-transformers in the reference venv (which has no
goinfer: only this file's folder, as the `bench` package, is imported there), llama-server's client
in the bench's own process. Each call is timed text in, vectors out, tokenizing included.

A worker (ours, sentence-transformers) loads its model, writes the vectors of the batch and the
query, prints one JSON line about itself, then answers one line per command on stdin:
  batch     the batch once, after SETTLE_S idle: {"s": seconds}
  query     the query once, after SETTLE_S idle: {"s": seconds}
  burst N   after SETTLE_S idle, one untimed query, then N back to back: {"s": [seconds, ...]}
  quit      (or EOF) ends it.
The bench steps the workers in turn, a call or a burst at a time, so drift on a shared machine falls
on all of them alike.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

Embed = Callable[[list[str]], Any]
# Before each timed call: thread pools spin a while after their last task (TVM's, libgomp's,
# llama.cpp's --poll), and a worker that just finished must not steal cores from the next one.
SETTLE_S = 0.25


def timed(embed: Embed, texts: Sequence[str], settle: bool = True) -> float:
    if settle:
        time.sleep(SETTLE_S)
    t = time.perf_counter()
    embed(list(texts))
    return time.perf_counter() - t


def burst(embed: Embed, query: str, n: int) -> list[float]:
    """Queries back to back: the first, after the settle, wakes the thread pool and is not kept."""
    timed(embed, [query])
    return [timed(embed, [query], settle=False) for _ in range(n)]


def serve(embed: Embed, batch: Sequence[str], query: str, meta: dict[str, Any]) -> None:
    """The worker's loop (see the module docstring); `meta` is its first line."""
    print(json.dumps(meta), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd, *args = line.split()
        if cmd == "quit":
            break
        if cmd == "burst":
            out: float | list[float] = burst(embed, query, int(args[0]))
        else:
            out = timed(embed, batch if cmd == "batch" else [query])
        print(json.dumps({"s": out}), flush=True)
