"""Embeddings against sentence-transformers and llama-server, same machine, same run: `python -m bench.embed`.

    python -m bench.embed                  # ours f32, q8_0; sentence-transformers; llama-server f32, q8_0
    python -m bench.embed --quick          # fewer repetitions (a minute or two)
    python -m bench.embed --quants q8_0 --peers st,llama-f32

The model is all-MiniLM-L6-v2 (the zoo's Hugging Face folder). Ours: its bundles in every mode the
compiler offers an encoder (artifacts.manifest.ENCODER_QUANTS: f32, q8_0), built on first use and cached
(bench.run's `_ensure_bundle`), run by goinfer.runtime.encoder.Encoder in a worker process
(bench.embed_engine) with TVM_NUM_THREADS = --threads. sentence-transformers: torch CPU in the
reference venv (bench.reference_venv, created on first use), torch.set_num_threads(--threads), one
encode() call a batch. llama-server: `--embedding --pooling mean` on the same checkpoint converted
by llama.cpp's own convert_hf_to_gguf.py to f32 and q8_0 (bench.embed_llama, cached), `-t`/`-tb`
--threads, driven over HTTP at /v1/embeddings.

Measures, each text in, vectors out (tokenizing included; llama-server's HTTP and JSON too):
  throughput  one call embedding 64 inputs of 128 tokens each ([CLS] and [SEP] included), deterministic
              prose and code (bench.embed_inputs): embeddings/s and tokens/s at the median call
  latency     one call embedding one 16-token query, back to back: the median over --latency-reps
              calls, made in bursts of 10 after one untimed call
  idle        the same query after 0.25 s idle, as a query that finds the machine quiet sees it
              (thread pools asleep, caches cold): the median over --idle-reps; shown, not a target
The embedders run side by side and are stepped in turn, a call or a burst each (bench.embed_timing),
so drift on a shared machine falls on all of them alike; each timed call but a burst's follows a
0.25 s pause, so no thread pool still spinning from the last call takes cores from the next.
Beside each speed: the cosine of that row's vectors (the 64 inputs and the query) to
sentence-transformers' f32 output, min and mean. Targets: ours >= 2x sentence-transformers and
>= 1.5x llama-server's faster row on throughput and latency, at cosine >= 0.999.
Exit status 0 when at least one of our rows meets every target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from goinfer.artifacts.manifest import ENCODER_QUANTS

from bench import embed_inputs, embed_llama, llama_cpp, reference_venv
from bench.embed_timing import burst, timed
from bench.run import _ensure_bundle, parse_list, ratio

MODEL = "all-minilm-l6-v2"
PEERS = ("st", "llama-f32", "llama-q8_0")
RESULTS = Path(__file__).parent / "results" / "embed.json"
ST_TARGET, LLAMA_TARGET, COSINE_TARGET = 2.0, 1.5, 0.999
BATCH, BATCH_TOKENS, QUERY_TOKENS = 64, 128, 16
BURST = 10  # back-to-back queries a runner makes in its turn
REPO = Path(__file__).resolve().parents[1]


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


class Runner(Protocol):
    label: str
    meta: dict[str, Any]
    vectors: np.ndarray  # the batch's rows, then the query's

    def time(self, what: str) -> float: ...

    def burst(self, n: int) -> list[float]: ...


class Worker:
    """A worker process speaking bench.embed_timing's protocol (ours, sentence-transformers)."""

    def __init__(self, label: str, cmd: list[str], env: dict[str, str], out: Path) -> None:
        self.label = label
        fd, self.log = tempfile.mkstemp(prefix=f"bench-embed-{label.replace(' ', '-')}-", suffix=".log")
        with open(fd, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
            )
        self.meta = self._line()
        self.vectors = np.load(out)

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-15:])
            raise SystemExit(f"{tail}\nbench: {self.label} exited ({self.proc.wait()}); log {self.log}")
        return json.loads(line)

    def _ask(self, cmd: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._line()["s"]

    def time(self, what: str) -> float:
        return float(self._ask(what))

    def burst(self, n: int) -> list[float]:
        return [float(s) for s in self._ask(f"burst {n}")]

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except OSError:  # it died on its own: wait() collects it
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class LlamaRunner:
    """llama-server's client in this process, timed by the same `timed` as the workers."""

    def __init__(self, label: str, client: embed_llama.Client, batch: list[str], query: str) -> None:
        self.label, self.client, self.batch, self.query = label, client, batch, query
        batch_vectors = client.embed(batch)
        batch_tokens = client.prompt_tokens  # from the reply's usage
        self.vectors = np.concatenate([batch_vectors, client.embed([query])])
        self.meta = {"batch_tokens": batch_tokens, "query_tokens": client.prompt_tokens}

    def time(self, what: str) -> float:
        return timed(self.client.embed, self.batch if what == "batch" else [self.query])

    def burst(self, n: int) -> list[float]:
        return burst(self.client.embed, self.query, n)


def _tokenizer(model_dir: Path) -> embed_inputs.Tokenize:
    """The checkpoint's WordPiece as text -> ids with [CLS] and [SEP], without the 128-token
    truncation and fixed padding that its tokenizer.json declares: only to size the inputs."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return lambda text: tok.encode(text).ids


def cpu_features() -> str:
    """The vector extensions that decide these kernels' speed, as /proc/cpuinfo lists them."""
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return "?"
    have = set(flags.split(":", 1)[1].split())
    return " ".join(f for f in wanted if f in have) or "none of avx2/avx512"


def cosines(vectors: np.ndarray, reference: np.ndarray) -> np.ndarray:
    a = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    b = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    return np.sum(a * b, axis=1)


def start(a: argparse.Namespace, stack: ExitStack, batch: list[str], query: str, tmp: Path) -> list[Runner]:
    """Every embedder asked for, loaded and warm (each has embedded the batch and the query once)."""
    from goinfer.compiler.sources import zoo

    model_dir = zoo.resolve(MODEL)
    texts = tmp / "texts.json"
    texts.write_text(json.dumps(batch))
    runners: list[Runner] = []
    quants = parse_list(a.quants, ENCODER_QUANTS, "quant") if a.quants else []
    for quant in quants:
        bundle = _ensure_bundle(model_dir, quant)
        out = tmp / f"ours-{quant}.npy"
        cmd = [sys.executable, "-m", "bench.embed_engine", str(bundle), "--texts", str(texts)]
        cmd += ["--out", str(out), "--query", query]
        env = {**os.environ, "TVM_NUM_THREADS": str(a.threads)}
        _log(f"loading ours {quant} ({bundle.name})")
        w = Worker(f"ours {quant}", cmd, env, out)
        stack.callback(w.close)
        runners.append(w)
    peers = parse_list(a.peers, PEERS, "peer") if a.peers else []
    if "st" in peers:
        python = reference_venv.ensure()
        out = tmp / "st.npy"
        cmd = [str(python), "-m", "bench.st_embed", str(model_dir), "--texts", str(texts), "--out", str(out)]
        cmd += ["--worker", "--query", query, "--threads", str(a.threads)]
        _log("loading sentence-transformers (torch CPU)")
        w = Worker("sentence-transformers", cmd, reference_venv.env(a.threads), out)
        stack.callback(w.close)
        runners.append(w)
    for peer in peers:
        if peer.startswith("llama-"):
            outtype = peer.removeprefix("llama-")
            gguf = embed_llama.convert(model_dir, zoo.ZOO[MODEL].sha256, outtype)
            server = stack.enter_context(embed_llama.server(gguf, a.threads))
            client = embed_llama.Client(server.port)
            stack.callback(client.close)
            runners.append(LlamaRunner(f"llama-server {outtype}", client, batch, query))
    return runners


def measure(runners: list[Runner], a: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Seconds per call for each runner, stepping them in turn a call (or a burst) at a time."""
    out: dict[str, dict[str, list[float]]] = {
        r.label: {k: [] for k in ("batch", "query", "idle")} for r in runners
    }
    for i in range(a.rounds):
        _log(f"throughput round {i + 1}/{a.rounds}")
        for r in runners:
            out[r.label]["batch"].append(r.time("batch"))
    _log(f"latency: {a.latency_reps} queries back to back each, in bursts of {BURST}")
    for done in range(0, a.latency_reps, BURST):
        for r in runners:
            out[r.label]["query"] += r.burst(min(BURST, a.latency_reps - done))
    _log(f"latency after idle: {a.idle_reps} queries each")
    for _ in range(a.idle_reps):
        for r in runners:
            out[r.label]["idle"].append(r.time("query"))
    return out


def summarize(runners: list[Runner], times: dict[str, Any], reference: np.ndarray) -> list[dict[str, Any]]:
    rows = []
    for r in runners:
        batch_s = statistics.median(times[r.label]["batch"])
        cos = cosines(r.vectors, reference)
        rows.append(
            {
                "label": r.label,
                "emb_s": BATCH / batch_s,
                "tok_s": r.meta["batch_tokens"] / batch_s,
                "query_ms": 1e3 * statistics.median(times[r.label]["query"]),
                "idle_ms": 1e3 * statistics.median(times[r.label]["idle"]),
                "cos_min": float(cos.min()),
                "cos_mean": float(cos.mean()),
                "meta": r.meta,
                "batch_s": times[r.label]["batch"],
                "query_s": times[r.label]["query"],
                "idle_s": times[r.label]["idle"],
            }
        )
    return rows


def _peers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if not r["label"].startswith("ours")]


def table(rows: list[dict[str, Any]]) -> str:
    """Each row's speeds, its ratio to every peer (higher: the row is faster), its cosines."""
    peers = _peers(rows)
    short = {p["label"]: p["label"].replace("sentence-transformers", "st").replace("llama-server ", "l.")
             for p in peers}  # fmt: skip
    thr = " ".join(f"{'x' + short[p['label']]:>7}" for p in peers)
    lat = " ".join(f"{'x' + short[p['label']]:>7}" for p in peers)
    head = f"{'':22} {'emb/s':>7} {'tok/s':>7} {thr} {'query ms':>8} {lat} {'idle ms':>7} {'cos min':>8} "
    head += f"{'cos mean':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        t = " ".join(f"{ratio(r['emb_s'], p['emb_s']):6.2f}x" for p in peers)
        q = " ".join(f"{ratio(p['query_ms'], r['query_ms']):6.2f}x" for p in peers)
        lines.append(
            f"{r['label']:22} {r['emb_s']:7.1f} {r['tok_s']:7.0f} {t} {r['query_ms']:8.2f} {q} "
            f"{r['idle_ms']:7.2f} {r['cos_min']:8.5f} {r['cos_mean']:8.5f}"
        )
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[tuple[bool, str]]:
    """Per row of ours: every target, against sentence-transformers and llama-server's faster row
    of each measure, as (met, line)."""
    st = next((r for r in rows if r["label"] == "sentence-transformers"), None)
    llama = [r for r in rows if r["label"].startswith("llama-server")]
    out = []
    for r in rows:
        if not r["label"].startswith("ours"):
            continue
        checks = [(r["cos_min"] >= COSINE_TARGET, f"cos min {r['cos_min']:.5f} >= {COSINE_TARGET}")]
        if st is not None:
            thr, lat = ratio(r["emb_s"], st["emb_s"]), ratio(st["query_ms"], r["query_ms"])
            checks += [
                (thr >= ST_TARGET, f"throughput {thr:.2f}x st"),
                (lat >= ST_TARGET, f"latency {lat:.2f}x st"),
            ]
        if llama:
            thr = ratio(r["emb_s"], max(p["emb_s"] for p in llama))
            lat = ratio(min(p["query_ms"] for p in llama), r["query_ms"])
            checks += [
                (thr >= LLAMA_TARGET, f"throughput {thr:.2f}x llama"),
                (lat >= LLAMA_TARGET, f"latency {lat:.2f}x llama"),
            ]
        ok = all(c for c, _ in checks)
        detail = ", ".join(f"{text} {'ok' if c else 'MISSED'}" for c, text in checks)
        out.append((ok, f"{'PASS' if ok else 'FAIL'} {r['label']}: {detail}"))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.embed", description=__doc__.splitlines()[0])
    modes = ",".join(ENCODER_QUANTS)
    ap.add_argument("--quants", default=modes, help=f"ours: a subset of {modes} (or '')")
    ap.add_argument("--peers", default=",".join(PEERS), help="a subset of st,llama-f32,llama-q8_0 (or '')")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None, help="timed batch calls each (10; quick 3)")
    ap.add_argument("--latency-reps", type=int, default=None, help="timed queries each (50; quick 20)")
    ap.add_argument("--idle-reps", type=int, default=None, help="queries after idle each (20; quick 10)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", default=str(RESULTS), help="where to write what was measured ('': nowhere)")
    a = ap.parse_args(argv)
    a.rounds = a.rounds or (3 if a.quick else 10)
    a.latency_reps = a.latency_reps or (20 if a.quick else 50)
    a.idle_reps = a.idle_reps or (10 if a.quick else 20)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from goinfer.compiler.sources import zoo

    tokenize = _tokenizer(zoo.resolve(MODEL))
    batch = embed_inputs.batch(tokenize, BATCH, BATCH_TOKENS)
    query = embed_inputs.query(tokenize, QUERY_TOKENS)
    reference = reference_venv.embeddings([*batch, query], MODEL)
    cpu = f"{llama_cpp.cpu_name()} ({cpu_features()}; {os.cpu_count()} CPUs)"
    load_before = os.getloadavg()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp:
        runners = start(a, stack, batch, query, Path(tmp))
        if not runners:
            raise SystemExit("bench: nothing to run")
        times = measure(runners, a)
    rows = summarize(runners, times, reference)
    print(
        f"CPU: {cpu}; {a.threads} threads each; {MODEL}; throughput: {BATCH} inputs x {BATCH_TOKENS} tokens "
        f"in one call, median of {a.rounds}; latency: one {QUERY_TOKENS}-token query, median of "
        f"{a.latency_reps} back to back (idle: of {a.idle_reps} after 0.25 s idle); cosine to "
        f"sentence-transformers f32 over the {BATCH + 1} vectors; load average before {load_before[0]:.2f}"
    )
    print(table(rows))
    checks = targets(rows)
    for _, line in checks:
        print(line)
    if a.json:
        report = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "cpu": cpu,
            "threads": a.threads,
            "model": MODEL,
            "rounds": a.rounds,
            "latency_reps": a.latency_reps,
            "idle_reps": a.idle_reps,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "llama_server_args": {"slots": embed_llama.SLOTS, "window": embed_llama.WINDOW},
            "rows": rows,
            "targets": [line for _, line in checks],
        }
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if any(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
