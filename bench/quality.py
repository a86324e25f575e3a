"""Quality beside size and speed, per model and quant, against llama.cpp on the same GGUF and text.

    python -m bench.quality                  # the zoo LLMs but the 1.5B; gguf, f32, int4, int4mix, int8int8
    python -m bench.quality --models qwen2.5-coder-1.5b --quants gguf,int4 --chunks 4

For each text (by default two: the first 40,000 bytes of the seed spec when this checkout has
../shared beside it, and this repo's compiler source, so one file does not decide) it prints:

- our perplexity and `llama-perplexity`'s, scored the same way: chunks of --ctx tokens (BOS first
  where the model adds one), each scoring the second half of its positions;
- KL(f32 || quant) and top-1 agreement against our own f32 build over those positions;
- the bundle's weight MB and its decode tok/s (tg64, 2 threads), so size, speed and quality are
  read together;
- then, per model and text, the quality-per-byte frontier: each mode's perplexity against the weight
  MB a decoded token reads, smallest first, with the Pareto-optimal modes marked.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import llama_cpp
from .run import MODELS, _bundle_weight_mb, _ensure_bundle, _log, _ours, parse_list

REPO = Path(__file__).resolve().parents[1]
# gguf (the GGUF's own blocks, value-exact) first: the default build, so the baseline of the report.
QUANTS = ("gguf", "f32", "int4", "int4mix", "int8int8")
# The 1.5B is left out by default: its f32 KL reference alone is a ~6 GB bundle, and each mode's
# forward passes cost three to four times the 0.5B's. Ask for it with --models.
DEFAULT_MODELS = tuple(m for m in MODELS if m != "qwen2.5-coder-1.5b")
TEXT_BYTES = 40_000


@dataclass(frozen=True)
class Row:
    model: str
    quant: str
    text: str
    ppl_ours: float
    ppl_peer: float
    kl_vs_f32: float
    top1_vs_f32: float
    bundle_mb: float
    tg_tok_s: float

    @property
    def ppl_gap(self) -> float:
        """Our perplexity over llama.cpp's, minus one: +0.01 is 1% worse."""
        return self.ppl_ours / self.ppl_peer - 1 if self.ppl_peer > 0 else float("nan")


