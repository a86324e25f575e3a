"""Record llama.cpp's next-token log-probs for tests/test_reference.py (run by hand, once).

For each model, two llama-server runs on 127.0.0.1 at a free port: the real quantized GGUF, and a
float32 copy of its first few blocks made by tests/reference/derive.py (the tight check; gemma's
copy also gets a 4-token sliding window and pattern 3 so SWA is exercised). In each, tokenize a
fixed prompt, and for every prefix prompt[:k] ask /completion for one token with the top-n raw
log-probs (softmax of the logits, before any sampler). Writes tests/goldens/reference_<model>.json;
the test then needs no llama.cpp. Exits 0 with a message when llama-server or a model is missing.

    python tests/goldens/record_reference.py [--server PATH] [--models-dir DIR] [--only NAME]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/, for `reference`

from reference.derive import derive_f32_gguf  # noqa: E402

CACHE = Path(os.environ.get("GOINFER_CACHE", Path.home() / ".cache/goinfer"))
VENDORED_SERVER = CACHE / "dl/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"

MODELS = {
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "gemma-3-270m": "gemma-3-270m-q4_k_m.gguf",
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
}
# (blocks kept, metadata overrides) of each derived float32 model
DERIVED: dict[str, tuple[int, dict[str, int]]] = {
    "qwen2.5-coder-0.5b": (4, {}),
    # 6 blocks so a global layer is present; window 4 < the ~20-token prompt
    "gemma-3-270m": (6, {"gemma3.attention.sliding_window": 4, "gemma3.attention.sliding_window_pattern": 3}),
    "smollm2-135m": (8, {}),
}
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
N_PROBS = 10

# f32 KV cache and no flash attention: fewer llama.cpp-side roundings, so the golden is closer to
# the exact math and the tolerance in the test can stay tight. --no-repack: a -march=native build
# enables ggml's AMX buffer type, whose tile instructions trap (SIGILL) on VMs that do not expose
# AMX state; repacking is a layout choice and does not change the math.
SERVER_ARGS = ["-t", "2", "-tb", "2", "-c", "256", "-np", "1", "-ngl", "0"]
SERVER_ARGS += ["-fa", "off", "-ctk", "f32", "-ctv", "f32", "--no-repack", "--no-warmup"]
COMPLETION = {
    "n_predict": 1,
    "n_probs": N_PROBS,
    "post_sampling_probs": False,
    "temperature": 0.0,
    "cache_prompt": False,
    "return_tokens": True,
}


def _default_server() -> Path:
    if env := os.environ.get("LLAMA_SERVER"):
        return Path(env)
    try:  # the project's llama.cpp cache, when run from a checkout
        sys.path.insert(0, str(HERE.parents[1]))
        from bench.llama_cpp import find_llama_binary

        if found := find_llama_binary("llama-server"):
            return found
    except ImportError:
        pass
    return VENDORED_SERVER


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError("llama-server did not become healthy")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _serve(server: Path, gguf: Path, ids: list[int] | None) -> tuple[list[int], list[dict[str, Any]]]:
    """Start llama-server on gguf; tokenize PROMPT unless ids are given; top-N at every position."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS]
    env = {**os.environ, "LD_LIBRARY_PATH": f"{server.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        _wait_healthy(url, proc)
        if ids is None:
            tokens = _post(f"{url}/tokenize", {"content": PROMPT, "add_special": True})["tokens"]
            ids = [int(t) for t in tokens]
        steps = []
        for k in range(1, len(ids) + 1):
            # token-array prompt: the server adds no BOS; cache_prompt off so each prefix is one
            # fresh batch, like the reference's all-positions pass.
            out = _post(f"{url}/completion", {"prompt": ids[:k], **COMPLETION})
            top = out["completion_probabilities"][0]["top_logprobs"]
            steps.append({"position": k - 1, "top": [[int(t["id"]), float(t["logprob"])] for t in top]})
        return ids, steps
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def record(name: str, gguf: Path, server: Path) -> dict[str, Any]:
    version = subprocess.run([str(server), "--version"], capture_output=True, text=True).stderr.strip()
    ids, steps = _serve(server, gguf, None)
    n_layer, overrides = DERIVED[name]
    with tempfile.TemporaryDirectory() as tmp:
        derived = Path(tmp) / f"{name}-f32.gguf"
        derive_f32_gguf(gguf, derived, n_layer, overrides)
        derived_sha = sha256(derived)
        _, derived_steps = _serve(server, derived, ids)
    return {
        "model": name,
        "gguf": gguf.name,
        "gguf_size": gguf.stat().st_size,
        "gguf_sha256": sha256(gguf),
        "llama_cpp_version": version,
        "server_command": [
            "llama-server",
            "-m",
            "<gguf>",
            "--host",
            "127.0.0.1",
            "--port",
            "<free>",
            *SERVER_ARGS,
        ],
        "tokenize_request": {"content": PROMPT, "add_special": True},
        "completion_request": {"prompt": "<token_ids[:position+1]>", **COMPLETION},
        "prompt": PROMPT,
        "token_ids": ids,
        "quantized": {"steps": steps},
        "derived": {
            "recipe": "tests/reference/derive.py:derive_f32_gguf",
            "n_layer": n_layer,
            "overrides": overrides,
            "sha256": derived_sha,
            "steps": derived_steps,
        },
    }


def dump(obj: Any, indent: int = 0) -> str:
    """JSON with one line per step: objects and lists of objects indented, other lists inline."""
    pad = " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        body = ",\n".join(f"{pad}{json.dumps(k)}: {dump(v, indent + 1)}" for k, v in obj.items())
        return "{\n" + body + "\n" + " " * indent + "}"
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        body = ",\n".join(pad + json.dumps(v) for v in obj)
        return "[\n" + body + "\n" + " " * indent + "]"
    return json.dumps(obj)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", type=Path, default=None)
    ap.add_argument("--models-dir", type=Path, default=CACHE / "models")
    ap.add_argument("--only", choices=sorted(MODELS))
    args = ap.parse_args()
    server = args.server or _default_server()
    if not server.is_file():
        print(f"skip: no llama-server at {server}")
        return 0
    for name, fname in MODELS.items():
        if args.only and name != args.only:
            continue
        gguf = args.models_dir / fname
        if not gguf.is_file():
            print(f"skip {name}: {gguf} missing")
            continue
        golden = record(name, gguf, server)
        out = HERE / f"reference_{name}.json"
        out.write_text(dump(golden) + "\n")
        print(f"wrote {out} ({len(golden['token_ids'])} positions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
