"""The KServe v2 front end on fake engines: every gRPC RPC and REST v2 route, and their errors
(gRPC: a proper status code, never UNKNOWN)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from fake_engine import PIECES, ScriptedEngine
from goinfer.serve.app import create_app
from goinfer.serve.config import ServeConfig
from goinfer.serve.guards import HALT
from goinfer.serve.keys import REGISTRY
from goinfer.serve.kserve import grpc_predict_v2_pb2 as pb
from goinfer.serve.kserve import grpc_predict_v2_pb2_grpc as pb_grpc
from goinfer.serve.kserve import grpc_server
from goinfer.serve.kserve.tensors import raw_bytes
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.asyncio
KEY = "sekrit"
AUTH = (("authorization", f"Bearer {KEY}"),)
FAST = {"keepalive_s": 0.05, "poll_s": 0.01}
REPLY = "".join(PIECES)


class Grpc:
    def __init__(self, stub: Any, health: Any, engines: dict, http: Any):
        self.stub, self.health, self.engines, self.http = stub, health, engines, http


@pytest_asyncio.fixture
async def served(aiohttp_client) -> AsyncIterator[Any]:
    """make(engines=..., **config) -> Grpc: the app over HTTP (aiohttp's test client) and gRPC."""
    stack: list[Any] = []

    async def make(engines: dict | None = None, **config: Any) -> Grpc:
        engines = engines if engines is not None else {"fake": ScriptedEngine()}
        app = create_app(engines, ServeConfig(**{**FAST, "api_key": KEY, **config}))
        http = await aiohttp_client(app)
        server, port, checks = grpc_server.build(app, "127.0.0.1:0", None)
        await grpc_server.start(server, checks)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stack.append((server, channel))
        return Grpc(
            pb_grpc.GRPCInferenceServiceStub(channel), health_pb2_grpc.HealthStub(channel), engines, http
        )

    yield make
    for server, channel in stack:
        await channel.close()
        await server.stop(None)


def infer_request(
    text: str | None = "hi",
    model: str = "fake",
    params: dict[str, Any] | None = None,
    raw: bool = False,
    **bools: bool,
) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model, id="r1")
    if text is not None:
        t = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        if raw:
            req.raw_input_contents.append(raw_bytes(text))
        else:
            t.contents.bytes_contents.append(text.encode())
    if params is not None:
        t = req.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
        t.contents.bytes_contents.append(json.dumps(params).encode())
    for name, value in bools.items():
        req.inputs.add(name=name, datatype="BOOL", shape=[1]).contents.bool_contents.append(value)
    return req


def text_of(resp: pb.ModelInferResponse) -> str:
    assert [o.name for o in resp.outputs] == ["text_output"]
    raw = resp.raw_output_contents[0]
    return raw[4:].decode()


async def code_of(call: Any, timeout: bool = False) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await (asyncio.wait_for(call, 10) if timeout else call)
    assert e.value.code() != grpc.StatusCode.UNKNOWN
    return e.value.code()


