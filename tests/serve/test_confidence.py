"""serve.confidence on hand-made decode steps: option mass along split tokens, integer minima,
forced fields left out, nesting paths."""

from __future__ import annotations

from goinfer.runtime.decode import StepChoice
from goinfer.serve.confidence import Step, field_confidence

SCHEMA = {
    "type": "object",
    "properties": {
        "c": {"enum": ["billing", "bugs", "shipping"]},
        "n": {"type": "integer"},
        "one": {"enum": ["x"]},
        "rows": {"type": "array", "items": {"$ref": "#/$defs/row"}},
    },
    "$defs": {
        "row": {"type": "object", "properties": {"ok": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}}
    },
}
VOCAB = ['{"', "c", '":', ' "', "b", "sh", "s", "illing", "ugs", '",', ' "n', " ", "4", "2", "5", ",",
         ' "one', "x", '"', ' "rows', ' [{"', "ok", "true", "false", "}]}"]  # fmt: skip
ID = {t: i for i, t in enumerate(VOCAB)}


def run(pieces: list[tuple[str, StepChoice | None]]):
    steps, pos, text = [], 0, ""
    for piece, choice in pieces:
        steps.append(Step(pos, pos + len(piece), ID[piece], choice))
        pos += len(piece)
        text += piece
    return field_confidence(SCHEMA, text, steps, VOCAB.__getitem__)


def forced(piece: str) -> tuple[str, StepChoice]:
    return piece, StepChoice(1, 1.0, ((ID[piece], 1.0),))


def pick(piece: str, options: dict[str, float]) -> tuple[str, StepChoice]:
    return piece, StepChoice(len(options), options[piece], tuple((ID[t], p) for t, p in options.items()))


def test_a_literal_split_across_tokens_is_not_diluted():
    recs = run([
        forced('{"'), forced("c"), forced('":'), forced(' "'),
        pick("b", {"b": 0.5, "sh": 0.3, "s": 0.2}),  # "b" could still be billing or bugs
        pick("illing", {"illing": 0.6, "ugs": 0.4}),
        forced('",'), forced(' "n'), forced('":'), forced(" "),
        pick("4", {"4": 0.9, "5": 0.1}), pick("2", {"2": 0.7, ",": 0.3}), forced(","),
        forced(' "one'), forced('":'), forced(' "'), forced("x"), forced('",'),
        forced(' "rows'), forced('":'), forced(' [{"'), forced("ok"), forced('":'), forced(" "),
        pick("false", {"true": 0.25, "false": 0.75}), forced("}]}"),
    ])  # fmt: skip
    by = {r["path"]: r for r in recs}
    assert list(by) == ["c", "n", "rows[0].ok"]  # "one" was forced: not reported
    c = by["c"]
    assert c["value"] == "billing" and c["confidence"] == 0.3
    assert c["distribution"] == {"billing": 0.3, "bugs": 0.2, "shipping": 0.5} and c["undecided"] == 0.0
    assert c["free_tokens"] == 2 and c["calibrated"] is False
    assert by["n"] == {"path": "n", "kind": "integer", "value": 42, "confidence": 0.7, "free_tokens": 2,
                       "calibrated": False}  # fmt: skip
    ok = by["rows[0].ok"]
    assert (
        ok["kind"] == "boolean"
        and ok["value"] is False
        and ok["distribution"] == {"true": 0.25, "false": 0.75}
    )


def test_a_reply_that_is_not_json_reports_nothing():
    assert run([forced('{"'), forced("c")]) == []
