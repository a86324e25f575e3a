"""llama-server --embedding as bench.embed's peer: the checkpoint converted to GGUF by llama.cpp's
own convert_hf_to_gguf.py, then driven over HTTP.

The converter is the one in the vendored tree bench.llama_cpp builds from (so the GGUF matches the
server's version); it imports torch and transformers, so it runs with the reference venv's python
(bench.reference_venv), and takes gguf from the tree's own gguf-py. Converted files are cached under
``<cache>/embed-gguf/``, named by the checkpoint's sha256 and the llama.cpp version.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np

from bench import llama_cpp, reference_venv
from bench.serving import Server, llama_server

OUTTYPES = ("f32", "q8_0")


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def source_tree() -> Path:
    """The vendored llama.cpp tree (convert_hf_to_gguf.py, gguf-py), extracted by bench.llama_cpp."""
    src = llama_cpp.version_dir() / "src" / "vendor" / "llama.cpp"
    if not (src / "convert_hf_to_gguf.py").is_file():
        llama_cpp.build()  # extracts the sdist on the way (a no-op for the binaries when built)
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"bench: no convert_hf_to_gguf.py in {src}; remove it and run bench.llama_cpp build")
    return src


def convert(model_dir: Path, sha256: str, outtype: str = "f32") -> Path:
    """The checkpoint folder as a GGUF of `outtype` (f32 | q8_0), converted once and cached."""
    from goinfer.artifacts import cache

    out = cache.root() / "embed-gguf" / f"{model_dir.name}-{sha256[:12]}-{llama_cpp.VERSION}.{outtype}.gguf"
    if out.is_file():
        return out
    python = reference_venv.ensure()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    script = source_tree() / "convert_hf_to_gguf.py"
    cmd = [str(python), str(script), str(model_dir), "--outfile", str(partial), "--outtype", outtype]
    _log(f"converting {model_dir.name} to GGUF {outtype} with llama.cpp's converter")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=reference_venv.env(), capture_output=True, text=True)
    if proc.returncode != 0 or not partial.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise SystemExit(f"{tail}\nbench: the conversion failed (exit {proc.returncode}): {' '.join(cmd)}")
    os.replace(partial, out)
    _log(f"converted -> {out} ({time.monotonic() - t0:.1f} s)")
    return out


# Slots: llama-server takes a slot an input and packs the running slots' tokens into one ubatch,
# whose attention is one masked n_tokens x n_tokens product: 64 slots in an 8192-token ubatch ran
# the 64 x 128-token batch 3.5x slower than 4 slots in 512 (measured: 1, 4, 8, 16, 64 slots with
# ubatches of 512, 512, 1024, 2048, 8192 took 1.41, 1.39, 1.56, 1.71, 4.87 s on 2 threads).
SLOTS = 4
WINDOW = 512  # positions of a BERT input: an input must fit one ubatch whole


def server(gguf: Path, threads: int, slots: int = SLOTS) -> AbstractContextManager[Server]:
    """llama-server for embeddings: mean pooling (the checkpoint's; the GGUF says it too), `slots`
    slots of WINDOW positions, a ubatch that holds them all, and `threads` for both phases."""
    ctx = slots * WINDOW
    args = ["--embedding", "--pooling", "mean", "-tb", str(threads), "-np", str(slots), "-c", str(ctx)]
    args += ["-b", str(ctx), "-ub", str(ctx)]
    return llama_server(gguf, threads, args)


class Client:
    """A kept-alive connection to /v1/embeddings (the OpenAI shape, L2-normalized vectors)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        self.prompt_tokens = 0  # of the last request, from its usage

    def _post(self, body: str) -> tuple[int, bytes]:
        self.conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        return resp.status, resp.read()

    def embed(self, texts: list[str]) -> np.ndarray:
        body = json.dumps({"input": texts, "model": "embed", "encoding_format": "float"})
        try:
            status, raw = self._post(body)
        except (ConnectionError, http.client.HTTPException):
            # The server closes an idle kept-alive connection (while the other embedders take
            # their turns): open another and send again.
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            status, raw = self._post(body)
        data: dict[str, Any] = json.loads(raw)
        if status != 200:
            raise SystemExit(f"bench: llama-server /v1/embeddings answered {status}: {data}")
        self.prompt_tokens = int(data.get("usage", {}).get("prompt_tokens", 0))
        rows = sorted(data["data"], key=lambda d: d["index"])
        return np.asarray([r["embedding"] for r in rows], dtype=np.float32)

    def close(self) -> None:
        self.conn.close()
