"""Record greedy continuations from llama.cpp's server as goldens for our own generate path.

For each zoo model: start ``llama-server`` on a free loopback port, and for each fixture prompt
(raw text, no chat template) record the prompt's token ids (``/tokenize``, BOS per the GGUF's
``tokenizer.ggml.add_bos_token``, which is what ``/completion`` does with a string prompt), the
greedy continuation's ids and text, and the top-5 log-probabilities at every step. Those come
from a softmax of the raw logits (``post_sampling_probs`` off), so they are the model's own.

Writes ``tests/goldens/generate_<model>.json``. Needs the llama.cpp tools
(``python -m bench.llama_cpp build``). Run from the repo root:

    python tests/goldens/record_generate.py [MODEL ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # for `bench`, which is not an installed package

from gguf import GGUFReader  # noqa: E402
from goinfer.compiler.sources import zoo  # noqa: E402

from bench.llama_cpp import find_llama_binary, llama_env  # noqa: E402

MODELS = ("qwen2.5-coder-0.5b", "gemma-3-270m", "smollm2-135m")
PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,", "Once upon a time")
N_PREDICT = 24
TOP_N = 5
REQUEST: dict[str, Any] = {
    "n_predict": N_PREDICT,
    "temperature": 0,
    "top_k": 1,
    "n_probs": TOP_N,
    "cache_prompt": False,
    "return_tokens": True,
}
SERVER_ARGS = ("-t", "2", "-c", "2048", "-np", "1", "--host", "127.0.0.1")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.3)
    raise SystemExit(f"llama-server not healthy after {timeout:.0f} s")


def _add_bos(gguf: Path) -> bool:
    field = GGUFReader(gguf).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.contents()) if field is not None else False


def _dumps(golden: dict[str, Any]) -> str:
    """JSON with one line per field and per step: diffs stay readable, the file stays small."""

    def one(v: Any) -> str:
        return json.dumps(v, ensure_ascii=False)

    lines = ["{"]
    for key, value in golden.items():
        if key != "cases":
            lines.append(f" {one(key)}: {one(value)},")
    lines.append(' "cases": [')
    for i, case in enumerate(golden["cases"]):
        lines.append("  {")
        for key, value in case.items():
            if key == "top_logprobs":
                steps = ",\n".join(f"    {one(s)}" for s in value)
                lines.append(f'   "top_logprobs": [\n{steps}\n   ]')
            else:
                lines.append(f"   {one(key)}: {one(value)},")
        lines.append("  }" + ("," if i + 1 < len(golden["cases"]) else ""))
    lines += [" ]", "}"]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def llama_server(name: str, server: Path, gguf: Path, args: tuple[str, ...]) -> Iterator[str]:
    """`llama-server` on `gguf` on a free loopback port, healthy; yields its base URL."""
    port = _free_port()
    cmd = [str(server), "-m", str(gguf), *args, "--port", str(port)]
    print(f"record: {name}: {' '.join(cmd)}", file=sys.stderr)
    proc = subprocess.Popen(cmd, env=llama_env(server), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, proc)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def golden_head(
    name: str, server: Path, gguf: Path, args: tuple[str, ...], request: dict[str, Any]
) -> dict[str, Any]:
    """What every golden records beside its cases: the model, the peer's version and command."""
    version = subprocess.run(
        [str(server), "--version"], capture_output=True, text=True, env=llama_env(server)
    )
    return {
        "model": name,
        "gguf": gguf.name,
        "gguf_sha256": zoo.ZOO[name].sha256,
        "llama_cpp": " ".join((version.stdout + version.stderr).split()),
        "command": ["llama-server", "-m", "<gguf>", *args, "--port", "<port>"],
        "add_bos": _add_bos(gguf),
        "request": {"prompt": "<prompt>", **request},
    }


def record(name: str, server: Path, out_dir: Path) -> Path:
    gguf = zoo.fetch(name)
    add_bos = _add_bos(gguf)
    cases = []
    with llama_server(name, server, gguf, SERVER_ARGS) as base:
        for prompt in PROMPTS:
            prompt_ids = _post(base + "/tokenize", {"content": prompt, "add_special": add_bos})["tokens"]
            res = _post(base + "/completion", {"prompt": prompt, **REQUEST})
            steps = res["completion_probabilities"]
            top = [[[t["id"], round(t["logprob"], 6)] for t in s["top_logprobs"]] for s in steps]
            tokens = res["tokens"]
            # The prompt the server evaluated is the one we tokenized (BOS included or not).
            if res.get("tokens_evaluated") not in (None, len(prompt_ids)):
                got = res["tokens_evaluated"]
                raise SystemExit(
                    f"{name}: {prompt!r}: the server evaluated {got} prompt tokens, not {len(prompt_ids)}"
                )
            if [s[0][0] for s in top] != tokens:
                print(
                    f"record: {name}: {prompt!r}: greedy ids differ from the top-1 ids (a tie?)",
                    file=sys.stderr,
                )
            cases.append(
                {
                    "prompt": prompt,
                    "prompt_ids": prompt_ids,
                    "tokens": tokens,
                    "text": res["content"],
                    "stop_type": res.get("stop_type"),
                    "top_logprobs": top,
                }
            )
            print(f"record: {name}: {prompt!r} -> {res['content']!r}", file=sys.stderr)
    golden = {**golden_head(name, server, gguf, SERVER_ARGS, REQUEST), "cases": cases}
    out = out_dir / f"generate_{name}.json"
    out.write_text(_dumps(golden))
    print(f"record: wrote {out}", file=sys.stderr)
    return out


def record_each(
    doc: str, models: Iterable[str], record_one: Callable[[str, Path, Path], Path], argv: list[str] | None
) -> int:
    """The recorders' command line: record the models named (default: all) with llama-server."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("models", nargs="*", help=f"default: all of {', '.join(models)}")
    ap.add_argument("-o", "--out-dir", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args(argv)
    if unknown := sorted(set(args.models) - set(models)):
        ap.error(f"unknown models {unknown}; choose from {', '.join(models)}")
    server = find_llama_binary("llama-server")
    if server is None:
        raise SystemExit("record: llama-server is not built; run `python -m bench.llama_cpp build`")
    for name in args.models or models:
        record_one(name, server, args.out_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    return record_each(__doc__, MODELS, record, argv)


if __name__ == "__main__":
    raise SystemExit(main())