# -- health and metadata -------------------------------------------------------------------------
async def test_health_and_metadata(served) -> None:
    g = await served()
    assert (await g.stub.ServerLive(pb.ServerLiveRequest(), metadata=AUTH)).live
    assert (await g.stub.ServerReady(pb.ServerReadyRequest(), metadata=AUTH)).ready
    assert (await g.stub.ModelReady(pb.ModelReadyRequest(name="fake"), metadata=AUTH)).ready
    meta = await g.stub.ServerMetadata(pb.ServerMetadataRequest(), metadata=AUTH)
    assert meta.name == "goinfer" and "model_stream_infer" in meta.extensions
    m = await g.stub.ModelMetadata(pb.ModelMetadataRequest(name="fake"), metadata=AUTH)
    assert m.name == "fake" and list(m.versions) == ["1"]
    assert {(t.name, t.datatype) for t in m.inputs} >= {("text_input", "BYTES"), ("stream", "BOOL")}
    assert [(t.name, t.datatype) for t in m.outputs] == [("text_output", "BYTES")]
    h = await g.health.Check(health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"))
    assert h.status == health_pb2.HealthCheckResponse.SERVING


async def test_unknown_model_and_version_are_not_found(served) -> None:
    g = await served()
    ready = g.stub.ModelReady(pb.ModelReadyRequest(name="nope"), metadata=AUTH)
    assert await code_of(ready) == grpc.StatusCode.NOT_FOUND
    meta = g.stub.ModelMetadata(pb.ModelMetadataRequest(name="fake", version="7"), metadata=AUTH)
    assert await code_of(meta) == grpc.StatusCode.NOT_FOUND
    assert (
        await code_of(g.stub.ModelInfer(infer_request(model="nope"), metadata=AUTH))
        == grpc.StatusCode.NOT_FOUND
    )


async def test_the_key_is_required(served) -> None:
    g = await served()
    for call in (
        g.stub.ServerLive(pb.ServerLiveRequest()),
        g.stub.ModelInfer(infer_request()),
        g.stub.ModelInfer(infer_request(), metadata=(("authorization", "Bearer wrong"),)),
    ):
        assert await code_of(call) == grpc.StatusCode.UNAUTHENTICATED
    ok = await g.stub.ServerLive(pb.ServerLiveRequest(), metadata=(("x-api-key", KEY),))
    assert ok.live


# -- ModelInfer ----------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [False, True])
async def test_infer_returns_prompt_and_reply(served, raw: bool) -> None:
    g = await served()
    resp = await g.stub.ModelInfer(infer_request("hi", raw=raw), metadata=AUTH)
    assert text_of(resp) == "hi" + REPLY  # vLLM's rule: the prompt first unless excluded
    assert resp.id == "r1" and resp.model_name == "fake"
    assert resp.parameters["finish_reason"].string_param == "stop"
    resp = await g.stub.ModelInfer(infer_request("hi", exclude_input_in_output=True), metadata=AUTH)
    assert text_of(resp) == REPLY


async def test_sampling_parameters_reach_the_engine(served) -> None:
    g = await served()
    params = {"temperature": 0.5, "top_p": 0.9, "top_k": -1, "seed": 3, "max_tokens": 2, "stop": ["zzz"]}
    await g.stub.ModelInfer(infer_request(params=params), metadata=AUTH)
    p = g.engines["fake"].params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (0.5, 0.9, 0, 3, 2)
    # request parameters carry the same keys (Triton's generate convention); the tensor wins
    req = infer_request(params={"max_tokens": 3})
    req.parameters["temperature"].double_param = 0.25
    req.parameters["max_tokens"].int64_param = 9
    await g.stub.ModelInfer(req, metadata=AUTH)
    p = g.engines["fake"].params[-1]
    assert (p.temperature, p.max_tokens) == (0.25, 3)


async def test_stop_strings_apply(served) -> None:
    g = await served()
    resp = await g.stub.ModelInfer(
        infer_request(params={"stop": " wor"}, exclude_input_in_output=True), metadata=AUTH
    )
    assert text_of(resp) == "Hello"


def _bad_requests() -> list[tuple[str, pb.ModelInferRequest]]:
    out = [("missing text_input", infer_request(None))]
    r = infer_request()
    r.inputs[0].datatype = "FP32"
    out.append(("wrong dtype", r))
    r = infer_request()
    del r.inputs[0].shape[:]
    r.inputs[0].shape.extend([2])
    out.append(("wrong shape", r))
    r = infer_request()
    r.inputs[0].contents.bytes_contents.append(b"two")
    out.append(("two elements", r))
    r = infer_request()
    t = r.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(b"{not json")
    out.append(("bad JSON", r))
    r = infer_request()
    r.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        b"[1]"
    )
    out.append(("JSON not an object", r))
    out.append(("unknown knob", infer_request(params={"best_of": 2})))
    out.append(("temperature out of range", infer_request(params={"temperature": 9})))
    out.append(("temperature a word", infer_request(params={"temperature": "hot"})))
    out.append(("max_tokens zero", infer_request(params={"max_tokens": 0})))
    out.append(("stop not strings", infer_request(params={"stop": [1]})))
    out.append(("stream on unary", infer_request(stream=True)))
    r = infer_request()
    r.inputs.add(name="image", datatype="UINT8", shape=[1]).contents.uint_contents.append(1)
    out.append(("unknown input", r))
    r = infer_request()
    r.outputs.add(name="logits")
    out.append(("unknown output", r))
    r = infer_request(raw=True)
    r.raw_input_contents[0] = b"\xff\xff\xff\x00ab"
    out.append(("raw BYTES too short", r))
    out.append(("not UTF-8", infer_request("x")))
    out[-1][1].inputs[0].contents.bytes_contents[0] = b"\xff\xfe"
    out.append(("empty prompt", infer_request("")))
    out.append(("no model name", infer_request(model="")))
    r = infer_request()
    r.inputs.add(name="stream", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"true")
    out.append(("stream as BYTES", r))
    return out


