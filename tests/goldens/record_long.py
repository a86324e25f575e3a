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

import argparse
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_generate import (
    REQUEST,
    _add_bos,
    _dumps,
    _free_port,
    _post,
    _wait_healthy,
    find_llama_binary,
    llama_env,
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
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [str(server), "-m", str(gguf), *SERVER_ARGS, "--port", str(port)]
    print(f"record: {name}: {' '.join(cmd)}", file=sys.stderr)
    proc = subprocess.Popen(cmd, env=llama_env(server), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    request: dict[str, Any] = {**REQUEST, "n_predict": N_PREDICT}
    try:
        _wait_healthy(base, proc)
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
        top = [
            [[t["id"], round(t["logprob"], 6)] for t in s["top_logprobs"]]
            for s in res["completion_probabilities"]
        ]
        case = {
            "prompt": prompt,
            "prompt_ids": ids,
            "fact": CODE,
            "tokens": res["tokens"],
            "text": res["content"],
            "stop_type": res.get("stop_type"),
            "top_logprobs": top,
        }
        print(f"record: {name}: {len(ids)} prompt tokens -> {res['content']!r}", file=sys.stderr)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    version = subprocess.run(
        [str(server), "--version"], capture_output=True, text=True, env=llama_env(server)
    )
    golden = {
        "model": name,
        "gguf": gguf.name,
        "gguf_sha256": zoo.ZOO[name].sha256,
        "llama_cpp": " ".join((version.stdout + version.stderr).split()),
        "command": ["llama-server", "-m", "<gguf>", *SERVER_ARGS, "--port", "<port>"],
        "recorded_by": "python tests/goldens/record_long.py",
        "add_bos": add_bos,
        "request": {"prompt": "<prompt>", **request},
        "cases": [case],
    }
    out = out_dir / f"long_{name}.json"
    out.write_text(_dumps(golden))
    print(f"record: wrote {out}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help=f"default: all of {', '.join(TARGET_TOKENS)}")
    ap.add_argument("-o", "--out-dir", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args(argv)
    if unknown := sorted(set(args.models) - set(TARGET_TOKENS)):
        ap.error(f"unknown models {unknown}; choose from {', '.join(TARGET_TOKENS)}")
    server = find_llama_binary("llama-server")
    if server is None:
        raise SystemExit("record: llama-server is not built; run `python -m bench.llama_cpp build`")
    for name in args.models or TARGET_TOKENS:
        record(name, server, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
