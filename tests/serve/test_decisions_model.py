"""/v1/systemone on real bundles: a tiny one for `Scheduler.score`, calibration and the CLI
(fast); the 0.5B coder for the seed's example, end to end (slow)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from fake_engine import DECISIONS_EXAMPLE
from goinfer.cli.main import main
from goinfer.serve import decisions

SEED_EXAMPLE = {**DECISIONS_EXAMPLE, "model": "m"}


def _post_all(engine, bodies: list[dict]) -> list[dict]:
    from aiohttp.test_utils import TestClient, TestServer
    from goinfer.serve.app import create_app
    from goinfer.serve.config import ServeConfig

    async def go() -> list[dict]:
        out = []
        async with TestClient(TestServer(create_app({"m": engine}, ServeConfig()))) as client:
            for body in bodies:
                r = await client.post("/v1/systemone", json=body)
                assert r.status == 200, await r.text()
                out.append(await r.json())
        return out

    return asyncio.run(go())


def test_the_fitted_temperature_is_the_one_the_labels_were_drawn_at() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(3000):
        z = rng.normal(0, 2, 4)
        p = np.exp(z / 2.5 - (z / 2.5).max())
        rows.append((z, int(rng.choice(4, p=p / p.sum()))))
    assert abs(decisions.fit_temperature(rows) - 2.5) < 0.25


def test_score_reads_the_prompts_logits_and_questions_share_the_state(tiny_bundle) -> None:
    from goinfer.runtime.model import Model
    from goinfer.serve.model_engine import ModelEngine

    path = tiny_bundle("qwen2", context=2048)
    engine = ModelEngine.load(path, self_test=False)
    # what the route should read: the model's own logits at the prompt's end, over the letters
    q = decisions.questions_of(decisions.DecisionsRequest.model_validate(SEED_EXAMPLE))[0]
    ids = decisions.prompt_ids(engine, "chat-v1", SEED_EXAMPLE["state"], q)
    letters = engine.label_ids(decisions.labels("chat-v1", 3))
    want = decisions.probabilities(Model.load(path, self_test=False).prefill(ids), letters)
    together, *alone = _post_all(  # the app closes the engine when it stops
        engine,
        [SEED_EXAMPLE]
        + [{**SEED_EXAMPLE, "questions": {k: v}} for k, v in SEED_EXAMPLE["questions"].items()],
    )
    assert together["goinfer"]["cached_tokens"] > 0  # the second question reused the state
    for one in alone:  # exact reuse: the same numbers as each question asked on its own
        ((name, ans),) = one["answers"].items()
        assert together["answers"][name] == ans
    probs = together["answers"]["department"]["probabilities"]
    assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-3)
    assert list(probs.values()) == [round(float(x), 4) for x in want]


def test_decisions_calibrate_writes_temperatures_serve_takes(tiny_bundle, tmp_path: Path) -> None:
    path = tiny_bundle("qwen2", context=2048)
    labelled = tmp_path / "labelled.jsonl"
    item = {**SEED_EXAMPLE, "answers": {"department": "billing", "is_urgent": True}}
    other = {
        **SEED_EXAMPLE,
        "state": "Can I get a discount?",
        "answers": {"department": "sales", "is_urgent": False},
    }
    labelled.write_text("\n".join(json.dumps(x) for x in (item, other)) + "\n")
    out = tmp_path / "calibration.json"
    result = CliRunner().invoke(
        main, ["decisions-calibrate", str(path), str(labelled), "-o", str(out), "--no-selftest"]
    )
    assert result.exit_code == 0, (result.output, result.exception)
    fitted = json.loads(out.read_text())
    assert fitted["template"] == "chat-v1" and set(fitted["temperatures"]) == {"choice", "noul"}
    assert fitted["fitted_on"] == {"choice": 2, "noul": 2}
    assert decisions.load_calibration(str(out), "chat-v1") == fitted["temperatures"]
    # a wrong answer name is refused with its line, in one line
    labelled.write_text(json.dumps({**SEED_EXAMPLE, "answers": {"department": "legal"}}) + "\n")
    bad = CliRunner().invoke(
        main, ["decisions-calibrate", str(path), str(labelled), "-o", str(out), "--no-selftest"]
    )
    assert bad.exit_code == 2
    (line,) = bad.stderr.strip().splitlines()
    assert "line 1" in line and "'legal' is not one of its options" in line


def test_serve_refuses_a_bad_calibration_before_loading_anything(tmp_path: Path) -> None:
    bad = tmp_path / "c.json"
    bad.write_text('{"temperatures": {"noul": 0}}')
    result = CliRunner().invoke(main, ["serve", "no-such-model.giw", "--decisions-calibration", str(bad)])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "--decisions-calibration" in line and "positive" in line


@pytest.mark.slow
def test_the_seed_example_on_the_real_model(real_bundle) -> None:
    """The seed's example on Qwen2.5-Coder-0.5B: failing payouts go to billing, and are urgent."""
    from goinfer.serve.model_engine import ModelEngine

    engine = ModelEngine.load(real_bundle("qwen2.5-coder-0.5b"))
    together, *alone = _post_all(  # the app closes the engine when it stops
        engine,
        [SEED_EXAMPLE]
        + [{**SEED_EXAMPLE, "questions": {k: v}} for k, v in SEED_EXAMPLE["questions"].items()],
    )
    answers = together["answers"]
    assert answers["department"]["choice"] == "billing", answers
    assert answers["is_urgent"]["noul"] > 0.5, answers
    assert math.isclose(sum(answers["department"]["probabilities"].values()), 1.0, abs_tol=1e-3)
    assert together["usage"]["output_tokens"] == 0 and together["goinfer"]["cached_tokens"] > 0
    for one in alone:  # the shared-prefix path gives each question's own answer
        ((name, ans),) = one["answers"].items()
        assert answers[name] == ans
