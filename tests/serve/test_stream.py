"""serve.deltas: stop strings across token boundaries, logprob alignment, exact usage."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from goinfer.runtime.decode import StepEvent
from goinfer.serve.events import StopMatcher, text_deltas


def _events(pieces: list[str], finish: str = "stop") -> Iterator[StepEvent]:
    for i, p in enumerate(pieces):
        yield StepEvent(i, p, -float(i), top_logprobs=((i, -float(i)),))
    yield StepEvent(None, "", None, finish)


def _fold(pieces: list[str], stop: list[str], **kw) -> tuple[list[str], str, int]:
    deltas = list(text_deltas(_events(pieces), 3, stop, token_text=lambda t: pieces[t], **kw))
    last = deltas[-1]
    assert last.usage is not None and last.usage.prompt_tokens == 3
    assert all(d.finish_reason is None for d in deltas[:-1])
    return [d.text for d in deltas], last.finish_reason or "", last.usage.completion_tokens


@pytest.mark.parametrize(
    ("pieces", "stop", "text", "tokens"),
    [
        (["a", "b", "c", "d"], ["bc"], "a", 3),
        (["ab", "cd", "ef"], ["cde"], "ab", 3),  # starts mid-token, ends mid-token
        (["x", "STO", "P", "y"], ["STOP", "xS"], "", 2),  # the earliest match in the text wins
        (["hé", "llo"], ["él"], "h", 2),
        (["a", "b"], ["abc"], "ab", 2),  # a prefix held to the end is released, finish from the source
        (["a", "b"], [], "ab", 2),
    ],
)
def test_stop_strings(pieces, stop, text, tokens) -> None:
    texts, finish, n = _fold(pieces, stop)
    assert "".join(texts) == text
    assert n == tokens
    assert finish == "stop"
    assert not any(s in t for t in texts for s in stop)


def test_text_that_could_start_a_stop_is_held_back() -> None:
    m = StopMatcher(["END"])
    assert m.push("abcE") == ("abc", False)
    assert m.push("N") == ("", False)
    assert m.push("x") == ("ENx", False)  # it was not the stop string after all
    assert m.push("EN") == ("", False)
    assert m.push("D tail") == ("", True)


def test_length_finish_and_exact_counts() -> None:
    deltas = list(text_deltas(_events(["a", "b"], finish="length"), 7))
    assert deltas[-1].finish_reason == "length"
    assert (deltas[-1].usage.prompt_tokens, deltas[-1].usage.completion_tokens) == (7, 2)
    assert deltas[-1].usage.total_tokens == 9


def test_logprobs_travel_with_their_text_and_stop_drops_the_rest() -> None:
    pieces = ["He", "llo", " EN", "D", "!"]
    deltas = list(text_deltas(_events(pieces), 1, ["END"], token_text=lambda t: pieces[t], logprobs=True))
    released = [(d.text, [e.token for e in d.logprobs]) for d in deltas]
    # " EN" may start the stop string: " " goes out, but the token's entry waits for the rest of its
    # text; at the stop it is kept (its text began before the stop string) and "D" is dropped.
    assert released == [("He", ["He"]), ("llo", ["llo"]), (" ", []), ("", [" EN"])]
    assert deltas[0].logprobs[0].top == (("He", 0.0),)


def test_an_incomplete_character_token_waits_for_its_text() -> None:
    # A byte-fallback token yields "" until the next token completes the character.
    events = [StepEvent(0, "", -1.0), StepEvent(1, "é", -2.0), StepEvent(None, "", None, "stop")]
    deltas = list(text_deltas(iter(events), 1, token_text=str, logprobs=True))
    assert [(d.text, len(d.logprobs)) for d in deltas] == [("", 1), ("é", 1), ("", 0)]


def test_a_stop_closes_the_source_generator() -> None:
    closed = []

    def source() -> Iterator[StepEvent]:
        try:
            for i in range(100):
                yield StepEvent(i, "x" if i != 3 else "STOP")
        finally:
            closed.append(True)

    out = list(text_deltas(source(), 1, ["STOP"]))
    assert "".join(d.text for d in out) == "xxx" and closed == [True]


def test_serve_reaches_the_runtime_only_through_its_public_surface() -> None:
    """The generation's values (runtime.decode: GenerationRequest in, StepEvents out), the prompt's
    refusal (runtime.prompt), defaults (runtime.config), sampling and grammar primitives, the
    scheduler's errors, the memory readings (runtime.fit: the swap guard) and the process's
    self-test results (runtime.selftest: /health), a thinking model's control, budget and split
    (runtime.thinking); the bundle's
    Model only in the engine adapter. The reply (stop strings, tool calls, confidence) is built in
    serve/."""
    import ast
    from pathlib import Path

    import goinfer.serve

    surface = {
        "goinfer.runtime.decode",
        "goinfer.runtime.prompt",
        "goinfer.runtime.config",
        "goinfer.runtime.sampler",
        "goinfer.runtime.grammar",
        "goinfer.runtime.scheduler",
        "goinfer.runtime.fit",
        "goinfer.runtime.selftest",
        "goinfer.runtime.thinking",
    }
    used: dict[str, set[str]] = {}
    for path in Path(goinfer.serve.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("goinfer.runtime"):
                names = {f"{node.module}.{a.name}" for a in node.names}
                module = node.module if node.module != "goinfer.runtime" else None
                used.setdefault(path.name, set()).update({module} if module else names)
    assert {m for f, ms in used.items() if f != "model_engine.py" for m in ms} <= surface, used
