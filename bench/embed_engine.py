"""Our encoder as bench.embed's worker, in its own process:

    python -m bench.embed_engine BUNDLE --texts TEXTS.json --out VECTORS.npy --query Q

Loads the bundle (goinfer.runtime.encoder.Encoder), writes the vectors of the texts and then the
query (the last row) to --out, prints one JSON line (load seconds, tokens, tier, dimensions) and
serves bench.embed_timing's loop. Threads: TVM_NUM_THREADS, set by the caller.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from bench.embed_timing import serve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.embed_engine")
    ap.add_argument("bundle")
    ap.add_argument("--texts", required=True, type=Path, help="a JSON list of strings")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--query", required=True)
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    from goinfer.runtime.encoder import Encoder

    enc = Encoder.load(a.bundle)
    load_s = time.perf_counter() - t0
    texts = json.loads(a.texts.read_text())
    vectors = np.concatenate([enc.embed(texts), enc.embed([a.query])])
    np.save(a.out, np.asarray(vectors, dtype=np.float32))
    meta = {
        "load_s": load_s,
        "batch_tokens": sum(len(enc.tokenize(t)) for t in texts),
        "query_tokens": len(enc.tokenize(a.query)),
        "threads": int(os.environ.get("TVM_NUM_THREADS", "0")),
        "tier": enc.tier or "",
        "dimensions": enc.dimensions,
        "pooling": enc.pooling,
    }
    serve(enc.embed, texts, a.query, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
