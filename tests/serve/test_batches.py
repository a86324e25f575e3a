"""Batch files (serve/batch_format.py) and their HTTP routes on fake engines: /v1/files,
/v1/batches, /v1/messages/batches; the status machine, durability across a restart of the app,
priority under interactive load, and the refusals (4xx, never 500)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import FormData
from fake_engine import ScriptedEngine
from goinfer.serve import batch_format as bf
from goinfer.serve.app import create_app
from goinfer.serve.batches import BATCHES
from goinfer.serve.config import BatchConfig, ServeConfig

FAST = {"keepalive_s": 0.05, "poll_s": 0.01}


def line(cid: str, content: str = "hi", url: str = bf.CHAT, **body: Any) -> dict[str, Any]:
    if url == bf.COMPLETIONS:
        return {"custom_id": cid, "method": "POST", "url": url, "body": {"prompt": content, **body}}
    msgs = [{"role": "user", "content": content}]
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"messages": msgs, **body}}


def jsonl(*lines: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


# -- the format ---------------------------------------------------------------------------------
def test_a_duplicate_custom_id_names_both_lines() -> None:
    data = jsonl(line("a"), line("b")) + b"\n" + jsonl(line("a"))
    with pytest.raises(bf.FormatError, match=r"line 4: custom_id 'a' is already used on line 1") as e:
        bf.parse_lines(data)
    assert e.value.line == 4 and e.value.code == "duplicate_custom_id"


@pytest.mark.parametrize(
    "data, match",
    [
        (b'{"custom_id": "a"\n', "line 1 is not valid JSON"),
        (jsonl(line("a")) + b"[1, 2]\n", "line 2 is not a JSON object"),
        (jsonl({"method": "POST", "url": bf.CHAT, "body": {}}), "line 1: custom_id is required"),
        (jsonl({**line("a"), "url": "/v1/embeddings"}), "line 1: url '/v1/embeddings' is not"),
        (jsonl({**line("a"), "method": "GET"}), "method 'GET'"),
        (jsonl({**line("a"), "body": "x"}), "body must be a JSON object"),
        (b"\n\n", "holds no requests"),
    ],
)
def test_a_file_that_is_not_a_batch_file_names_the_first_bad_line(data: bytes, match: str) -> None:
    with pytest.raises(bf.FormatError, match=match):
        bf.parse_lines(data)


def test_a_line_for_another_endpoint_than_the_batch_is_refused() -> None:
    with pytest.raises(bf.FormatError, match=r"line 1: url '/v1/completions' is not /v1/chat/completions"):
        bf.parse_lines(jsonl(line("a", url=bf.COMPLETIONS)), bf.CHAT)


@pytest.mark.parametrize(
    "body, named",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "logprobs"),
        ({"n": 2}, "n: 2"),
        ({"goinfer_confidence": True}, "goinfer_confidence"),
        ({"stream": True}, "stream"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "image_url"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "tool messages"),
    ],
)
def test_what_a_batch_cannot_do_is_named(body: dict[str, Any], named: str) -> None:
    why = bf.cannot_do(bf.CHAT, {"messages": [{"role": "user", "content": "x"}], **body})
    assert why is not None and named in why


def test_plain_lines_can_run() -> None:
    assert bf.cannot_do(bf.CHAT, line("a", n=1, logprobs=False)["body"]) is None
    assert bf.cannot_do(bf.COMPLETIONS, line("a", url=bf.COMPLETIONS)["body"]) is None


def test_a_line_with_no_sampling_gets_the_apis_defaults_not_the_clis() -> None:
    (a,) = bf.parse_lines(jsonl(line("a")))
    body = bf.prepared(a, "salt")
    assert body["temperature"] == 1.0 and body["max_tokens"] == 512
    assert body["seed"] == bf.default_seed("salt", "a")  # random per batch, the same on a rerun
    assert bf.prepared(a, "other")["seed"] != body["seed"]
    (b,) = bf.parse_lines(jsonl(line("b", temperature=0, max_completion_tokens=7, seed=3)))
    assert {k: bf.prepared(b, "s")[k] for k in ("temperature", "seed", "max_completion_tokens")} == {
        "temperature": 0,
        "seed": 3,
        "max_completion_tokens": 7,
    }
    assert "max_tokens" not in bf.prepared(b, "s")


def test_overrides_are_an_instruction_about_the_run() -> None:
    msgs = [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}]
    (a,) = bf.parse_lines(
        jsonl({**line("a"), "body": {"messages": msgs, "temperature": 0.7, "max_completion_tokens": 9}})
    )
    body = bf.prepared(a, "s", {"temperature": 0.0, "max_tokens": 5, "system": "new", "seed": None})
    assert body["temperature"] == 0.0 and body["max_tokens"] == 5 and "max_completion_tokens" not in body
    assert body["messages"] == [{"role": "system", "content": "new"}, {"role": "user", "content": "q"}]


def test_output_and_error_lines_have_openais_shape() -> None:
    ok = bf.output_line("a", 200, {"x": 1}, "s")
    assert set(ok) == {"id", "custom_id", "response", "error"} and ok["error"] is None
    assert ok["id"].startswith("batch_req_") and set(ok["response"]) == {"status_code", "request_id", "body"}
    bad = bf.error_line("a", "c", "m", "s")
    assert bad["response"] is None and bad["error"] == {"code": "c", "message": "m"}
    assert bf.succeeded(ok) and not bf.succeeded(bad)


def test_the_result_log_cuts_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    log = bf.ResultLog(path)
    log.append(bf.output_line("a", 200, {}, ""))
    log.close()
    with open(path, "ab") as f:
        f.write(b'{"custom_id": "b", "resp')  # the process died here
    again = bf.ResultLog(path)
    assert again.done_ids() == {"a"}
    again.append(bf.output_line("b", 200, {}, ""))
    again.close()
    assert [json.loads(x)["custom_id"] for x in path.read_bytes().splitlines()] == ["a", "b"]


# -- over HTTP ------------------------------------------------------------------------------------
async def client(aiohttp_client, tmp_path: Path, engine=None, **config: Any):
    engine = engine or ScriptedEngine()
    batch = BatchConfig(dir=str(tmp_path / "batches"), max_file_bytes=config.pop("max_file_bytes", 1 << 20))
    cfg = ServeConfig(**{**FAST, "max_concurrent": 2, **config}, batch=batch)
    return await aiohttp_client(create_app({"m": engine}, cfg))


async def upload(c, data: bytes, purpose: str = "batch", name: str = "in.jsonl"):
    form = FormData()
    form.add_field("purpose", purpose)
    form.add_field("file", data, filename=name, content_type="application/jsonl")
    return await c.post("/v1/files", data=form)


async def wait_status(c, path: str, key: str, want: tuple[str, ...], timeout: float = 10.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        body = await (await c.get(path)).json()
        if body[key] in want or time.monotonic() > end:
            assert body[key] in want, body
            return body
        await asyncio.sleep(0.02)


async def run_batch(c, data: bytes, endpoint: str = bf.CHAT) -> dict[str, Any]:
    f = await (await upload(c, data)).json()
    resp = await c.post(
        "/v1/batches", json={"input_file_id": f["id"], "endpoint": endpoint, "completion_window": "24h"}
    )
    assert resp.status == 200, await resp.text()
    b = await resp.json()
    assert b["status"] == "validating" and b["object"] == "batch" and b["input_file_id"] == f["id"]
    return await wait_status(c, f"/v1/batches/{b['id']}", "status", ("completed", "failed", "expired"))


async def content(c, file_id: str) -> list[dict[str, Any]]:
    resp = await c.get(f"/v1/files/{file_id}/content")
    assert resp.status == 200
    return [json.loads(x) for x in (await resp.read()).splitlines()]


@pytest.mark.asyncio
async def test_a_file_through_a_batch_gives_what_the_route_gives(aiohttp_client, tmp_path: Path) -> None:
    engine = ScriptedEngine()
    c = await client(aiohttp_client, tmp_path, engine)
    data = jsonl(
        line("a", temperature=0), line("b", url=bf.CHAT, tools=[{"type": "function"}]), line("c", stop="wor")
    )
    b = await run_batch(c, data)
    assert b["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    out, errs = await content(c, b["output_file_id"]), await content(c, b["error_file_id"])
    assert [r["custom_id"] for r in out] == ["a", "c"]  # in the input's order
    live = await (
        await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    ).json()
    a = out[0]["response"]
    assert a["status_code"] == 200 and a["body"]["choices"] == live["choices"]
    assert set(a["body"]) == set(live) and a["body"]["usage"] == live["usage"]
    assert out[1]["response"]["body"]["choices"][0]["message"]["content"] == "Hello "
    assert errs[0]["custom_id"] == "b" and errs[0]["response"] is None
    assert errs[0]["error"]["code"] == "unsupported_in_batch" and "tools" in errs[0]["error"]["message"]
    # the defaults a line without sampling got: the API's, a seed drawn for the batch
    params = {p.temperature for p in engine.params}
    assert params == {0.0, 1.0} and all(p.max_tokens == 512 for p in engine.params[:2])
    assert all(p.seed is not None for p in engine.params[:2])  # (the third is the live request)
    files = await (await c.get("/v1/files")).json()
    assert {f["purpose"] for f in files["data"]} == {"batch", "batch_output"}
    listed = await (await c.get("/v1/batches")).json()
    assert listed["object"] == "list" and [x["id"] for x in listed["data"]] == [b["id"]]


@pytest.mark.asyncio
async def test_completions_batches_and_a_line_the_route_refuses(aiohttp_client, tmp_path: Path) -> None:
    c = await client(aiohttp_client, tmp_path)
    data = jsonl(line("a", url=bf.COMPLETIONS, max_tokens=2), line("b", url=bf.COMPLETIONS, temperature=9))
    b = await run_batch(c, data, bf.COMPLETIONS)
    out, errs = await content(c, b["output_file_id"]), await content(c, b["error_file_id"])
    assert out[0]["response"]["body"]["choices"][0]["text"] == "Hello"
    assert errs[0]["custom_id"] == "b" and "temperature" in errs[0]["error"]["message"]


@pytest.mark.asyncio
async def test_a_duplicate_id_fails_the_batch_naming_both_lines(aiohttp_client, tmp_path: Path) -> None:
    c = await client(aiohttp_client, tmp_path)
    b = await run_batch(c, jsonl(line("a"), line("b"), line("a")))
    assert b["status"] == "failed" and b["failed_at"] and b["output_file_id"] is None
    (err,) = b["errors"]["data"]
    assert err["code"] == "duplicate_custom_id" and err["line"] == 3 and "line 1" in err["message"]


@pytest.mark.asyncio
async def test_files_routes(aiohttp_client, tmp_path: Path) -> None:
    c = await client(aiohttp_client, tmp_path)
    data = jsonl(line("a"))
    f = await (await upload(c, data, name="mine.jsonl")).json()
    assert f["object"] == "file" and f["bytes"] == len(data) and f["filename"] == "mine.jsonl"
    assert f["purpose"] == "batch" and f["status"] == "processed"
    assert await (await c.get(f"/v1/files/{f['id']}")).json() == f
    assert (await (await c.get(f"/v1/files/{f['id']}/content")).read()) == data
    assert (await (await c.delete(f"/v1/files/{f['id']}")).json()) == {
        "id": f["id"],
        "object": "file",
        "deleted": True,
    }
    resp = await c.get(f"/v1/files/{f['id']}")
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "file_not_found"


@pytest.mark.asyncio
async def test_uploads_refused(aiohttp_client, tmp_path: Path) -> None:
    c = await client(aiohttp_client, tmp_path, max_file_bytes=1000)
    resp = await upload(c, jsonl(line("a")) + b"not json\n" + jsonl(line("b")))
    assert resp.status == 400 and "line 2 is not valid JSON" in (await resp.json())["error"]["message"]
    resp = await upload(c, jsonl(*[line(f"id{i}") for i in range(30)]))
    assert resp.status == 413 and "1000-byte cap" in (await resp.json())["error"]["message"]
    resp = await upload(c, jsonl(line("a")), purpose="fine-tune")
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "purpose"
    resp = await c.post("/v1/files", json={"purpose": "batch"})
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_multipart"
    big = jsonl(line("a")) * 0 + b"x" * 200_000
    resp = await c.post("/v1/files", data=big, headers={"Content-Type": "multipart/form-data; boundary=z"})
    assert resp.status == 413
    assert not list((tmp_path / "batches" / "files").glob("*.tmp"))  # nothing half-written is left


@pytest.mark.asyncio
async def test_batches_refused(aiohttp_client, tmp_path: Path) -> None:
    c = await client(aiohttp_client, tmp_path)
    f = await (await upload(c, jsonl(line("a")))).json()
    cases = [
        (
            {"input_file_id": "file-nope", "endpoint": bf.CHAT, "completion_window": "24h"},
            400,
            "input_file_id",
        ),
        (
            {"input_file_id": f["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"},
            400,
            "endpoint",
        ),
        (
            {"input_file_id": f["id"], "endpoint": bf.CHAT, "completion_window": "1h"},
            400,
            "completion_window",
        ),
        ({"endpoint": bf.CHAT, "completion_window": "24h"}, 400, "input_file_id"),
    ]
    for body, status, param in cases:
        resp = await c.post("/v1/batches", json=body)
        assert resp.status == status and (await resp.json())["error"]["param"] == param, body
    assert (await c.get("/v1/batches/batch_nope")).status == 404
    assert (await c.get("/v1/batches/../../etc")).status == 404
    assert (await c.post("/v1/batches/batch_nope/cancel")).status == 404
    assert (await c.get("/v1/batches?limit=0")).status == 400
    assert (await c.get("/v1/batches?limit=x")).status == 400


@pytest.mark.asyncio
async def test_cancel_runs_no_more_lines(aiohttp_client, tmp_path: Path) -> None:
    gate = threading.Event()
    engine = ScriptedEngine(gate=gate)
    c = await client(aiohttp_client, tmp_path, engine)
    f = await (await upload(c, jsonl(*[line(f"id{i}") for i in range(6)]))).json()
    b = await (
        await c.post(
            "/v1/batches", json={"input_file_id": f["id"], "endpoint": bf.CHAT, "completion_window": "24h"}
        )
    ).json()
    await wait_status(c, f"/v1/batches/{b['id']}", "status", ("in_progress",))
    resp = await (await c.post(f"/v1/batches/{b['id']}/cancel")).json()
    assert resp["status"] == "cancelling" and resp["cancelling_at"]
    gate.set()
    b = await wait_status(c, f"/v1/batches/{b['id']}", "status", ("cancelled",))
    assert b["cancelled_at"] and b["request_counts"]["total"] == 6
    errs = await content(c, b["error_file_id"])
    assert len(errs) == 6 - b["request_counts"]["completed"] and {e["error"]["code"] for e in errs} == {
        "batch_cancelled"
    }


@pytest.mark.asyncio
async def test_a_batch_past_its_window_expires(aiohttp_client, tmp_path: Path) -> None:
    c = await client(aiohttp_client, tmp_path)
    app = c.server.app
    object.__setattr__(app[BATCHES].config.batch, "completion_window_s", -1)  # already past
    b = await run_batch(c, jsonl(line("a"), line("b")))
    assert b["status"] == "expired" and b["expired_at"] and b["request_counts"]["failed"] == 2
    assert {e["error"]["code"] for e in await content(c, b["error_file_id"])} == {"batch_expired"}


@pytest.mark.asyncio
async def test_a_batch_resumes_in_a_new_app_on_the_same_dir(aiohttp_client, tmp_path: Path) -> None:
    """What a restart does (the kill -9 test does it to a real process): done lines stay done."""
    gate = threading.Event()
    first = ScriptedEngine(gate=gate)
    c = await client(aiohttp_client, tmp_path, first, max_concurrent=1)
    f = await (await upload(c, jsonl(*[line(f"id{i}") for i in range(4)]))).json()
    b = await (
        await c.post(
            "/v1/batches", json={"input_file_id": f["id"], "endpoint": bf.CHAT, "completion_window": "24h"}
        )
    ).json()
    await wait_status(c, f"/v1/batches/{b['id']}", "status", ("in_progress",))
    gate.set()
    while (await (await c.get(f"/v1/batches/{b['id']}")).json())["request_counts"]["completed"] < 2:
        await asyncio.sleep(0.01)
    gate.clear()  # hold the next one, then "crash"
    await c.close()
    gate.set()
    done_before = len(bf.ResultLog.read(tmp_path / "batches" / "batches" / b["id"] / "results.jsonl"))
    second = ScriptedEngine()
    c2 = await client(aiohttp_client, tmp_path, second)
    b = await wait_status(c2, f"/v1/batches/{b['id']}", "status", ("completed",))
    out = await content(c2, b["output_file_id"])
    assert [r["custom_id"] for r in out] == [f"id{i}" for i in range(4)]
    assert len(second.prompts) == 4 - done_before


@pytest.mark.asyncio
async def test_interactive_requests_go_first(aiohttp_client, tmp_path: Path) -> None:
    """Batch lines leave a worker free; when every worker is busy, a batch line gives its own up."""
    engine = ScriptedEngine(pieces=("x",) * 40, step_s=0.01)
    c = await client(aiohttp_client, tmp_path, engine, max_concurrent=2, max_queue=4)
    f = await (await upload(c, jsonl(*[line(f"id{i}", max_tokens=40) for i in range(6)]))).json()
    b = await (
        await c.post(
            "/v1/batches", json={"input_file_id": f["id"], "endpoint": bf.CHAT, "completion_window": "24h"}
        )
    ).json()
    await wait_status(c, f"/v1/batches/{b['id']}", "status", ("in_progress",))
    await asyncio.sleep(0.05)
    slot = c.server.app[BATCHES].registry.slots["m"]
    assert slot.admitted <= 1  # one batch line at a time: the other worker is kept
    ask = {"messages": [{"role": "user", "content": "now"}], "max_tokens": 3}
    replies = await asyncio.gather(*(c.post("/v1/chat/completions", json=ask) for _ in range(2)))
    assert [r.status for r in replies] == [200, 200]
    b = await wait_status(c, f"/v1/batches/{b['id']}", "status", ("completed",), timeout=20)
    out = await content(c, b["output_file_id"])
    assert len(out) == 6 and all(r["response"]["body"]["usage"]["completion_tokens"] == 40 for r in out)


# -- Anthropic ------------------------------------------------------------------------------------
def params(text: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": text}], **kw}


@pytest.mark.asyncio
async def test_message_batches(aiohttp_client, tmp_path: Path) -> None:
    c = await client(aiohttp_client, tmp_path)
    reqs = [
        {"custom_id": "a", "params": params()},
        {"custom_id": "b", "params": params(tools=[{"name": "f", "input_schema": {}}])},
        {"custom_id": "c", "params": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}},
    ]
    resp = await c.post("/v1/messages/batches", json={"requests": reqs})
    assert resp.status == 200, await resp.text()
    b = await resp.json()
    assert (
        b["type"] == "message_batch" and b["processing_status"] == "in_progress" and b["results_url"] is None
    )
    assert b["request_counts"] == {"processing": 3, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    assert (await c.get(f"/v1/messages/batches/{b['id']}/results")).status == 404
    b = await wait_status(c, f"/v1/messages/batches/{b['id']}", "processing_status", ("ended",))
    assert b["request_counts"] == {"processing": 0, "succeeded": 1, "errored": 2, "canceled": 0, "expired": 0}
    assert b["ended_at"].endswith("Z") and b["results_url"].endswith(
        f"/v1/messages/batches/{b['id']}/results"
    )
    resp = await c.get(f"/v1/messages/batches/{b['id']}/results")
    results = [json.loads(x) for x in (await resp.read()).splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "b", "c"]
    live = await (await c.post("/v1/messages", json=params())).json()
    msg = results[0]["result"]["message"]
    assert results[0]["result"]["type"] == "succeeded" and msg["content"] == live["content"]
    assert msg["usage"] == live["usage"] and msg["type"] == "message"
    assert (
        results[1]["result"]["type"] == "errored"
        and "tools" in results[1]["result"]["error"]["error"]["message"]
    )
    assert results[2]["result"]["error"]["error"]["type"] == "invalid_request_error"
    listed = await (await c.get("/v1/messages/batches")).json()
    assert [x["id"] for x in listed["data"]] == [b["id"]] and listed["has_more"] is False
    assert (await c.get("/v1/batches")).status == 200 and not (await (await c.get("/v1/batches")).json())[
        "data"
    ]
    assert (await c.get(f"/v1/batches/{b['id']}")).status == 404  # another API's batch
    deleted = await (await c.delete(f"/v1/messages/batches/{b['id']}")).json()
    assert deleted == {"id": b["id"], "type": "message_batch_deleted"}


@pytest.mark.asyncio
async def test_message_batches_refused(aiohttp_client, tmp_path: Path) -> None:
    c = await client(aiohttp_client, tmp_path)
    dup = [{"custom_id": "a", "params": params()}, {"custom_id": "a", "params": params()}]
    for body, match in [
        ({"requests": dup}, "requests.1.custom_id: 'a' is already used by requests.0"),
        ({"requests": [{"custom_id": "a b", "params": params()}]}, "requests.0.custom_id"),
        ({"requests": []}, "requests"),
        ({"requests": [{"custom_id": "a"}]}, "params"),
    ]:
        resp = await c.post("/v1/messages/batches", json=body)
        err = await resp.json()
        assert resp.status == 400 and err["type"] == "error" and match in err["error"]["message"], err
    resp = await c.get("/v1/messages/batches/msgbatch_nope")
    assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found_error"


@pytest.mark.asyncio
async def test_message_batch_cancel(aiohttp_client, tmp_path: Path) -> None:
    gate = threading.Event()
    c = await client(aiohttp_client, tmp_path, ScriptedEngine(gate=gate))
    reqs = [{"custom_id": f"r{i}", "params": params()} for i in range(5)]
    b = await (await c.post("/v1/messages/batches", json={"requests": reqs})).json()
    await asyncio.sleep(0.1)
    got = await (await c.post(f"/v1/messages/batches/{b['id']}/cancel")).json()
    assert got["processing_status"] == "canceling" and got["cancel_initiated_at"]
    gate.set()
    b = await wait_status(c, f"/v1/messages/batches/{b['id']}", "processing_status", ("ended",))
    counts = b["request_counts"]
    assert counts["canceled"] >= 3 and counts["canceled"] + counts["succeeded"] == 5
    results = [
        json.loads(x)
        for x in (await (await c.get(b["results_url"].split(str(c.server.port))[1])).read()).splitlines()
    ]
    assert {r["result"]["type"] for r in results} <= {"canceled", "succeeded"}