@pytest.mark.parametrize(("why", "req"), _bad_requests(), ids=[w for w, _ in _bad_requests()])
async def test_hostile_requests_are_invalid_argument(served, why: str, req: pb.ModelInferRequest) -> None:
    g = await served()
    assert await code_of(g.stub.ModelInfer(req, metadata=AUTH)) == grpc.StatusCode.INVALID_ARGUMENT, why


async def test_a_prompt_over_the_window_is_invalid_argument(served) -> None:
    g = await served()
    assert (
        await code_of(g.stub.ModelInfer(infer_request("x" * 500), metadata=AUTH))
        == grpc.StatusCode.INVALID_ARGUMENT
    )


async def test_a_full_queue_is_resource_exhausted(served) -> None:
    gate = threading.Event()
    g = await served({"fake": ScriptedEngine(gate=gate)}, max_queue=0, max_concurrent=1)
    first = asyncio.ensure_future(g.stub.ModelInfer(infer_request(), metadata=AUTH))
    while not g.engines["fake"].started.is_set():
        await asyncio.sleep(0.01)
    assert (
        await code_of(g.stub.ModelInfer(infer_request(), metadata=AUTH)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    gate.set()
    assert text_of(await first).endswith(REPLY)


async def test_a_loading_model_is_unavailable(served) -> None:
    g = await served()
    g.http.app[REGISTRY].loading.add("later")
    call = g.stub.ModelInfer(infer_request(model="later"), metadata=AUTH)
    assert await code_of(call) == grpc.StatusCode.UNAVAILABLE
    assert not (await g.stub.ModelReady(pb.ModelReadyRequest(name="later"), metadata=AUTH)).ready


async def test_an_encoder_name_is_invalid_argument(served) -> None:
    g = await served()
    reg = g.http.app[REGISTRY]
    reg.encoders["emb"] = object()  # route() looks the name up only
    try:
        call = g.stub.ModelInfer(infer_request(model="emb"), metadata=AUTH)
        assert await code_of(call) == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        del reg.encoders["emb"]


async def test_an_engine_failure_is_internal_not_unknown(served) -> None:
    g = await served({"fake": ScriptedEngine(fail=True)})
    assert await code_of(g.stub.ModelInfer(infer_request(), metadata=AUTH)) == grpc.StatusCode.INTERNAL


# -- ModelStreamInfer ----------------------------------------------------------------------------
async def test_stream_infer_sends_deltas_then_a_final(served) -> None:
    g = await served()
    call = g.stub.ModelStreamInfer(metadata=AUTH)
    await call.write(infer_request("hi", stream=True))
    await call.done_writing()
    replies = [r async for r in call]
    assert all(not r.error_message for r in replies)
    texts = [text_of(r.infer_response) for r in replies]
    assert "".join(texts) == REPLY and len(texts) > 1  # deltas only: no prompt in a stream
    finals = [r.infer_response.parameters["triton_final_response"].bool_param for r in replies]
    assert finals == [False] * (len(texts) - 1) + [True]


async def test_stream_runs_several_requests_and_errors_stay_in_band(served) -> None:
    g = await served()

    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        a = infer_request("a", stream=True)
        a.id = "a"
        bad = infer_request(None)
        bad.id = "bad"
        b = infer_request("b", exclude_input_in_output=False)
        b.id = "b"
        for r in (a, bad, b):
            yield r

    replies = [r async for r in g.stub.ModelStreamInfer(requests(), metadata=AUTH)]
    errors = [r.error_message for r in replies if r.error_message]
    assert len(errors) == 1 and errors[0].startswith("INVALID_ARGUMENT: ") and "text_input" in errors[0]
    by_id: dict[str, str] = {}
    for r in replies:
        if not r.error_message:
            by_id[r.infer_response.id] = by_id.get(r.infer_response.id, "") + text_of(r.infer_response)
    assert by_id == {"a": REPLY, "b": "b" + REPLY}


async def test_stream_needs_the_key(served) -> None:
    g = await served()
    call = g.stub.ModelStreamInfer()
    with pytest.raises(grpc.aio.AioRpcError) as e:  # the write itself may meet the refusal
        await call.write(infer_request(stream=True))
        await call.done_writing()
        _ = [r async for r in call]
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_client_that_leaves_mid_stream_cancels_its_run(served) -> None:
    gate = threading.Event()
    g = await served({"fake": ScriptedEngine(gate=gate)})
    call = g.stub.ModelStreamInfer(metadata=AUTH)
    await call.write(infer_request(stream=True))
    while not g.engines["fake"].started.is_set():
        await asyncio.sleep(0.01)
    call.cancel()
    gate.set()
    slot = g.http.app[REGISTRY].slots["fake"]
    for _ in range(200):
        if slot.admitted == 0:
            break
        await asyncio.sleep(0.01)
    assert slot.admitted == 0


# -- REST v2 ---------------------------------------------------------------------------------------
HEADERS = {"Authorization": f"Bearer {KEY}"}


def rest_infer(text: Any = "hi", **extra: Any) -> dict[str, Any]:
    inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [text]}]
    return {"id": "x", "inputs": inputs, **extra}


