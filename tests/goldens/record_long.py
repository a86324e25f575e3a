"""Record llama.cpp's greedy answer to a long document with one fact buried in it.

For each zoo model: start ``llama-server`` with an 8k window on a free loopback port, grow a
generated document (numbered inventory records, one line of which carries the fact) until its
prompt reaches the model's target length, and record the prompt's ids, the greedy answer's ids
and text, and the top-5 log-probabilities at each step (as record_generate.py does).

Writes ``tests/goldens/long_<model>.json``. Needs the llama.cpp tools
(``python -m bench.llama_cpp build``). Run from the repo root:

    python tests/goldens/record_long.py [MODEL ...]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_generate import (
    REQUEST,
    _add_bos,
    _dumps,
    _post,
    golden_head,
    llama_server,
    record_each,
    zoo,
)

TARGET_TOKENS = {"qwen2.5-coder-0.5b": 6000, "gemma-3-270m": 6000, "smollm2-135m": 5000}
N_PREDICT = 12
SERVER_ARGS = ("-t", "2", "-c", "8192", "-np", "1", "--host", "127.0.0.1")
CODE = "7319"
FACT = f"Note: the access code for the north vault is {CODE}."
QUESTION = (
    "\n\nQuestion: What is the access code for the north vault?\n"
    "Answer: The access code for the north vault is"
)
ITEMS = (
    "copper wire",
    "oak planks",
    "glass jars",
    "wool blankets",
    "iron nails",
    "rope coils",
    "clay bricks",
)
ROOMS = ("east hall", "west hall", "cellar", "attic", "workshop", "south store")


def document(lines: int) -> str:
    """`lines` inventory records with FACT two fifths of the way in, then the question."""
    rng = random.Random(1234)
    out = []
    for i in range(lines):
        if i == lines * 2 // 5:
            out.append(FACT)
        item, room = rng.choice(ITEMS), rng.choice(ROOMS)
        out.append(f"Record {i + 1}: {rng.randint(2, 90)} units of {item} are kept in the {room}.")
    return "\n".join(out) + QUESTION


def record(name: str, server: Path, out_dir: Path) -> Path:
    gguf = zoo.fetch(name)
    add_bos = _add_bos(gguf)
    request: dict[str, Any] = {**REQUEST, "n_predict": N_PREDICT}
    with llama_server(name, server, gguf, SERVER_ARGS) as base:
        lines = 100
        while True:
            prompt = document(lines)
            ids = _post(base + "/tokenize", {"content": prompt, "add_special": add_bos})["tokens"]
            if len(ids) >= TARGET_TOKENS[name]:
                break
            lines = int(lines * TARGET_TOKENS[name] / len(ids)) + 1
        res = _post(base + "/completion", {"prompt": prompt, **request})
    if res.get("tokens_evaluated") not in (None, len(ids)):
        raise SystemExit(f"{name}: the server evaluated {res['tokens_evaluated']} tokens, not {len(ids)}")
    steps = res["completion_probabilities"]
    case = {
        "prompt": prompt,
        "prompt_ids": ids,
        "fact": CODE,
        "tokens": res["tokens"],
        "text": res["content"],
        "stop_type": res.get("stop_type"),
        "top_logprobs": [[[t["id"], round(t["logprob"], 6)] for t in s["top_logprobs"]] for s in steps],
    }
    print(f"record: {name}: {len(ids)} prompt tokens -> {res['content']!r}", file=sys.stderr)
    golden = {
        **golden_head(name, server, gguf, SERVER_ARGS, request),
        "recorded_by": "python tests/goldens/record_long.py",
        "cases": [case],
    }
    out = out_dir / f"long_{name}.json"
    out.write_text(_dumps(golden))
    print(f"record: wrote {out}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    return record_each(__doc__, TARGET_TOKENS, record, argv)


if __name__ == "__main__":
    raise SystemExit(main())
