"""The CUDA checks a lent GPU runs (through tests/gpu/run.sh, on the payload prepare.py built).

1. Every tiny bundle (three families x every quant mode) loads on the GPU, passing its self-test,
   and its logits over a prompt and 8 greedy decode steps meet the CPU's bars against the numpy
   reference (tests/numerics_bars.py): f32 cosine >= 0.9999, each int mode its bar against f32,
   gguf against its own file.
2. The synthetic bundle with Qwen2.5-0.5B's layer shapes: prefill and decode tokens a second, and
   the share of the H200's 4.8 TB/s a decode step's weight reads reach.

Writes one JSON (--json) and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from numerics_bars import F32_MIN_COSINE, GGUF_BAR, INT_BARS
from reference import reference_logits

PROMPT = "The quick brown fox jumps over the lazy dog, then sleeps."
DECODE_STEPS = 8
H200_BYTES_PER_S = 4.8e12


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _logits(model, ids: list[int], continuation: list[int]) -> np.ndarray:
    rows = list(model.prefill_logits(ids))
    rows += [model.decode_step(t)[None] for t in continuation]
    return np.concatenate(rows)


def tiny_checks(work: Path, cases: list[dict]) -> list[dict]:
    from goinfer.runtime.model import Model

    results, f32_logits, prompts = [], {}, {}
    for case in sorted(cases, key=lambda c: c["quant"] != "f32"):  # f32 first: the int modes' yardstick
        family, quant = case["family"], case["quant"]
        gguf = work / "gguf" / case["gguf"]
        row = {"family": family, "quant": quant}
        try:
            model = Model.load(work / "bundles" / case["bundle"], device="cuda")
            row["device"], row["selftest"] = model.device, model.self_test.to_json()
            if family not in prompts:
                ids = model.encode(PROMPT)[:14]
                seq = list(ids)
                for _ in range(DECODE_STEPS):
                    seq.append(int(np.argmax(reference_logits(gguf, seq)[-1])))
                prompts[family] = (ids, seq[len(ids) :])
            ids, cont = prompts[family]
            ours = _logits(model, ids, cont)
            ref = reference_logits(gguf, ids + cont)
            cos = _cos(ours, ref)
            row["min_cosine_vs_reference"] = float(cos.min())
            if quant == "f32":
                f32_logits[family] = ours
                row["ok"] = bool(cos.min() >= F32_MIN_COSINE and (ours.argmax(-1) == ref.argmax(-1)).all())
            elif quant == "gguf":
                agree = float((ours.argmax(-1) == ref.argmax(-1)).mean())
                row["top1_vs_reference"] = agree
                row["ok"] = bool(cos.min() >= GGUF_BAR[0] and agree >= GGUF_BAR[1])
            else:
                base = f32_logits[family]
                c, top1 = _cos(ours, base), float((ours.argmax(-1) == base.argmax(-1)).mean())
                row["min_cosine_vs_f32"], row["top1_vs_f32"] = float(c.min()), top1
                row["ok"] = bool(c.min() >= INT_BARS[quant][0] and top1 >= INT_BARS[quant][1])
            row["ok"] = row["ok"] and model.device == "cuda"
            model.bundle.close()
        except Exception as e:  # a check that cannot run is a failed check, reported with the rest
            row["ok"], row["error"] = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def synthetic_speed(path: Path, prefill_tokens: int = 1024, decode_tokens: int = 128) -> dict:
    from goinfer.runtime.model import Model

    model = Model.load(path, device="cuda")
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(3, model.spec.vocab_size, prefill_tokens)]
    model.chunk = model.prefill_chunk  # one forward per prefill chunk (2048), as the server can run it
    model.prefill(ids[:64])  # warm: first launches load the kernels
    prefill_s = _median_seconds(lambda: model.prefill(ids), 3)

    def decode_seconds() -> float:
        model.prefill(ids[:16])
        t0 = time.perf_counter()
        for t in ids[:decode_tokens]:
            model.decode_step(t)
        return time.perf_counter() - t0

    decode_s = float(np.median([decode_seconds() for _ in range(3)]))
    step = decode_s / decode_tokens
    weight_bytes = sum(model.bundle.tensor_info(n).nbytes for n in model.manifest.params)
    return {
        "bundle": path.name,
        "layers": model.spec.num_layers,
        "weight_bytes": weight_bytes,
        "prefill_tokens": prefill_tokens,
        "prefill_tok_s": prefill_tokens / prefill_s,
        "decode_tokens": decode_tokens,
        "decode_tok_s": 1 / step,
        "decode_step_ms": step * 1e3,
        "decode_weight_read_share_of_4.8TBps": weight_bytes / step / H200_BYTES_PER_S,
        "selftest": model.self_test.to_json(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    from goinfer.runtime import cuda

    cases = json.loads((args.work / "cases.json").read_text())
    report = {"probe": cuda.probe().to_json(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    report["tiny"] = tiny_checks(args.work, cases["tiny"])
    try:
        report["synthetic"] = synthetic_speed(args.work / "bundles" / cases["synthetic"])
    except Exception as e:
        report["synthetic"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    report["passed"] = all(r["ok"] for r in report["tiny"]) and "error" not in report["synthetic"]
    args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("passed", "synthetic")}, indent=2))
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