async def test_rest_health_metadata_and_ready(served) -> None:
    http = (await served()).http
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/fake", "/v2/models/fake/ready"):
        r = await http.get(path, headers=HEADERS)
        assert r.status == 200, (path, await r.text())
    meta = await (await http.get("/v2/models/fake", headers=HEADERS)).json()
    assert meta["name"] == "fake" and meta["outputs"][0]["name"] == "text_output"
    assert (await http.get("/v2/health/live")).status == 401  # the key, as every route
    r = await http.get("/v2/models/nope/ready", headers=HEADERS)
    assert r.status == 404 and set(await r.json()) == {"error"}
    r = await http.get("/v2/models/fake/versions/2", headers=HEADERS)
    assert r.status == 404


async def test_rest_infer(served) -> None:
    http = (await served()).http
    r = await http.post("/v2/models/fake/infer", json=rest_infer(), headers=HEADERS)
    body = await r.json()
    assert r.status == 200, body
    assert body["outputs"] == [
        {"name": "text_output", "datatype": "BYTES", "shape": [1], "data": ["hi" + REPLY]}
    ]
    assert body["id"] == "x" and body["parameters"]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"inputs": []}, 400),
        (rest_infer(5), 400),
        ({"inputs": [{"name": "text_input", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, 400),
        ({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}]}, 400),
        (rest_infer(parameters={"temperature": "hot"}), 400),
        (rest_infer(parameters={"best_of": 3}), 400),
        (rest_infer(outputs=[{"name": "logits"}]), 400),
        ("not an object", 400),
    ],
)
async def test_rest_infer_refusals(served, body: Any, status: int) -> None:
    http = (await served()).http
    r = await http.post("/v2/models/fake/infer", json=body, headers=HEADERS)
    out = await r.json()
    assert r.status == status and isinstance(out["error"], str), out


async def test_rest_infer_unknown_model_is_404(served) -> None:
    http = (await served()).http
    r = await http.post("/v2/models/nope/infer", json=rest_infer(), headers=HEADERS)
    assert r.status == 404


