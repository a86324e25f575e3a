"""Our side of the benchmark, in its own process: `python -m bench.engine BUNDLE --pp N --tg N`.

Prints one JSON line: cold start to the first token, load time, RSS after load, prefill and
decode tok/s (greedy, llama-bench's shapes: pp is one pp-token prompt into an empty cache; tg is
tg single-token steps starting from an empty cache, as llama-bench's tg test does).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np

_TEXT = "The quick brown fox jumps over the lazy dog while the compiler schedules its kernels. "


def _rss_mb() -> float:
    m = re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1)) / 1024 if m else float("nan")


def run(bundle: str, pp: int, tg: int) -> dict[str, float]:
    t0 = time.perf_counter()
    from goinfer.runtime.model import Model

    model = Model.load(bundle)
    rss_load = _rss_mb()
    np.argmax(model.prefill(model.encode("The capital of France is")))  # the first token
    cold = time.perf_counter() - t0

    ids = model.encode(_TEXT * (pp // 8 + 8))
    pp = min(pp, model.context_length - tg - 1)
    ids = (ids * (pp // max(1, len(ids)) + 1))[:pp]
    t = time.perf_counter()
    model.prefill(ids)
    prefill_s = time.perf_counter() - t

    # tg starts over from a one-token context, like llama-bench (it does not decode after pp)
    tok = int(np.argmax(model.prefill(ids[:1])))
    t = time.perf_counter()
    for _ in range(tg):
        tok = int(np.argmax(model.decode_step(tok)))
    decode_s = time.perf_counter() - t
    return {
        "cold_first_token_s": cold,
        "load_s": model.load_seconds,
        "rss_after_load_mb": rss_load,
        "rss_end_mb": _rss_mb(),
        "pp": pp,
        "tg": tg,
        "pp_tok_s": pp / prefill_s,
        "tg_tok_s": tg / decode_s,
        "tier": model.tier or "",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    a = ap.parse_args()
    print(json.dumps(run(a.bundle, a.pp, a.tg)))


if __name__ == "__main__":
    main()
