"""The kserve SDK (its own venv: tests/kserve_sdk.py) against the fake engine: InferenceGRPCClient and
InferenceRESTClient do health, model readiness and LLM-tensor infers in each of the SDK's encodings,
model metadata passes through kserve's generated stub and its REST v2 pydantic models, and errors
arrive as the SDK raises them. The SDK's calls run in a subprocess while the test's loop serves."""

from __future__ import annotations

import asyncio
from typing import Any

import kserve_sdk
import pytest
import pytest_asyncio
from fake_engine import PIECES, ScriptedEngine
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from goinfer.serve.kserve import grpc_server

pytestmark = pytest.mark.asyncio
KEY = "sekrit"
REPLY3 = "".join(PIECES[:3])  # max_tokens 3 in sampling_parameters


@pytest_asyncio.fixture
async def seen(aiohttp_server) -> Any:
    """What the SDK's session saw, and the engine that served it."""
    engine = ScriptedEngine()
    app = create_app({"fake": engine}, ServeConfig(keepalive_s=0.05, poll_s=0.01, api_key=KEY))
    http = await aiohttp_server(app)
    server, port, checks = grpc_server.build(app, "127.0.0.1:0", None)
    await grpc_server.start(server, checks)
    try:
        out = await asyncio.to_thread(
            kserve_sdk.clients,
            f"127.0.0.1:{port}",
            f"http://127.0.0.1:{http.port}",
            KEY,
            "fake",
            "hi",
            {"max_tokens": 3, "temperature": 0},
        )
    finally:
        await server.stop(None)
    return out, engine


def tensor(text: str) -> list[dict[str, Any]]:
    return [{"name": "text_output", "datatype": "BYTES", "shape": [1], "text": [text]}]


async def test_grpc_client(seen) -> None:
    out, engine = seen
    g = out["grpc"]
    assert out["kserve"] == "0.21.0"
    assert g["live"] is g["ready"] is g["model_ready"] is True
    for how in ("raw", "contents"):  # raw_input_contents, then InferTensorContents
        r = g[f"infer_{how}"]
        assert r["outputs"] == tensor("hi" + REPLY3), how
        assert (r["id"], r["model_name"]) == (f"grpc-{how}", "fake")
        assert r["parameters"]["finish_reason"] == "length"
    assert g["missing_model"][0] == "NOT_FOUND" and "no-such-model" in g["missing_model"][1]
    assert g["no_key"][0] == "UNAUTHENTICATED"
    meta = g["model_metadata"]
    assert meta["name"] == "fake"
    assert {"name": "text_input", "datatype": "BYTES", "shape": ["1"]} in meta["inputs"]
    assert [o["name"] for o in meta["outputs"]] == ["text_output"]
    assert g["server_metadata"]["name"] == "goinfer"
    assert [p.max_tokens for p in engine.params] == [3] * 4 and {p.temperature for p in engine.params} == {0}


async def test_rest_client(seen) -> None:
    r = seen[0]["rest"]
    assert r["live"] is r["ready"] is r["model_ready"] is True
    assert r["missing_model_ready"] is False  # the v2 REST client reads a 404 as not ready
    for how in ("binary", "json"):  # Triton's binary tensor extension, then JSON data
        got = r[f"infer_{how}"]
        assert got["outputs"] == tensor("hi" + REPLY3), how
        assert (got["id"], got["model_name"]) == (f"rest-{how}", "fake")
    status, message = r["missing_model"]  # the SDK's HTTPStatusError carries our {"error": ...} text
    assert status == 404 and message.startswith("model 'no-such-model' is not served here"), message
    assert r["no_key"][0] == 401
    meta = r["model_metadata"]  # validated by kserve's ModelMetadataResponse
    assert meta["name"] == "fake" and [o["name"] for o in meta["outputs"]] == ["text_output"]
    assert {"name": "text_input", "datatype": "BYTES", "shape": [1]} in meta["inputs"]
    assert r["server_metadata"]["name"] == "goinfer"
