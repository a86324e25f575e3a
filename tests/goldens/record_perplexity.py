"""Record llama.cpp's perplexity on a fixed text for each zoo model: the bar the default (gguf)
mode is held to in tests/e2e/test_perplexity_real.py.

The text, tests/goldens/perplexity.txt, is a frozen copy of this repo's README and FORMAT.md (our
own prose: it does not drift with the code). Scored as `llama-perplexity -c CTX --chunks CHUNKS`
scores it: chunks of CTX tokens, BOS first where the model adds one, each chunk's second half.

Writes tests/goldens/perplexity.json. Needs the llama.cpp tools (`python -m bench.llama_cpp build`).
Run from the repo root:

    python tests/goldens/record_perplexity.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from goinfer.compiler.sources import zoo  # noqa: E402

from bench import llama_cpp  # noqa: E402
from bench.quality import peer_perplexity  # noqa: E402

HERE = Path(__file__).resolve().parent
TEXT = HERE / "perplexity.txt"
MODELS = ("qwen2.5-coder-0.5b", "gemma-3-270m", "smollm2-135m", "qwen2.5-coder-1.5b")
CTX, CHUNKS, THREADS = 512, 6, 2


def main() -> int:
    binary = llama_cpp.find_llama_binary("llama-perplexity")
    if binary is None:
        raise SystemExit("record: llama-perplexity is not built; run `python -m bench.llama_cpp build`")
    version = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, env=llama_cpp.llama_env(binary)
    )
    golden = {
        "text": TEXT.name,
        "ctx": CTX,
        "chunks": CHUNKS,
        "llama_cpp": " ".join((version.stdout + version.stderr).split()),
        "command": [
            "llama-perplexity",
            "-m",
            "<gguf>",
            "-f",
            TEXT.name,
            "-c",
            str(CTX),
            "-b",
            str(CTX),
            "--chunks",
            str(CHUNKS),
        ],
        "perplexity": {},
    }
    for name in MODELS:
        gguf = zoo.fetch(name)
        golden["perplexity"][name] = {
            "gguf_sha256": zoo.ZOO[name].sha256,
            "ppl": peer_perplexity(gguf, TEXT, CTX, CHUNKS, THREADS),
        }
        print(f"record: {name}: {golden['perplexity'][name]['ppl']:.4f}", file=sys.stderr)
    (HERE / "perplexity.json").write_text(json.dumps(golden, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
