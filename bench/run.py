"""Our engine against llama.cpp on the same GGUF, in one run, alternating A/B/A/B.

    python -m bench.run                       # the four zoo LLMs, int4 and int8int8, 2 rounds
    python -m bench.run --models smollm2-135m --quants int4 --rounds 1 --tg 32 --pp 128

Builds any missing bundle (and llama.cpp, AMX off, see bench/llama_cpp.py) first. Each engine runs
in its own process with the same thread count. Prints tok/s for decode (tg) and prefill (pp), our
ratio to llama-bench, bytes read per decoded token, the fraction of the machine's measured read
bandwidth that reaches (measured again each round, beside the runs; and over a buffer of the weights'
size, which a large last-level cache partly holds), RSS after load against the bundle size, and cold
start to first token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import llama_cpp

MODELS = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma-3-270m", "smollm2-135m")
QUANTS = ("gguf", "int4")  # the default run: the default mode and the smallest
KNOWN_QUANTS = ("gguf", "int4", "int4mix", "int8int8", "int8", "f32")


@dataclass(frozen=True)
class Row:
    model: str
    quant: str
    ours_tg: float
    peer_tg: float
    ours_pp: float
    peer_pp: float
    ours_mb_per_token: float
    peer_mb_per_token: float
    bandwidth_gbs: float
    rss_after_load_mb: float
    bundle_mb: float
    cold_first_token_s: float
    # Read bandwidth over a buffer of our weights' size: above bandwidth_gbs where the last-level
    # cache holds part of a model between tokens (a large L3), the roofline a decode can reach.
    bandwidth_at_size_gbs: float = float("nan")

    @property
    def tg_ratio(self) -> float:
        return ratio(self.ours_tg, self.peer_tg)

    @property
    def pp_ratio(self) -> float:
        return ratio(self.ours_pp, self.peer_pp)

    @property
    def ours_roofline(self) -> float:
        return roofline_fraction(self.ours_mb_per_token, self.ours_tg, self.bandwidth_gbs)

    @property
    def ours_roofline_at_size(self) -> float:
        return roofline_fraction(self.ours_mb_per_token, self.ours_tg, self.bandwidth_at_size_gbs)

    @property
    def peer_roofline(self) -> float:
        return roofline_fraction(self.peer_mb_per_token, self.peer_tg, self.bandwidth_gbs)


def ratio(ours: float, peer: float) -> float:
    return ours / peer if peer > 0 else float("nan")


def roofline_fraction(mb_per_token: float, tok_s: float, bandwidth_gbs: float) -> float:
    """Share of the machine's read bandwidth a decode at `tok_s` uses, streaming every weight once."""
    return mb_per_token * 1e6 * tok_s / (bandwidth_gbs * 1e9) if bandwidth_gbs > 0 else float("nan")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(rows: list[Row]) -> str:
    head = (
        f"{'model':20} {'quant':8} {'tg ours':>8} {'tg l.cpp':>8} {'ratio':>6} {'pp ours':>8} "
        f"{'pp l.cpp':>8} {'ratio':>6} {'MB/tok':>7} {'GB/s':>5} {'of':>5} {'roof':>5} {'l.cpp':>5} "
        f"{'@size':>5} {'roof':>5} {'RSS MB':>7} {'bundle':>7} {'cold s':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.model:20} {r.quant:8} {r.ours_tg:8.1f} {r.peer_tg:8.1f} {r.tg_ratio:5.2f}x "
            f"{r.ours_pp:8.1f} {r.peer_pp:8.1f} {r.pp_ratio:5.2f}x {r.ours_mb_per_token:7.0f} "
            f"{r.ours_mb_per_token * r.ours_tg / 1e3:5.1f} {r.bandwidth_gbs:5.1f} {r.ours_roofline:5.0%} "
            f"{r.peer_roofline:5.0%} {r.bandwidth_at_size_gbs:5.1f} {r.ours_roofline_at_size:5.0%} "
            f"{r.rss_after_load_mb:7.0f} {r.bundle_mb:7.0f} {r.cold_first_token_s:6.2f}"
        )
    return "\n".join(lines)


def parse_list(value: str, known: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in known]
    if unknown or not items:
        raise SystemExit(
            f"bench: unknown {what} {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}"
        )
    return items


# -- measuring ---------------------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "TVM_NUM_THREADS": str(threads)}


