"""Speculative decoding against plain decoding and llama-server's: `python -m bench.spec`.

    python -m bench.spec                                  # the 1.5B coder
    python -m bench.spec --models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b

Workloads, each one streamed chat request at temperature 0 (`--max-tokens`, 400):
  edit      a ~50-line Python module returned whole with one variable renamed
  copy      the same module returned verbatim
  refactor  the module returned with a docstring added to each function (new code among old)
  prose     a short essay: nothing to look up
  chat      the third turn of a chat about the module (earlier turns' replies as the model gave them)

Servers, one after another on the same `--threads` (2): ours plain, `--spec ngram`, `--drafter`
the 0.5B coder (built int4, serve's default for a drafter) and both together; llama-server plain,
`--spec-type ngram-simple`, `ngram-mod`, and `draft-simple -md` the 0.5B coder's GGUF (at its
defaults, and with `--spec-draft-p-min 0.5 --spec-draft-n-max 6`, ours' own settings). The 0.5B
drafts for itself too: there is no smaller model with its tokenizer.
Per workload: decode tok/s (completion tokens after the first over the time after the first
delta); then per speculative configuration of ours, over ours plain, over llama-server's best
speculative figure, and whether its text is ours plain's byte for byte (speculation must not
change a token). Ours logs drafted and accepted tokens and rounds ("speculation: N tokens drafted,
M accepted in R rounds"): the acceptance rate, and the mean accepted length M / R. Targets (the
1.5B): edit >= 2.0x our plain and >= 1.3x llama-server's best speculative; prose and chat >= 0.95x
plain.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from bench.run import _ensure_bundle, ratio
from bench.serve import _log
from bench.serving import Server, Stream, chat, goinfer_server, llama_server, warm

WORKLOADS = ("edit", "copy", "refactor", "prose", "chat")
RESULTS = Path(__file__).parent / "results" / "spec.json"
EDIT_TARGET, PEER_TARGET, PROSE_TARGET = 2.0, 1.3, 0.95
DRAFTER = "qwen2.5-coder-0.5b"  # the smallest model with the coders' tokenizer


def module_source() -> str:
    """A deterministic ~50-line Python module (not one the tests ship)."""
    funcs = []
    for i, (name, op) in enumerate((("scale", "*"), ("shift", "+"), ("trim", "-"), ("ratio", "/"))):
        funcs.append(
            f"def {name}_values(values, factor={i + 2}):\n"
            f'    """Apply {name} to each value and keep a running total."""\n'
            "    total = 0\n"
            "    result = []\n"
            "    for value in values:\n"
            f"        item = value {op} factor\n"
            "        total += item\n"
            "        result.append(item)\n"
            "    return result, total\n"
        )
    main = (
        "def summarize(values):\n"
        "    total = 0\n"
        "    for fn in (scale_values, shift_values, trim_values, ratio_values):\n"
        "        _, part = fn(values)\n"
        "        total += part\n"
        "    return total\n"
    )
    return "import math\n\n\n" + "\n\n".join([*funcs, main])


def messages(workload: str) -> list[dict[str, str]]:
    src = f"```python\n{module_source()}```"
    asks = {
        "edit": f"{src}\n\nRename the variable `total` to `running_sum` everywhere. Return the whole file.",
        "copy": f"{src}\n\nReturn this file exactly as it is, in one code block, with nothing else.",
        "refactor": f"{src}\n\nAdd a one-line docstring to `summarize` and type hints to every function. "
        "Return the whole file.",
        "prose": "Write a short essay on the history of stone bridges, in four paragraphs.",
    }
    if workload in asks:
        return [{"role": "user", "content": asks[workload]}]
    return [  # chat: a third turn, the earlier replies fixed here so both servers see the same prompt
        {"role": "user", "content": f"{src}\n\nWhat does `summarize` return?"},
        {"role": "assistant", "content": "The sum of the running totals of the four transforms."},
        {"role": "user", "content": "Which of the transforms can divide by zero?"},
        {"role": "assistant", "content": "`ratio_values`, when `factor` is 0."},
        {"role": "user", "content": "Explain how to guard against that, with a short example."},
    ]


def rate(s: Stream) -> float:
    tokens = s.tokens
    if s.first is None or s.last is None or tokens < 2 or s.last <= s.first:
        return float("nan")
    return (tokens - 1) / (s.last - s.first)


SPEC_LINE = re.compile(r"speculation: (\d+) tokens drafted, (\d+) accepted in (\d+) rounds")


def spec_lines(log: str) -> list[tuple[int, ...]]:
    """(drafted, accepted, rounds) of each generation our server logged under --spec."""
    return [tuple(map(int, m)) for m in SPEC_LINE.findall(Path(log).read_text(errors="replace"))]


def our_acceptance(log: str, before: int) -> tuple[int, ...]:
    """The line the request after `before` lines wrote: the server logs it as the generation
    ends, just after the reply's last chunk."""
    deadline = time.monotonic() + 10
    while len(lines := spec_lines(log)) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    return lines[before] if len(lines) > before else (0, 0, 0)


