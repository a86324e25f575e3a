"""The cost of grammar-constrained decoding: `python -m bench.constrained`.

Decodes on the same model with and without a JSON-schema mask, alternately (A/B/A/B), and reports
the decode time per token of each and the overhead. The constrained reply is a list of free
strings with an enum and an integer (a mask at every step, over the whole vocabulary); the
unconstrained one is prose. Both are greedy, and per-token time excludes the prefill. The grammar's
own time per token (mask + advance, measured inside the loop) is reported too: it is the part of
the overhead that does not move with the machine's noise.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.run import MODELS, _ensure_bundle, median, parse_list

PROMPT = "List eight ideas for a weekend project, each as a short phrase."
SCHEMA = {
    "type": "object",
    "properties": {
        "ideas": {
            "type": "array",
            "items": {"type": "string", "maxLength": 60},
            "minItems": 8,
            "maxItems": 8,
        },
        "difficulty": {"enum": ["easy", "medium", "hard"]},
        "hours": {"type": "integer", "minimum": 1, "maximum": 48},
    },
    "required": ["ideas", "difficulty", "hours"],
}


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


class _Timed:
    """A constraint that adds up the time its mask and advance take (the grammar's own cost)."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def allowed(self):
        t = time.perf_counter()
        try:
            return self.inner.allowed()
        finally:
            self.seconds += time.perf_counter() - t

    def advance(self, token_id: int) -> None:
        t = time.perf_counter()
        self.inner.advance(token_id)
        self.seconds += time.perf_counter() - t

    @property
    def finished(self) -> bool:
        return self.inner.finished


def _ms_per_token(model, ids: list[int], max_tokens: int, constraint) -> tuple[float, int]:
    from goinfer.runtime.decode import GenerationRequest
    from goinfer.runtime.sampler import SamplingParams

    events = list(
        model.generate(
            GenerationRequest(ids, SamplingParams(temperature=0, max_tokens=max_tokens), None, constraint)
        )
    )
    t = events[-1].timings
    n = t["completion_tokens"]
    return (t["decode_s"] / max(n - 1, 1)) * 1e3, n


def run(name: str, rounds: int, max_tokens: int) -> dict[str, float]:
    from goinfer.compiler.sources import zoo
    from goinfer.runtime.grammar import GrammarConstraint, compile_json_schema
    from goinfer.runtime.model import Model

    model = Model.load(_ensure_bundle(zoo.resolve(name), "gguf"))
    ids = model.chat_prompt([{"role": "user", "content": PROMPT}])
    grammar = compile_json_schema(SCHEMA)
    tok = model.grammar.start()
    tok.get()  # built once per model (the server does it at load); not part of a request
    free, masked, grammar_ms, n_free, n_masked = [], [], [], 0, 0
    for r in range(rounds):
        ms, n_free = _ms_per_token(model, ids, max_tokens, None)
        free.append(ms)
        timed = _Timed(GrammarConstraint(tok.matcher(grammar), tok.vocab_size))
        ms, n_masked = _ms_per_token(model, ids, max_tokens, timed)
        masked.append(ms)
        grammar_ms.append(timed.seconds * 1e3 / n_masked)
        _log(f"{name} round {r + 1}: free {free[-1]:.2f} ms/tok, json {masked[-1]:.2f} ms/tok")
    a, b, gm = median(free), median(masked), median(grammar_ms)
    return {
        "free_ms": a,
        "json_ms": b,
        "grammar_ms": gm,
        "overhead": b / a - 1,
        "grammar_share": gm / a,
        "tokens_free": n_free,
        "tokens_json": n_masked,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.constrained", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=MODELS[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    a = ap.parse_args(argv)
    print(f"{'model':20} {'free ms/tok':>12} {'json ms/tok':>12} {'overhead':>9} {'grammar ms/tok':>15} "
          f"{'of a step':>10} {'tokens':>8}")  # fmt: skip
    for name in parse_list(a.models, MODELS, "model"):
        r = run(name, a.rounds, a.max_tokens)
        toks = f"{r['tokens_free']}/{r['tokens_json']}"
        print(f"{name:20} {r['free_ms']:12.2f} {r['json_ms']:12.2f} {r['overhead']:8.1%} "
              f"{r['grammar_ms']:15.3f} {r['grammar_share']:9.1%} {toks:>8}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