async def test_generate_and_generate_stream(served) -> None:
    g = await served()
    body = {"text_input": "hi", "parameters": {"temperature": 0, "max_tokens": 3}}
    r = await g.http.post("/v2/models/fake/generate", json=body, headers=HEADERS)
    out = await r.json()
    assert r.status == 200, out
    assert out["text_output"] == "hi" + "".join(PIECES[:3]) and out["finish_reason"] == "length"
    assert g.engines["fake"].params[-1].max_tokens == 3
    body = {"text_input": "hi", "exclude_input_in_output": True, "sampling_parameters": '{"max_tokens": 9}'}
    r = await g.http.post("/v2/models/fake/generate_stream", json=body, headers=HEADERS)
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    text = (await r.read()).decode()
    events = [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == REPLY and len(events) > 1
    assert events[-1]["finish_reason"] == "stop"


async def test_generate_refusals(served) -> None:
    http = (await served()).http
    for body, status in (
        ({"parameters": {}}, 400),
        ({"text_input": 3}, 400),
        ({"text_input": "x" * 500}, 400),
    ):
        for route in ("generate", "generate_stream"):
            r = await http.post(f"/v2/models/fake/{route}", json=body, headers=HEADERS)
            assert r.status == status and "error" in await r.json(), (route, body)


async def test_generate_stream_full_queue_is_429_before_the_stream(served) -> None:
    gate = threading.Event()
    g = await served({"fake": ScriptedEngine(gate=gate)}, max_queue=0, max_concurrent=1)
    first = asyncio.ensure_future(
        g.http.post("/v2/models/fake/generate", json={"text_input": "a"}, headers=HEADERS)
    )
    while not g.engines["fake"].started.is_set():
        await asyncio.sleep(0.01)
    r = await g.http.post("/v2/models/fake/generate_stream", json={"text_input": "b"}, headers=HEADERS)
    assert r.status == 429 and "busy" in (await r.json())["error"]
    gate.set()
    assert (await first).status == 200


async def test_a_halt_is_unavailable_and_not_ready(served) -> None:
    g = await served()
    g.http.app[HALT].admin = "upgrade"
    assert await code_of(g.stub.ModelInfer(infer_request(), metadata=AUTH)) == grpc.StatusCode.UNAVAILABLE
    assert not (await g.stub.ServerReady(pb.ServerReadyRequest(), metadata=AUTH)).ready
    assert not (await g.stub.ModelReady(pb.ModelReadyRequest(name="fake"), metadata=AUTH)).ready
    replies = [r async for r in g.stub.ModelStreamInfer(iter([infer_request(stream=True)]), metadata=AUTH)]
    assert [r.error_message.split(":")[0] for r in replies] == ["UNAVAILABLE"]
    r = await g.http.post("/v2/models/fake/generate", json={"text_input": "hi"}, headers=HEADERS)
    assert r.status == 503 and "halted" in (await r.json())["error"]
    assert (await g.http.get("/v2/health/ready", headers=HEADERS)).status == 503
    g.http.app[HALT].admin = None
    assert (await g.stub.ServerReady(pb.ServerReadyRequest(), metadata=AUTH)).ready


async def test_grpc_and_rest_v2_requests_count_in_metrics(served) -> None:
    g = await served()
    await g.stub.ModelInfer(infer_request(), metadata=AUTH)
    await g.http.post("/v2/models/fake/generate", json={"text_input": "hi"}, headers=HEADERS)
    text = await (await g.http.get("/metrics", headers=HEADERS)).text()
    done = [line for line in text.splitlines() if line.startswith("goinfer:request_success_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in done) == 2, done


async def test_tls_with_the_servers_cert_and_key(tmp_path) -> None:
    """`lifetime` (what `goinfer serve --grpc-addr` starts) serves TLS from --tls-cert/--tls-key."""
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    from serve_process import free_port

    port = free_port()
    app = create_app({"fake": ScriptedEngine()}, ServeConfig(**FAST, api_key=KEY))
    ctx = grpc_server.lifetime(f"127.0.0.1:{port}", (str(cert), str(key)))(app)
    await anext(ctx)
    try:
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert text_of(await stub.ModelInfer(infer_request(), metadata=AUTH)) == "hi" + REPLY
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            call = pb_grpc.GRPCInferenceServiceStub(plain).ServerLive(pb.ServerLiveRequest(), metadata=AUTH)
            assert await code_of(call, timeout=True) == grpc.StatusCode.UNAVAILABLE  # no plaintext beside TLS
    finally:
        await anext(ctx, None)
        for slot in app[REGISTRY].slots.values():
            slot.close()