def run_server(server: Server, name: str, max_tokens: int, ours: bool) -> dict[str, dict[str, Any]]:
    warm(server, name)
    if ours and ("--spec" in server.command or "--drafter" in server.command):
        our_acceptance(server.log, 0)  # the warm-up's own line, so each request then finds its own
    out = {}
    for w in WORKLOADS:
        before = len(spec_lines(server.log)) if ours else 0
        s = chat(server.port, name, messages(w), max_tokens)
        row = {"tok_s": rate(s), "tokens": s.tokens, "text": s.message.get("content") or ""}
        if ours:
            row["drafted"], row["accepted"], row["rounds"] = our_acceptance(server.log, before)
        _log(f"{server.name} {w}: {row['tok_s']:.1f} tok/s, {s.tokens} tokens")
        out[w] = row
    return out


CONFIGS = (  # label, ours, extra arguments ("{draft}": the drafter's GGUF)
    ("ours plain", True, []),
    ("ours ngram", True, ["--spec", "ngram"]),
    ("ours drafter", True, ["--drafter", DRAFTER]),
    ("ours ngram+drafter", True, ["--spec", "ngram", "--drafter", DRAFTER]),
    ("llama-server", False, []),
    ("llama ngram-simple", False, ["--spec-type", "ngram-simple"]),
    ("llama ngram-mod", False, ["--spec-type", "ngram-mod"]),
    ("llama draft-simple", False, ["--spec-type", "draft-simple", "-md", "{draft}"]),
    (
        "llama draft p0.5 n6",
        False,
        [
            "--spec-type",
            "draft-simple",
            "-md",
            "{draft}",
            "--spec-draft-p-min",
            "0.5",
            "--spec-draft-n-max",
            "6",
        ],
    ),
)
OURS_SPEC = [label for label, ours, extra in CONFIGS if ours and extra]
PEERS_SPEC = [label for label, ours, extra in CONFIGS if not ours and extra]


def bench_model(a: argparse.Namespace, name: str) -> dict[str, Any]:
    from goinfer.compiler.sources import zoo

    gguf, draft = zoo.resolve(name), zoo.resolve(DRAFTER)
    bundle = _ensure_bundle(gguf, "gguf")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for label, ours, extra in CONFIGS:
        if label not in a.servers.split(","):
            continue
        extra = [str(draft) if x == "{draft}" else x for x in extra]
        if ours:
            with goinfer_server(name, bundle, a.threads, extra) as server:
                results[label] = run_server(server, name, a.max_tokens, True)
        else:
            with llama_server(gguf, a.threads, ["-c", "8192", "-np", "1", *extra]) as server:
                results[label] = run_server(server, name, a.max_tokens, False)
    return {"model": name, "threads": a.threads, "max_tokens": a.max_tokens, "results": results}


def table(res: dict[str, Any]) -> str:
    """Every server's tok/s per workload; then per workload and speculative configuration of ours,
    its ratio to ours plain and to llama-server's best speculative figure, acceptance, mean
    accepted length, and whether its text is ours plain's."""
    r = res["results"]
    ran = [label for label, _, _ in CONFIGS if label in r]
    head = f"{'workload':>9} " + " ".join(f"{label:>19}" for label in ran)
    lines = [head, "-" * len(head)]
    for w in WORKLOADS:
        lines.append(f"{w:>9} " + " ".join(f"{r[label][w]['tok_s']:>19.1f}" for label in ran))
    plain = r.get("ours plain")
    ours = [label for label in OURS_SPEC if label in r]
    if plain is None or not ours:
        return "\n".join(lines)
    head = f"\n{'workload':>9} {'ours':>19} {'tok/s':>7} {'/plain':>7} {'/l.best':>8} {'accepted':>10} "
    head += f"{'mean len':>8} {'same text':>9}"
    lines += [head, "-" * len(head)]
    for w in WORKLOADS:
        peers = [r[label][w]["tok_s"] for label in PEERS_SPEC if label in r]
        for label in ours:
            row = r[label][w]
            vs_plain = ratio(row["tok_s"], plain[w]["tok_s"])
            vs_peer = ratio(row["tok_s"], max(peers)) if peers else float("nan")
            acc = f"{row['accepted']}/{row['drafted']}"
            mean = row["accepted"] / row["rounds"] if row["rounds"] else 0.0
            same = "yes" if row["text"] == plain[w]["text"] else "NO"
            lines.append(
                f"{w:>9} {label:>19} {row['tok_s']:>7.1f} {vs_plain:>6.2f}x {vs_peer:>7.2f}x {acc:>10} "
                f"{mean:>8.2f} {same:>9}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--servers", default=",".join(c[0] for c in CONFIGS), help="a subset of the servers")
    ap.add_argument("--json", default=str(RESULTS))
    a = ap.parse_args(argv)
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    print(f"CPU: {cpu}; {a.threads} threads each; greedy; tok/s after the first token")
    report = {"cpu": cpu, "models": []}
    same = True
    for name in a.models.split(","):
        res = bench_model(a, name)
        report["models"].append(res)
        print(f"\n{name}:\n{table(res)}")
        r = res["results"]
        if "ours plain" in r:
            plain = r["ours plain"]
            same &= all(
                r[label][w]["text"] == plain[w]["text"]
                for label in OURS_SPEC
                if label in r
                for w in WORKLOADS
            )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