def _bandwidth(threads: int, mb: float | None = None) -> float:
    size = [] if mb is None else ["--mb", f"{mb:.0f}"]
    out = subprocess.run(
        [sys.executable, "-m", "bench.bandwidth", *size],
        env=_env(threads),
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def _ours(bundle: Path, pp: int, tg: int, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.engine", str(bundle), "--pp", str(pp), "--tg", str(tg)],
        env=_env(threads),
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"bench: our engine failed on {bundle.name}: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _peer(binary: Path, gguf: Path, pp: int, tg: int, threads: int) -> dict[str, float]:
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-p",
        str(pp),
        "-n",
        str(tg),
        "-r",
        "1",
        "-o",
        "json",
    ]
    out = subprocess.run(cmd, env=llama_cpp.llama_env(binary), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench: llama-bench failed: {out.stderr.strip().splitlines()[-1:]}")
    res = {}
    for r in json.loads(out.stdout):
        res["tg_tok_s" if r["n_gen"] else "pp_tok_s"] = float(r["avg_ts"])
    return res


def _bundle_weight_mb(bundle: Path) -> float:
    """MB of weights a decode step reads: all of them but an untied embedding table, of which a
    token reads one row (Qwen's 151936 x 896: a fifth of the 0.5B's bytes)."""
    from goinfer.artifacts import giw, manifest

    with giw.open_bundle(bundle, verify="none") as b:
        spec = manifest.Manifest.from_json(b.manifest).model
        names = [n for n in b.manifest["params"] if spec.tie_embeddings or not n.startswith("embed_tokens.")]
        return sum(b.tensor_info(n).nbytes for n in names) / 1e6


def _gguf_weight_mb(gguf: Path) -> float:
    """The same for a GGUF: token_embd is read a row a token where output.weight is the head."""
    import gguf as gguf_lib

    tensors = gguf_lib.GGUFReader(str(gguf)).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight")) / 1e6


def _ensure_bundle(gguf: Path, quant: str) -> Path:
    from goinfer.artifacts import giw
    from goinfer.compiler.sources import zoo

    bundle = zoo.bundle_path(gguf, quant, "llvm")
    if not bundle.is_file():
        _log(f"building {bundle.name}")
        bundle.parent.mkdir(parents=True, exist_ok=True)  # a fresh machine has no bundle cache yet
        # In a child process: by now this one may hold mapped bundles and gigabytes of logits
        # (bench.quality), and a compile beside them died without a word (twice, Gemma's).
        cmd = [
            sys.executable,
            "-m",
            "goinfer.cli.main",
            "build",
            str(gguf),
            "--quant",
            quant,
            "-o",
            str(bundle),
        ]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"bench: building {bundle.name} failed (command: {' '.join(cmd)})")
    # A bundle's first open hashes every blob (once per machine): not part of a cold start.
    with giw.open_bundle(bundle, verify="once"):
        pass
    return bundle


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--quants", default=",".join(QUANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    models, quants = (
        parse_list(a.models, MODELS, "model"),
        parse_list(a.quants, KNOWN_QUANTS, "quant"),
    )

    from goinfer.compiler.sources import zoo

    peer_bin = llama_cpp.build() / "llama-bench"
    rows = []
    for name in models:
        gguf = zoo.resolve(name)
        peer_mb = _gguf_weight_mb(gguf)
        for quant in quants:
            bundle = _ensure_bundle(gguf, quant)
            ours_mb = _bundle_weight_mb(bundle)
            ours, peer, bandwidth, at_size = [], [], [], []
            for i in range(a.rounds):  # A/B/A/B: drift in the machine hits both sides alike
                _log(f"{name} {quant} round {i + 1}/{a.rounds}: ours")
                ours.append(_ours(bundle, a.pp, a.tg, a.threads))
                _log(f"{name} {quant} round {i + 1}/{a.rounds}: llama.cpp")
                peer.append(_peer(peer_bin, gguf, a.pp, a.tg, a.threads))
                # Measured every round, beside the runs: on a shared host it moved 19-38 GB/s
                # within an hour, which would swing a roofline fraction measured once by half.
                bandwidth.append(_bandwidth(a.threads))
                at_size.append(_bandwidth(a.threads, ours_mb))
                _log(
                    f"read bandwidth {bandwidth[-1]:.1f} GB/s with {a.threads} threads"
                    f" ({at_size[-1]:.1f} over {ours_mb:.0f} MB)"
                )
            rows.append(
                Row(
                    name,
                    quant,
                    median([o["tg_tok_s"] for o in ours]),
                    median([p["tg_tok_s"] for p in peer]),
                    median([o["pp_tok_s"] for o in ours]),
                    median([p["pp_tok_s"] for p in peer]),
                    ours_mb,
                    peer_mb,
                    median(bandwidth),
                    median([o["rss_after_load_mb"] for o in ours]),
                    bundle.stat().st_size / 2**20,
                    median([o["cold_first_token_s"] for o in ours]),
                    median(at_size),
                )
            )
    print(
        f"{a.threads} threads; tg{a.tg}, pp{a.pp}, median of {a.rounds} rounds; GB/s: what our decode"
        " reads, of the machine's read bandwidth (measured each round); @size: the same over a"
        " buffer of our weights' size, and the roofline fraction against that"
    )
    print(table(rows))
    if a.json:
        cpu = llama_cpp.cpu_name()
        a.json.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "cpu": cpu,
                    "threads": a.threads,
                    "tg": a.tg,
                    "pp": a.pp,
                    "rounds": a.rounds,
                    "rows": [
                        {
                            **asdict(r),
                            "tg_ratio": r.tg_ratio,
                            "pp_ratio": r.pp_ratio,
                            "ours_roofline": r.ours_roofline,
                            "ours_roofline_at_size": r.ours_roofline_at_size,
                            "peer_roofline": r.peer_roofline,
                        }
                        for r in rows
                    ],
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
