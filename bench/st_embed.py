"""sentence-transformers on torch CPU, run with the reference venv's python from the repo root:

    python -m bench.st_embed MODEL_DIR --texts TEXTS.json --out VECTORS.npy [--worker --query Q]

Writes the embeddings of the JSON list of texts (float32, L2-normalized by the checkpoint's own
modules, 2_Normalize among them) to --out. With --worker the query's vector is the last row, and
the process then serves bench.embed_timing's loop. Offline: the checkpoint is a local folder (the
caller sets HF_HUB_OFFLINE). This venv has no goinfer: keep the imports here to the standard
library, numpy, torch, sentence-transformers and bench.embed_timing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.embed_timing import serve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.st_embed")
    ap.add_argument("model_dir")
    ap.add_argument("--texts", required=True, type=Path, help="a JSON list of strings")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--query", default="")
    a = ap.parse_args(argv)

    import numpy as np
    import sentence_transformers
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    model = sentence_transformers.SentenceTransformer(a.model_dir, device="cpu")
    model.eval()
    texts = json.loads(a.texts.read_text())

    def embed(batch: list[str]) -> np.ndarray:
        # One forward for the whole batch, as ours and llama-server get it: encode()'s default
        # batch_size of 32 would split the bench's 64 inputs in two.
        return model.encode(batch, batch_size=max(1, len(batch)), show_progress_bar=False)

    rows = [*texts, a.query] if a.worker else texts
    vectors = np.concatenate([embed(texts), embed([a.query])]) if a.worker else embed(texts)
    np.save(a.out, np.asarray(vectors, dtype=np.float32))
    if a.worker:
        ids = model.tokenizer(rows, truncation=True, max_length=model.max_seq_length)["input_ids"]
        meta = {
            "batch_tokens": sum(len(i) for i in ids[:-1]),
            "query_tokens": len(ids[-1]),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "sentence_transformers": sentence_transformers.__version__,
        }
        serve(embed, texts, a.query, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
