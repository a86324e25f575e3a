"""POST /v1/systemone on a fake scoring engine: the wire shape, the arithmetic (probabilities over
the option letters, confidence as the margin over uniform, the expected level), calibration, the
shared state first in every question's prompt, and every refusal (422 before any prefill)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_engine import DECISIONS_EXAMPLE, ScoringEngine, ScriptedEngine
from goinfer.serve import decisions
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig

pytestmark = pytest.mark.asyncio

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
SEED_EXAMPLE = DECISIONS_EXAMPLE


async def client(aiohttp_client, engine=None, **config: Any):
    engine = engine or ScoringEngine({"Which team": "A", "Is this urgent": "A"})
    return await aiohttp_client(create_app({"local": engine}, ServeConfig(**{**FAST, **config})))


def softmax(x: list[float]) -> np.ndarray:
    z = np.exp(np.asarray(x) - max(x))
    return z / z.sum()


async def test_the_seed_example_answers_in_its_shape(aiohttp_client) -> None:
    engine = ScoringEngine({"Which team": "A", "Is this urgent": "A"}, margin=2.0)
    c = await client(aiohttp_client, engine)
    resp = await c.post("/v1/systemone", json=SEED_EXAMPLE)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert set(body) == {"model", "answers", "usage", "goinfer"} and body["model"] == "local"
    dept, urgent = body["answers"]["department"], body["answers"]["is_urgent"]
    want = softmax([2.0, 0.0, 0.0])
    assert dept["type"] == "choice" and dept["choice"] == "billing"
    assert list(dept["probabilities"]) == ["billing", "technical", "sales"]  # the order sent
    assert dept["probabilities"]["billing"] == round(float(want[0]), 4)
    assert math.isclose(sum(dept["probabilities"].values()), 1.0, abs_tol=1e-3)
    assert dept["confidence"] == round(float((3 * want[0] - 1) / 2), 4)
    assert urgent == {"type": "noul", "noul": round(float(softmax([2.0, 0.0])[0]), 4)}
    assert body["usage"]["output_tokens"] == 0
    assert body["usage"]["input_tokens"] == sum(len(p) for p in engine.scored)
    assert body["goinfer"]["route"] == "label" and body["goinfer"]["template"] == "chat-v1"
    assert body["goinfer"]["calibrated"] == {"choice": False, "noul": False}


async def test_every_question_starts_with_the_state_so_they_share_it(aiohttp_client) -> None:
    engine = ScoringEngine()
    c = await client(aiohttp_client, engine)
    body = await (await c.post("/v1/systemone", json=SEED_EXAMPLE)).json()
    first, second = ("".join(map(chr, p)) for p in engine.scored)
    state_at = first.index(SEED_EXAMPLE["state"])
    shared = len(first[: state_at + len(SEED_EXAMPLE["state"])])
    assert first[:shared] == second[:shared]
    assert body["goinfer"]["cached_tokens"] >= shared  # the second question reused the state


async def test_a_score_is_the_expected_level_with_its_legend(aiohttp_client) -> None:
    engine = ScoringEngine({"How bad": "C"}, margin=1.5)
    c = await client(aiohttp_client, engine)
    q = {
        "type": "score",
        "instructions": "How bad is it?",
        "criteria": {"low": None, "mid": "so-so", "high": "bad"},
    }
    body = await (await c.post("/v1/systemone", json={"state": "x", "questions": {"sev": q}})).json()
    ans = body["answers"]["sev"]
    p = softmax([0.0, 0.0, 1.5])
    assert ans["legend"] == {"1": "low", "2": "mid", "3": "high"}
    assert ans["probabilities"] == {str(i + 1): round(float(x), 4) for i, x in enumerate(p)}
    assert ans["score"] == round(float((np.arange(1, 4) * p).sum()), 4)
    assert ans["confidence"] == round(float((3 * p.max() - 1) / 2), 4)


async def test_a_tie_goes_to_the_first_option_listed(aiohttp_client) -> None:
    c = await client(aiohttp_client, ScoringEngine())
    q = {"type": "choice", "criteria": {"b": None, "a": None}}
    body = await (await c.post("/v1/systemone", json={"state": "x", "questions": {"q": q}})).json()
    assert body["answers"]["q"]["choice"] == "b" and body["answers"]["q"]["confidence"] == 0.0


async def test_calibration_divides_a_kinds_logits_by_its_temperature(aiohttp_client, tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"template": "chat-v1", "temperatures": {"noul": 2.0}}))
    engine = ScoringEngine({"Is this urgent": "A"}, margin=2.0)
    c = await client(aiohttp_client, engine, decisions_calibration=str(path))
    body = await (await c.post("/v1/systemone", json=SEED_EXAMPLE)).json()
    assert body["answers"]["is_urgent"]["noul"] == round(float(softmax([1.0, 0.0])[0]), 4)
    assert body["goinfer"]["calibrated"] == {"choice": False, "noul": True}


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("not json", "decisions-calibration"),
        ('{"temperatures": {"noul": -1}}', "positive"),
        ('{"temperatures": {"vibes": 1}}', "kinds"),
        ('{"template": "bare-v1", "temperatures": {"noul": 1}}', "bare-v1"),
    ],
)
async def test_a_bad_calibration_file_is_refused_in_one_line(tmp_path: Path, content: str, why: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=why) as e:
        decisions.load_calibration(str(path), "chat-v1")
    assert "\n" not in str(e.value)


async def test_bare_v1_asks_in_plain_text(aiohttp_client) -> None:
    engine = ScoringEngine({"Is this urgent": "A"})
    c = await client(aiohttp_client, engine, decisions_template="bare-v1")
    body = await (await c.post("/v1/systemone", json=SEED_EXAMPLE)).json()
    text = "".join(map(chr, engine.scored[0]))
    assert "<system>" not in text and text.endswith("Answer:")
    assert body["goinfer"]["template"] == "bare-v1" and body["answers"]["is_urgent"]["noul"] > 0.5


def _with(question: dict[str, Any]) -> dict[str, Any]:
    return {"state": "s", "questions": {"q": question}}


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (_with({"type": "choice", "criteria": {f"o{i}": None for i in range(17)}}), 422, "17 options"),
        (_with({"type": "choice", "criteria": {"only": None}}), 422, "1 options"),
        (_with({"type": "score", "criteria": {f"l{i}": None for i in range(11)}}), 422, "2 to 10"),
        (_with({"type": "choice", "criteria": {}}), 422, "needs its options"),
        (_with({"type": "choice"}), 422, "needs its options"),
        (_with({"type": "noul", "criteria": {"maybe": "?"}}), 422, "'true' and/or 'false'"),
        (_with({"type": "choice", "criteria": {" ": None, "b": None}}), 422, "name is empty"),
        ({"state": "  ", "questions": {"q": {"type": "noul"}}}, 422, "state is empty"),
        ({"state": "s", "questions": {}}, 400, "questions"),
        (_with({"type": "ranking", "criteria": {"a": None}}), 400, "type"),
        ({"state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}}, 422, "at most 64"),
    ],
)
async def test_a_question_that_breaks_a_rule_is_refused_before_any_prefill(
    aiohttp_client, body: dict[str, Any], status: int, needle: str
) -> None:
    engine = ScoringEngine()
    c = await client(aiohttp_client, engine)
    resp = await c.post("/v1/systemone", json=body)
    assert resp.status == status, await resp.text()
    err = (await resp.json())["error"]
    assert needle in err["message"], err
    assert engine.scored == []


async def test_a_duplicate_name_is_a_422(aiohttp_client) -> None:
    engine = ScoringEngine()
    c = await client(aiohttp_client, engine)
    raw = '{"state": "s", "questions": {"q": {"type": "noul"}, "q": {"type": "noul"}}}'
    resp = await c.post("/v1/systemone", data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 422 and "duplicate name 'q'" in (await resp.json())["error"]["message"]
    raw = '{"state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": null, "a": "x"}}}}'
    resp = await c.post("/v1/systemone", data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 422 and engine.scored == []


async def test_an_unknown_model_is_refused_with_the_served_names(aiohttp_client) -> None:
    c = await client(aiohttp_client)
    resp = await c.post("/v1/systemone", json={**SEED_EXAMPLE, "model": "jev-latest"})
    assert resp.status == 404
    assert "served: local" in (await resp.json())["error"]["message"]


async def test_models_say_which_answer_decisions(aiohttp_client) -> None:
    engines = {"scorer": ScoringEngine(), "plain": ScriptedEngine()}
    c = await aiohttp_client(create_app(engines, ServeConfig(**FAST)))
    data = {m["id"]: m for m in (await (await c.get("/v1/models")).json())["data"]}
    assert data["scorer"]["decisions"] is True and data["plain"]["decisions"] is False
    resp = await c.post("/v1/systemone", json={**SEED_EXAMPLE, "model": "plain"})
    assert resp.status == 400 and "does not answer decisions" in (await resp.json())["error"]["message"]
