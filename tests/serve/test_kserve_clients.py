"""tritonclient, the real KServe v2 client, against the fake engine: gRPC infer, stream infer with
a callback, model metadata and health; HTTP infer (Triton's binary tensors) and health. The sync
clients run on a thread while the test's loop serves them."""

from __future__ import annotations

import asyncio
import json
import queue
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from fake_engine import PIECES, ScriptedEngine
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from goinfer.serve.kserve import grpc_server
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.asyncio
KEY = "sekrit"
AUTH = {"authorization": f"Bearer {KEY}"}
REPLY = "".join(PIECES)


@pytest_asyncio.fixture
async def urls(aiohttp_server) -> Any:
    app = create_app({"fake": ScriptedEngine()}, ServeConfig(keepalive_s=0.05, poll_s=0.01, api_key=KEY))
    http = await aiohttp_server(app)
    server, port, checks = grpc_server.build(app, "127.0.0.1:0", None)
    await grpc_server.start(server, checks)
    yield f"127.0.0.1:{port}", f"127.0.0.1:{http.port}"
    await server.stop(None)


def llm_inputs(text: str, stream: bool, params: dict[str, Any], module: Any) -> list[Any]:
    prompt = module.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    flag = module.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([stream], dtype=bool))
    knobs = module.InferInput("sampling_parameters", [1], "BYTES")
    knobs.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=np.object_))
    return [prompt, flag, knobs]


def grpc_session(url: str) -> dict[str, Any]:
    c = grpcclient.InferenceServerClient(url)
    out: dict[str, Any] = {
        "live": c.is_server_live(headers=AUTH),
        "ready": c.is_model_ready("fake", headers=AUTH),
        "meta": c.get_model_metadata("fake", headers=AUTH, as_json=True),
    }
    r = c.infer("fake", llm_inputs("hi", False, {"max_tokens": 8}, grpcclient), headers=AUTH)
    out["infer"] = r.as_numpy("text_output")[0].decode()
    got: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put((result, error)), headers=AUTH)
    c.async_stream_infer("fake", llm_inputs("hi", True, {"max_tokens": 8}, grpcclient), request_id="s1")
    pieces = []
    while True:
        result, error = got.get(timeout=10)
        assert error is None, error
        pieces.append(result.as_numpy("text_output")[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    c.stop_stream()
    out["stream"] = pieces
    try:
        c.get_model_metadata("nope", headers=AUTH)
    except InferenceServerException as e:
        out["missing"] = e.status()
    try:
        c.is_server_live()
    except InferenceServerException as e:
        out["no_key"] = e.status()
    c.close()
    return out


async def test_tritonclient_grpc(urls) -> None:
    out = await asyncio.to_thread(grpc_session, urls[0])
    assert out["live"] and out["ready"]
    assert out["meta"]["name"] == "fake" and out["meta"]["outputs"][0]["name"] == "text_output"
    assert out["infer"] == "hi" + REPLY
    assert "".join(out["stream"]) == REPLY and len(out["stream"]) > 1
    assert out["missing"] == "StatusCode.NOT_FOUND" and out["no_key"] == "StatusCode.UNAUTHENTICATED"


def http_session(url: str) -> dict[str, Any]:
    c = httpclient.InferenceServerClient(url)
    out: dict[str, Any] = {
        "live": c.is_server_live(headers=AUTH),
        "ready": c.is_model_ready("fake", headers=AUTH),
    }
    out["meta"] = c.get_model_metadata("fake", headers=AUTH)
    r = c.infer("fake", llm_inputs("hi", False, {"max_tokens": 8}, httpclient), headers=AUTH)
    out["infer"] = r.as_numpy("text_output")[0]
    c.close()
    return out


async def test_tritonclient_http(urls) -> None:
    out = await asyncio.to_thread(http_session, urls[1])
    assert out["live"] and out["ready"] and out["meta"]["name"] == "fake"
    text = out["infer"]
    assert (text.decode() if isinstance(text, bytes) else text) == "hi" + REPLY
