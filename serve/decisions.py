"""POST /v1/systemone: decisions by label scoring on the served model (TypeSafe's wire shape).

A request is a `state` and named `questions`, each with a closed answer set:

    noul    P(true); its optional criteria {"true": ..., "false": ...} are shown to the model
    choice  2-16 options (the criteria's keys, in the order sent, each with its description)
    score   2-10 levels (one per criteria entry, lowest first): the expected level

Each question becomes one prompt: the state first, then the question and its options lettered
A, B, C ... (noul: A true, B false). One prefill, no decode: the model's logits for the letters
at the last position, softmaxed over the letters alone (divided first by the kind's fitted
temperature, with --decisions-calibration). Every question's prompt starts with the state, so the
engine's prefix reuse prefills it once for all of a request's questions (runtime/scheduler.py).

confidence (choice, score) is the top probability's margin over uniform, (n*p - 1)/(n - 1): 0
when the model cannot tell the options apart, 1 when it is certain. usage.output_tokens is 0.
A question that breaks a rule is a 422 before anything runs.

Templates: chat-v1 (the model's chat template: for instruct models) and bare-v1 (plain text ending
in "Answer:"). What the probabilities are: the served model's own over the options it was shown,
not a trained decision head's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from aiohttp import web
from goinfer.runtime.prompt import PromptTooLong
from pydantic import Field

from .engine import Engine
from .errors import APIError, bad_request
from .keys import CALIBRATION, CONFIG, REGISTRY
from .middleware import Body, body_cap_for, parse, read_body, text_body

KINDS = ("noul", "choice", "score")
LETTERS = "ABCDEFGHIJKLMNOP"
MAX_OPTIONS = {"choice": 16, "score": 10, "noul": 2}
MAX_QUESTIONS = 64
SYSTEM = "You answer questions about a state. Reply with the letter of one option and nothing else."


# -- the request -----------------------------------------------------------------------------------
class Question(Body):
    type: Literal["noul", "choice", "score"]
    instructions: str = ""
    criteria: dict[str, str | None] | None = None


class DecisionsRequest(Body):
    model: str | None = None
    state: str
    questions: dict[str, Question] = Field(min_length=1)


def unprocessable(message: str, param: str) -> APIError:
    return APIError(422, message, param=param, code="invalid_question")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise unprocessable(f"duplicate name {key!r}: each question and option is named once", key)
        seen.add(key)
    return dict(pairs)


@dataclass(frozen=True)
class Asked:
    """One question as the model is shown it."""

    name: str
    kind: str
    instructions: str
    options: tuple[tuple[str, str | None], ...]  # (name, description), in order


def questions_of(req: DecisionsRequest) -> list[Asked]:
    """The request's questions, each held to its kind's rules (a 422 naming the first broken)."""
    if not req.state.strip():
        raise unprocessable("state is empty", "state")
    if len(req.questions) > MAX_QUESTIONS:
        raise unprocessable(f"{len(req.questions)} questions; at most {MAX_QUESTIONS} a request", "questions")
    out = []
    for name, q in req.questions.items():
        where = f"questions.{name}"
        if not name.strip():
            raise unprocessable("a question's name is empty", "questions")
        crit = q.criteria
        if q.type == "noul":
            if crit is not None and (not crit or set(crit) - {"true", "false"}):
                raise unprocessable(f"{where}.criteria: a noul's criteria are 'true' and/or 'false'", where)
            options = (("true", (crit or {}).get("true")), ("false", (crit or {}).get("false")))
        else:
            if not crit:
                raise unprocessable(f"{where}.criteria: a {q.type} needs its options as criteria", where)
            most = MAX_OPTIONS[q.type]
            if not 2 <= len(crit) <= most:
                raise unprocessable(
                    f"{where}.criteria: {len(crit)} options; a {q.type} takes 2 to {most}", where
                )
            if any(not k.strip() for k in crit):
                raise unprocessable(f"{where}.criteria: an option's name is empty", where)
            options = tuple(crit.items())
        out.append(Asked(name, q.type, q.instructions, options))
    return out


# -- prompts -----------------------------------------------------------------------------------------
def question_text(q: Asked) -> str:
    heading = {"choice": "Options:", "score": "Levels, lowest first:", "noul": "Options:"}[q.kind]
    lines = [f"Question: {q.instructions or 'Which option applies?'}", heading]
    for letter, (name, desc) in zip(LETTERS, q.options, strict=False):
        lines.append(f"{letter}. {name}" + (f": {desc}" if desc else ""))
    lines.append("Answer with the letter of one option.")
    return "\n".join(lines)


def prompt_ids(engine: Engine, template: str, state: str, q: Asked) -> list[int]:
    """The question's prompt, the state first (so a request's questions share it)."""
    if template == "chat-v1":
        user = f"State:\n{state}\n\n{question_text(q)}"
        return engine.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
    return engine.text_ids(f"State:\n{state}\n\n{question_text(q)}\nAnswer:")


def labels(template: str, n: int) -> list[str]:
    """The letters as the model writes them first: alone after a chat turn's header, after a space
    following bare-v1's "Answer:"."""
    return [(" " if template == "bare-v1" else "") + letter for letter in LETTERS[:n]]


