"""The hostile-input corpus (tests/fixtures/hostile/*.json, read by tests/hostile.py) replayed
against the app on GrammarEngine (a real tokenizer, real llguidance and the real decode loop), over
real HTTP so that headers and bodies go out byte for byte; then the schema fuzz.

Every case gets its expected status, in the envelope of the API called, with no log record that
carries a traceback; a streaming request refused is refused before any SSE byte.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections import Counter
from typing import Any

import hostile
import pytest
from aiohttp.test_utils import TestServer
from fake_engine import FakeEncoder, GrammarEngine
from goinfer.serve import server
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig

pytestmark = pytest.mark.asyncio

CASES = hostile.load_corpus()
CONFIG = {"api_key": hostile.KEY, "allow_admin": True, "keepalive_s": 0.05, "poll_s": 0.01}
FUZZ_SEED, FUZZ_N = 20260101, 60


@functools.lru_cache(maxsize=1)
def engine() -> GrammarEngine:
    """One engine for every case (a fresh app each): it keeps no state a request could change."""
    return GrammarEngine("Hello!")


async def start(aiohttp_client) -> tuple[str, int]:
    """The app on a loopback port, with the server logger `goinfer serve` runs with."""
    # an encoder beside it for /v1/embeddings (the cases name no model: it is the only one)
    app = create_app({hostile.MODEL: engine()}, ServeConfig(**CONFIG), encoders={"e": FakeEncoder()})
    test_server = TestServer(app)
    await test_server.start_server(logger=server.http_log())
    client = await aiohttp_client(test_server)  # closes the server at the end of the test
    return client.server.host, client.server.port


def tracebacks(records: list[logging.LogRecord]) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in records if r.exc_info or r.levelno >= logging.ERROR]


async def replay(aiohttp_client, caplog, case: dict[str, Any], check=hostile.check) -> hostile.Reply:
    host, port = await start(aiohttp_client)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        reply = await asyncio.to_thread(hostile.send, host, port, case)
        check(case, reply)
    assert not tracebacks(caplog.records), (case["name"], tracebacks(caplog.records))
    return reply


async def test_the_corpus_covers_the_mutation_kinds():
    kinds = Counter(c["kind"] for c in CASES)
    assert len(kinds) >= 24, sorted(kinds)
    for kind in (
        "recursive_schema",
        "unsatisfiable_schema",
        "auth_bytes",
        "foreign_origin",
        "admin_foreign_origin",
    ):
        assert kinds[kind], kind
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"):
        assert sum(c["route"] == route for c in CASES) >= 20, route


@pytest.mark.parametrize("case", CASES, ids=[f"{c['file'][:-5]}: {c['name']}" for c in CASES])
async def test_hostile_case(aiohttp_client, caplog, case):
    await replay(aiohttp_client, caplog, case)


FUZZ = hostile.fuzz_cases(FUZZ_SEED, FUZZ_N, max_tokens=48)


@pytest.mark.parametrize("case", FUZZ, ids=[c["name"] for c in FUZZ])
async def test_schema_fuzz(aiohttp_client, caplog, case):
    """A random schema (response_format, strict or not, or a required tool's parameters) is a 200
    whose reply is JSON (or cut by max_tokens), or a 400; never a 500 or a traceback."""
    await replay(aiohttp_client, caplog, case, check=hostile.check_fuzz)


async def test_the_fuzz_draws_every_hostile_feature():
    """The seeded draw holds each thing the fuzz is for, in each of the three places a schema goes."""
    uses = Counter(c["name"].rsplit("(", 1)[1].rstrip(")") for c in FUZZ)
    assert set(uses) == {"strict", "lenient", "tool"}, uses
    text = "\n".join(json.dumps(c["body"]) for c in FUZZ)
    features = {
        "a $defs cycle": '"a": {"$ref": "#/$defs/b"}',
        "a dangling $ref": '"$ref": "#/$defs/nope"',
        "a self-reference": '"$ref": "#"',
        "minLength > maxLength": '"minLength": 5, "maxLength": 2',
        "minimum > maximum": '"minimum": 10, "maximum": 1',
        "minItems > maxItems": '"minItems": 3, "maxItems": 1',
        "a contradictory allOf": '"allOf": [{"type": "string"}, {"type": "integer"}]',
        "a pattern that is not a regex": '"pattern": "(["',
        "a 5000-value enum": '"v4999"',
        "nesting": '"items": {"type": "array"',
    }
    missing = [name for name, needle in features.items() if needle not in text]
    assert not missing, missing
