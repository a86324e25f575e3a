"""The KServe v2 front end on the real 0.5B through `goinfer serve --grpc-addr`, with tritonclient:
infer and stream, 4 gRPC and 4 HTTP streams through one scheduler (each greedy reply as it is
alone), and gRPC vs HTTP throughput at 4 clients; and with the kserve SDK's own clients."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kserve_sdk
import numpy as np
import pytest
from serve_process import free_port, serving

pytestmark = pytest.mark.slow
grpcclient = pytest.importorskip("tritonclient.grpc")

KEY, NAME = "test-key", "qwen"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPTS = [
    f"def {name}(" for name in ("add", "fibonacci", "is_prime", "reverse", "gcd", "flatten", "mean", "clamp")
]


@pytest.fixture(scope="module")
def urls(real_bundle) -> Iterator[tuple[str, str]]:
    port = free_port()
    with serving(
        NAME, real_bundle("qwen2.5-coder-0.5b", "gguf"), KEY, "--grpc-addr", f"127.0.0.1:{port}"
    ) as u:
        yield u, f"127.0.0.1:{port}"


def inputs(text: str, stream: bool, max_tokens: int) -> list[Any]:
    out = []
    for name, dtype, value in (
        ("text_input", "BYTES", np.array([text.encode()], dtype=np.object_)),
        ("stream", "BOOL", np.array([stream], dtype=bool)),
        (
            "sampling_parameters",
            "BYTES",
            np.array([json.dumps({"temperature": 0, "max_tokens": max_tokens})], dtype=np.object_),
        ),
        ("exclude_input_in_output", "BOOL", np.array([True], dtype=bool)),
    ):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(value)
        out.append(t)
    return out


def grpc_infer(url: str, text: str, max_tokens: int = 16) -> str:
    with grpcclient.InferenceServerClient(url) as c:
        return (
            c.infer(NAME, inputs(text, False, max_tokens), headers=AUTH).as_numpy("text_output")[0].decode()
        )


def grpc_stream(url: str, text: str, max_tokens: int = 16) -> list[str]:
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as c:
        c.start_stream(callback=lambda result, error: got.put((result, error)), headers=AUTH)
        c.async_stream_infer(NAME, inputs(text, True, max_tokens))
        pieces = []
        while True:
            result, error = got.get(timeout=300)
            assert error is None, error
            pieces.append(result.as_numpy("text_output")[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        c.stop_stream()
    return pieces


def http_completion(url: str, text: str, max_tokens: int = 16, stream: bool = False) -> str:
    body = {"model": NAME, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps(body).encode(),
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        raw = r.read().decode()
    if not stream:
        return json.loads(raw)["choices"][0]["text"]
    events = [b[6:] for b in raw.split("\n\n") if b.startswith("data: ") and b != "data: [DONE]"]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events)


def test_infer_and_stream(urls) -> None:
    _, grpc_url = urls
    with grpcclient.InferenceServerClient(grpc_url) as c:
        assert c.is_server_live(headers=AUTH) and c.is_model_ready(NAME, headers=AUTH)
        assert c.get_model_metadata(NAME, headers=AUTH, as_json=True)["outputs"][0]["name"] == "text_output"
    text = grpc_infer(grpc_url, PROMPTS[0])
    assert text.strip() and "return" in text
    pieces = grpc_stream(grpc_url, PROMPTS[0])
    assert len(pieces) > 1 and "".join(pieces) == text


def test_the_kserve_sdk_clients(urls) -> None:
    """kserve's InferenceGRPCClient and InferenceRESTClient (in their own venv: tests/kserve_sdk.py):
    health, readiness and metadata, and a greedy infer in each of the SDK's tensor encodings, each
    the reply /v1/completions gives."""
    http_url, grpc_url = urls
    want = http_completion(http_url, PROMPTS[1])
    params = {"temperature": 0, "max_tokens": 16}
    out = kserve_sdk.clients(
        grpc_url, http_url, KEY, NAME, PROMPTS[1], params, exclude_input=True, timeout=300
    )
    assert want.strip()
    for side, encodings in (("grpc", ("raw", "contents")), ("rest", ("binary", "json"))):
        got = out[side]
        assert got["live"] and got["ready"] and got["model_ready"], side
        assert got["model_metadata"]["name"] == NAME
        assert [o["name"] for o in got["model_metadata"]["outputs"]] == ["text_output"]
        for how in encodings:
            assert got[f"infer_{how}"]["outputs"][0]["text"] == [want], (side, how)
    assert out["grpc"]["missing_model"][0] == "NOT_FOUND" and out["rest"]["missing_model"][0] == 404


def test_grpc_and_http_streams_share_one_scheduler(urls) -> None:
    http_url, grpc_url = urls
    alone = {p: http_completion(http_url, p) for p in PROMPTS}
    jobs: list[Callable[[], str]] = [lambda p=p: "".join(grpc_stream(grpc_url, p)) for p in PROMPTS[:4]]
    jobs += [lambda p=p: http_completion(http_url, p, stream=True) for p in PROMPTS[4:]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda f: f(), jobs))
    assert together == [alone[p] for p in PROMPTS]


def _rate(fn: Callable[[str], str], clients: int = 4, rounds: int = 3) -> float:
    """Requests a second with `clients` threads each sending `rounds` requests."""
    barrier = threading.Barrier(clients)

    def client(i: int) -> None:
        barrier.wait()
        for r in range(rounds):
            fn(PROMPTS[(i + r) % len(PROMPTS)])

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return clients * rounds / (time.perf_counter() - start)


def test_grpc_throughput_matches_http_at_4_clients(urls, record_property) -> None:
    http_url, grpc_url = urls
    grpc_rates, http_rates = [], []
    for _ in range(2):  # alternated, so a neighbour's load falls on both
        http_rates.append(_rate(lambda p: http_completion(http_url, p, 8)))
        grpc_rates.append(_rate(lambda p: grpc_infer(grpc_url, p, 8)))
    g, h = max(grpc_rates), max(http_rates)
    record_property("grpc_req_s", g)
    record_property("http_req_s", h)
    print(f"4 clients, 8-token replies: gRPC {g:.2f} req/s {grpc_rates}, HTTP {h:.2f} req/s {http_rates}")
    assert g >= 0.95 * h


def test_a_10k_token_prompt_over_grpc_and_rest_v2(urls) -> None:
    """At the size agents send: a 15.8k-token prompt through gRPC ModelInfer and Triton's REST
    generate gives the reply /v1/completions gives (the message caps are the prompt routes')."""
    http, grpc_url = urls
    lines = [f"x{i} = {i} * {i % 7}  # step {i} of the table" for i in range(700)]
    text = "\n".join(lines) + "\ndef total():\n    return"
    want = http_completion(http, text, max_tokens=8)
    assert grpc_infer(grpc_url, text, max_tokens=8) == want
    params = {"temperature": 0, "max_tokens": 8, "exclude_input_in_output": True}
    body = json.dumps({"text_input": text, "parameters": params}).encode()
    req = urllib.request.Request(
        f"{http}/v2/models/{NAME}/generate", body, {"Content-Type": "application/json", **AUTH}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        assert json.loads(r.read())["text_output"] == want