# -- answers -----------------------------------------------------------------------------------------
def probabilities(logits: np.ndarray, ids: list[int], temperature: float = 1.0) -> np.ndarray:
    z = np.asarray(logits, np.float64)[ids] / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def confidence(p: np.ndarray) -> float:
    n = len(p)
    return float((n * p.max() - 1) / (n - 1))


def answer(q: Asked, p: np.ndarray) -> dict[str, Any]:
    r4 = lambda x: round(float(x), 4)  # noqa: E731 - as the reference rounds them
    if q.kind == "noul":
        return {"type": "noul", "noul": r4(p[0])}
    names = [name for name, _ in q.options]
    if q.kind == "choice":
        return {
            "type": "choice",
            "choice": names[int(np.argmax(p))],  # the first listed wins a tie
            "confidence": r4(confidence(p)),
            "probabilities": {name: r4(x) for name, x in zip(names, p, strict=True)},
        }
    levels = np.arange(1, len(p) + 1)
    return {
        "type": "score",
        "score": r4((levels * p).sum()),
        "confidence": r4(confidence(p)),
        "legend": {str(level): name for level, name in zip(levels, names, strict=True)},
        "probabilities": {str(level): r4(x) for level, x in zip(levels, p, strict=True)},
    }


@dataclass(frozen=True)
class Scored:
    """One question's answer, from the model's worker thread."""

    name: str
    answer: dict[str, Any]
    prompt_tokens: int
    cached_tokens: int


def score_all(
    engine: Engine, prompts: list[list[int]], asked: list[Asked], template: str, temps: dict[str, float]
):
    """(on the worker) One prefill a question, in order: the state they share is fed once."""

    def run(cancel: threading.Event) -> Iterator[Scored]:
        for ids, q in zip(prompts, asked, strict=True):
            logits, cached = engine.score(ids, cancel)
            label_ids = engine.label_ids(labels(template, len(q.options)))
            p = probabilities(logits, label_ids, temps.get(q.kind, 1.0))
            yield Scored(q.name, answer(q, p), len(ids), cached)

    return run


# -- calibration -------------------------------------------------------------------------------------
def load_calibration(path: str | None, template: str) -> dict[str, float]:
    """Per-kind temperatures from `goinfer decisions-calibrate`'s file; a reason not to is one line."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--decisions-calibration {path}: {e}") from None
    temps = data.get("temperatures") if isinstance(data, dict) else None
    if not isinstance(temps, dict) or set(temps) - set(KINDS):
        raise ValueError(
            f"--decisions-calibration {path}: expected {{'temperatures': {{kind: T}}}} "
            f"for kinds among {', '.join(KINDS)}"
        )
    if not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in temps.values()):
        raise ValueError(f"--decisions-calibration {path}: every temperature must be a positive number")
    if data.get("template", template) != template:
        raise ValueError(
            f"--decisions-calibration {path}: fitted under template {data['template']}, serving {template}"
        )
    return {k: float(t) for k, t in temps.items()}


def fit_temperature(rows: list[tuple[np.ndarray, int]]) -> float:
    """The temperature T minimizing the mean negative log-likelihood of the right option under
    softmax(logits / T), over (option logits, right index) rows: golden-section search on log T
    in [1/20, 20] (the NLL is unimodal in log T for a fixed set of rows)."""

    def nll(log_t: float) -> float:
        t = math.exp(log_t)
        total = 0.0
        for z, right in rows:
            s = np.asarray(z, np.float64) / t
            total += float(np.log(np.exp(s - s.max()).sum()) + s.max() - s[right])
        return total / len(rows)

    lo, hi, phi = math.log(1 / 20), math.log(20), (math.sqrt(5) - 1) / 2
    a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
    fa, fb = nll(a), nll(b)
    for _ in range(60):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - phi * (hi - lo)
            fa = nll(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + phi * (hi - lo)
            fb = nll(b)
    return math.exp((lo + hi) / 2)


def right_option(q: Asked, label: Any) -> int:
    """The index of a labelled answer among the question's options (noul: true/false)."""
    if q.kind == "noul":
        if not isinstance(label, bool):
            raise ValueError(f"question {q.name!r}: a noul's answer is true or false, not {label!r}")
        return 0 if label else 1
    names = [name for name, _ in q.options]
    if str(label) not in names:
        raise ValueError(f"question {q.name!r}: {label!r} is not one of its options ({', '.join(names)})")
    return names.index(str(label))