def texts(limit: int = TEXT_BYTES) -> dict[str, str]:
    """The default texts: the seed spec (where ../shared is beside this checkout) and our own code."""
    out = {}
    seeds = sorted((REPO.parent / "shared" / "seed").glob("*.txt"))
    if seeds:
        out["seed"] = seeds[0].read_bytes()[:limit].decode("utf-8", "ignore")
    code = "".join(p.read_text() for p in sorted((REPO / "compiler").rglob("*.py")))
    out["code"] = code.encode()[:limit].decode("utf-8", "ignore")
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def scored_logprobs(
    model, tokens: list[int], ctx: int, chunks: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per chunk: log-probs at the scored positions (the second half, as llama-perplexity scores
    them) and the tokens they predict."""
    first = ctx // 2
    for i in range(min(chunks, len(tokens) // ctx)):
        chunk = tokens[i * ctx : (i + 1) * ctx]
        if model.add_bos and model.bos_id is not None:
            chunk = [model.bos_id, *chunk[1:]]  # llama-perplexity puts BOS first in every chunk
        logits = np.concatenate(list(model.prefill_logits(chunk)))
        yield _log_softmax(logits[first : ctx - 1]), np.asarray(tokens[i * ctx + first + 1 : (i + 1) * ctx])


def perplexity(lps: list[tuple[np.ndarray, np.ndarray]]) -> float:
    nll = np.concatenate([-lp[np.arange(len(t)), t] for lp, t in lps])
    return float(np.exp(nll.mean()))


def against(
    lps: list[tuple[np.ndarray, np.ndarray]], ref: list[tuple[np.ndarray, np.ndarray]]
) -> tuple[float, float]:
    """(mean KL(ref || lps), top-1 agreement) over the scored positions."""
    kls, same = [], []
    for (lp, _), (rp, _) in zip(lps, ref, strict=True):
        kls.append((np.exp(rp) * (rp - lp)).sum(-1))
        same.append(lp.argmax(-1) == rp.argmax(-1))
    return float(np.concatenate(kls).mean()), float(np.concatenate(same).mean())


def peer_perplexity(gguf: Path, text_file: Path, ctx: int, chunks: int, threads: int) -> float:
    binary = llama_cpp.find_llama_binary("llama-perplexity")
    if binary is None:
        raise SystemExit("bench: llama-perplexity is not built; run `python -m bench.llama_cpp build`")
    cmd = [str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-b", str(ctx)]
    cmd += ["--chunks", str(chunks), "-t", str(threads)]
    out = subprocess.run(cmd, env=llama_cpp.llama_env(binary), capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if out.returncode != 0 or found is None:
        raise SystemExit(f"bench: llama-perplexity failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return float(found.group(1))


def table(rows: list[Row]) -> str:
    head = (
        f"{'model':<20} {'quant':<9} {'text':<5} {'ppl ours':>9} {'l.cpp':>8} {'gap':>7} "
        f"{'KL f32':>8} {'top1':>6} {'MB':>6} {'tg tok/s':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.model:<20} {r.quant:<9} {r.text:<5} {r.ppl_ours:9.3f} {r.ppl_peer:8.3f} {r.ppl_gap:+7.1%} "
            f"{r.kl_vs_f32:8.4f} {r.top1_vs_f32:6.1%} {r.bundle_mb:6.0f} {r.tg_tok_s:8.1f}"
        )
    return "\n".join(lines)


def frontier(rows: Sequence[Row]) -> list[tuple[Row, bool]]:
    """Each row with whether it is on the quality-per-byte Pareto frontier of its model and text:
    no other mode there reads at most as many weight bytes per token at no higher perplexity, and
    is strictly better in one. Groups keep their first-seen order; within one, smallest first."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.model, r.text), []).append(r)
    out = []
    for group in groups.values():
        for r in sorted(group, key=lambda r: (r.bundle_mb, r.ppl_ours)):
            # A NaN perplexity (a failed score) neither sits on the frontier nor pushes others off it.
            ok = not np.isnan(r.ppl_ours) and not any(
                o is not r
                and o.bundle_mb <= r.bundle_mb
                and o.ppl_ours <= r.ppl_ours
                and (o.bundle_mb < r.bundle_mb or o.ppl_ours < r.ppl_ours)
                for o in group
            )
            out.append((r, ok))
    return out


def frontier_table(rows: Sequence[Row]) -> str:
    head = f"{'model':<20} {'text':<5} {'quant':<9} {'MB/tok':>7} {'ppl ours':>9} frontier"
    lines = [head, "-" * len(head)]
    for r, ok in frontier(rows):
        mark = " *" if ok else ""
        lines.append(f"{r.model:<20} {r.text:<5} {r.quant:<9} {r.bundle_mb:7.0f} {r.ppl_ours:9.3f}{mark}")
    return "\n".join(lines)


def measure(
    name: str, quants: list[str], corpus: dict[str, str], ctx: int, chunks: int, threads: int
) -> list[Row]:
    from goinfer.compiler.sources import zoo
    from goinfer.runtime.model import Model

    gguf = zoo.fetch(name)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {label: Path(tmp) / f"{label}.txt" for label in corpus}
        for label, text in corpus.items():
            files[label].write_text(text)
        peer = {label: peer_perplexity(gguf, files[label], ctx, chunks, threads) for label in corpus}
        ref: dict[str, list] = {}
        for quant in ["f32", *(q for q in quants if q != "f32")]:  # f32 first: the KL reference
            bundle = _ensure_bundle(gguf, quant)
            model = Model.load(bundle)
            tg = _ours(bundle, 16, 64, threads)["tg_tok_s"]
            for label, text in corpus.items():
                lps = list(scored_logprobs(model, model.encode(text), ctx, chunks))
                if quant == "f32":
                    ref[label] = lps
                if quant not in quants:
                    continue
                kl, top1 = against(lps, ref[label])
                mb = _bundle_weight_mb(bundle)
                row = Row(name, quant, label, perplexity(lps), peer[label], kl, top1, mb, tg)
                _log(f"{name} {quant} {label}: ppl {row.ppl_ours:.3f}, llama.cpp {row.ppl_peer:.3f}")
                rows.append(row)
            del model
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--quants", default=",".join(QUANTS))
    ap.add_argument("--text", type=Path, action="append", help="a text file to score (repeatable)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    models = parse_list(args.models, MODELS, "model")
    quants = parse_list(args.quants, (*QUANTS, "int8"), "quant")
    corpus = {
        p.stem: p.read_bytes()[:TEXT_BYTES].decode("utf-8", "ignore") for p in args.text or []
    } or texts()
    llama_cpp.build()
    rows = [r for name in models for r in measure(name, quants, corpus, args.ctx, args.chunks, args.threads)]
    print(f"chunks of {args.ctx} tokens, {args.chunks} a text, second halves scored; KL, top-1: vs our f32")
    print(table(rows))
    print("\nquality per byte: weight MB a decoded token reads; * on the frontier (none smaller and better)")
    print(frontier_table(rows))
    if args.json:
        on = {(r.model, r.text, r.quant): ok for r, ok in frontier(rows)}
        dump = [{**asdict(r), "ppl_gap": r.ppl_gap, "frontier": on[r.model, r.text, r.quant]} for r in rows]
        args.json.write_text(json.dumps(dump, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