def calibrate(engine: Engine, lines: list[str], template: str) -> dict[str, Any]:
    """`goinfer decisions-calibrate`: per-kind temperatures fitted on labelled requests, one JSON
    object a line: a request's state and questions, and "answers" {name: the right option}."""
    rows: dict[str, list[tuple[np.ndarray, int]]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            req = DecisionsRequest.model_validate({k: v for k, v in item.items() if k != "answers"})
            asked = questions_of(req)
            answers = item.get("answers") or {}
            for q in asked:
                if q.name not in answers:
                    continue
                right = right_option(q, answers[q.name])
                logits, _ = engine.score(prompt_ids(engine, template, req.state, q))
                ids = engine.label_ids(labels(template, len(q.options)))
                rows.setdefault(q.kind, []).append((np.asarray(logits, np.float64)[ids], right))
        except (ValueError, APIError) as e:
            why = e.message if isinstance(e, APIError) else str(e).splitlines()[0]
            raise ValueError(f"line {n}: {why}") from None
    if not rows:
        raise ValueError('no labelled answers to fit: each line needs "answers" {question: option}')
    temps = {kind: fit_temperature(r) for kind, r in sorted(rows.items())}
    return {
        "template": template,
        "temperatures": {k: round(t, 4) for k, t in temps.items()},
        "fitted_on": {k: len(r) for k, r in rows.items()},
    }


# -- the route ---------------------------------------------------------------------------------------
routes = web.RouteTableDef()


@routes.post("/v1/systemone")
@text_body
async def systemone(request: web.Request) -> web.Response:
    raw = await read_body(request, body_cap_for(request))
    # duplicate names are a rule, not a syntax error (JSON keeps the last silently); a body that is
    # not JSON is left to parse(), which says so in the usual words
    with contextlib.suppress(ValueError, RecursionError):
        json.loads(raw, object_pairs_hook=_no_duplicates)
    req: DecisionsRequest = parse(DecisionsRequest, raw)
    asked = questions_of(req)
    slot = request.config_dict[REGISTRY].route(req.model)
    engine = slot.engine
    if not engine.info.decisions:
        raise bad_request(f"model {slot.name!r} does not answer decisions", param="model")
    config = request.config_dict[CONFIG]
    template, temps = config.decisions_template, request.config_dict[CALIBRATION]
    loop = asyncio.get_running_loop()
    try:
        prompts = [
            await loop.run_in_executor(None, prompt_ids, engine, template, req.state, q) for q in asked
        ]
    except PromptTooLong as e:
        raise bad_request(str(e), param="state", code="context_length_exceeded") from None
    window = engine.info.context_window
    for q, ids in zip(asked, prompts, strict=True):
        if len(ids) >= window:
            raise bad_request(
                f"question {q.name!r}: its prompt has {len(ids)} tokens; the context window is {window}",
                param="state",
                code="context_length_exceeded",
            )
    run = slot.submit(score_all(engine, prompts, asked, template, temps), config.poll_s, config.retry_after_s)
    scored = [s async for s in run.ticks() if s is not None]
    return web.json_response(
        {
            "model": slot.name,
            "answers": {s.name: s.answer for s in scored},
            "usage": {"input_tokens": sum(s.prompt_tokens for s in scored), "output_tokens": 0},
            "goinfer": {
                "route": "label",
                "template": template,
                "calibrated": {kind: kind in temps for kind in sorted({q.kind for q in asked})},
                "cached_tokens": sum(s.cached_tokens for s in scored),
            },
        }
    )
