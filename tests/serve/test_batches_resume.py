"""Both batch runners survive being killed: the local runner (cli/batch_run.run_batch_file) killed
mid-file and rerun, and a real `goinfer serve` process killed with SIGKILL mid-batch and restarted
on the same --batch-dir. No line is run twice into the output and none is lost. Fake engines (a
slow ScriptedEngine) stand in for the model, loaded through the CLI's own paths."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fake_engine import ScriptedEngine
from goinfer.cli import batch_run
from serve_process import free_port, wait_healthy

TESTS = Path(__file__).resolve().parents[1]
KEY = "k"


def chat(cid: str, text: str = "hi", **body: Any) -> str:
    msgs = [{"role": "user", "content": text}]
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": msgs, **body},
        }
    )


def write_input(path: Path, n: int, **body: Any) -> Path:
    path.write_text("".join(chat(f"id{i}", f"question {i}", **body) + "\n" for i in range(n)))
    return path


def ids_of(path: Path) -> list[str]:
    return [json.loads(x)["custom_id"] for x in path.read_bytes().splitlines()]


# -- the local runner, in this process ------------------------------------------------------------
@pytest.fixture
def fake_model(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    loaded: list[Any] = []

    def load(ref: str, max_concurrent: int, self_test: bool) -> ScriptedEngine:
        loaded.append((ref, max_concurrent))
        engine = ScriptedEngine()
        loaded.append(engine)
        return engine

    monkeypatch.setattr(batch_run, "_load", load)
    return loaded


def test_local_runner_answers_every_line_then_has_nothing_to_do(
    tmp_path: Path, fake_model: list[Any]
) -> None:
    src, out = write_input(tmp_path / "in.jsonl", 12), tmp_path / "out.jsonl"
    said: list[str] = []
    assert (
        batch_run.run_batch_file("m.giw", src, out, max_concurrent=3, overrides={}, progress=said.append) == 0
    )
    assert sorted(ids_of(out)) == sorted(f"id{i}" for i in range(12))
    assert fake_model[0] == ("m.giw", 3)
    engine = fake_model[1]
    assert {p.temperature for p in engine.params} == {1.0} and {p.max_tokens for p in engine.params} == {512}
    rec = json.loads(out.read_bytes().splitlines()[0])
    assert rec["response"]["status_code"] == 200 and rec["error"] is None
    assert rec["response"]["body"]["choices"][0]["message"]["content"] == "Hello world!"
    lines = [s for s in said if s.startswith("[")]
    assert len(lines) == 12 and " ok 5 tok " in lines[0] and "tok/s elapsed" in lines[0]
    assert (
        "eta" not in lines[8] and " eta ~" in lines[9] and "eta" not in lines[11]
    )  # after ten; none at the end
    assert (tmp_path / "out.errors.jsonl").read_bytes() == b""
    fake_model.clear()
    said.clear()
    assert (
        batch_run.run_batch_file("m.giw", src, out, max_concurrent=3, overrides={}, progress=said.append) == 0
    )
    assert fake_model == [] and said == [f"nothing to do: all 12 lines are in {out}"]  # no model loaded


def test_local_runner_overrides_and_failed_lines(tmp_path: Path, fake_model: list[Any]) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([chat("a", temperature=0.5), chat("b", logprobs=True), chat("c", n=3)]) + "\n")
    said: list[str] = []
    overrides = {"temperature": 0.0, "seed": 7, "max_tokens": 3, "system": "be brief"}
    assert (
        batch_run.run_batch_file("m", src, out, max_concurrent=2, overrides=overrides, progress=said.append)
        == 1
    )
    engine = fake_model[1]
    (p,) = engine.params
    assert (p.temperature, p.seed, p.max_tokens) == (0.0, 7, 3)
    assert engine.messages[0] == {"role": "system", "content": "be brief"}
    errs = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_bytes().splitlines()]
    assert {e["custom_id"]: e["error"]["code"] for e in errs} == {
        "b": "unsupported_in_batch",
        "c": "unsupported_in_batch",
    }
    assert "logprobs" in errs[0]["error"]["message"] or "logprobs" in errs[1]["error"]["message"]
    assert ids_of(out) == ["a"] and any("b failed (unsupported_in_batch)" in s for s in said)
    # a rerun tries the failed lines again (and only them); the errors file holds this run's failures
    src.write_text("\n".join([chat("a"), chat("b"), chat("c", n=3)]) + "\n")
    assert batch_run.run_batch_file("m", src, out, max_concurrent=2, overrides={}, progress=said.append) == 1
    assert sorted(ids_of(out)) == ["a", "b"] and ids_of(tmp_path / "out.errors.jsonl") == ["c"]


def test_local_runner_refuses_a_file_that_is_not_a_batch_file(tmp_path: Path, fake_model: list[Any]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(chat("a") + "\n" + chat("a") + "\n")
    with pytest.raises(ValueError, match="line 2: custom_id 'a' is already used on line 1"):
        batch_run.run_batch_file("m", src, tmp_path / "o.jsonl", max_concurrent=1, overrides={})
    assert fake_model == []


# -- the local runner, killed ---------------------------------------------------------------------
RUNNER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from fake_engine import ScriptedEngine
from goinfer.cli import batch_run
batch_run._load = lambda ref, n, st: ScriptedEngine(step_s=0.04)
src, out = Path(sys.argv[1]), Path(sys.argv[2])
sys.exit(batch_run.run_batch_file("m", src, out, max_concurrent=2, overrides={{}}))
"""


def runner(src: Path, out: Path, log: Path) -> subprocess.Popen:
    code = RUNNER.format(tests=str(TESTS))
    return subprocess.Popen([sys.executable, "-c", code, str(src), str(out)], stderr=log.open("w"))


def wait_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not (path.exists() and len(path.read_bytes().splitlines()) >= n):
        assert proc.poll() is None and time.monotonic() < end, proc.returncode
        time.sleep(0.01)


def test_local_runner_killed_mid_file_resumes_without_duplicates(tmp_path: Path) -> None:
    src, out, log = write_input(tmp_path / "in.jsonl", 30), tmp_path / "out.jsonl", tmp_path / "err.log"
    proc = runner(src, out, log)
    wait_lines(out, 5, proc)
    proc.kill()  # SIGKILL: no cleanup at all
    proc.wait()
    with out.open("ab") as f:
        f.write(b'{"id": "batch_req_x", "custom_id": "id2')  # and a power cut tore the last write
    first = ids_of_whole(out)
    assert 5 <= len(first) < 30
    proc = runner(src, out, log)
    wait_lines(out, len(first) + 3, proc)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(timeout=30) == 130
    assert "interrupted" in log.read_text()
    proc = runner(src, out, log)
    assert proc.wait(timeout=60) == 0
    got = ids_of(out)
    assert sorted(got) == sorted(f"id{i}" for i in range(30)) and len(got) == len(set(got)) == 30
    assert got[: len(first)] == first  # what was done stayed as it was
    assert "nothing to do" not in log.read_text() and "[30/30]" in log.read_text()


def ids_of_whole(path: Path) -> list[str]:
    out = []
    for raw in path.read_bytes().splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break
        out.append(json.loads(raw)["custom_id"])
    return out


# -- a real `goinfer serve` process, killed -------------------------------------------------------
SERVE = """
import sys
sys.path.insert(0, {tests!r})
from fake_engine import ScriptedEngine
from goinfer.cli import main as cli
cli.engine_loader = lambda *a, **k: (lambda name, ref, quant: ScriptedEngine(step_s=0.05))
cli.main(sys.argv[1:], prog_name="goinfer")
"""


def serve(batch_dir: Path, port: int, log: Path) -> subprocess.Popen:
    code = SERVE.format(tests=str(TESTS))
    cmd = [sys.executable, "-c", code, "serve", "--model", "m=fake.giw", "--addr", f"127.0.0.1:{port}"]
    cmd += ["--api-key", KEY, "--batch-dir", str(batch_dir), "--no-selftest"]
    proc = subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, env=os.environ)
    wait_healthy(proc, f"http://127.0.0.1:{port}/health", KEY, log, timeout=60)
    return proc


def call(
    port: int, method: str, path: str, body: bytes | None = None, ctype: str = "application/json"
) -> Any:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method)
    req.add_header("Authorization", f"Bearer {KEY}")
    if body is not None:
        req.add_header("Content-Type", ctype)
    with urllib.request.urlopen(req, timeout=10) as r:
        data = r.read()
    return json.loads(data) if r.headers.get("Content-Type", "").startswith("application/json") else data


def multipart(data: bytes) -> tuple[bytes, str]:
    b = "zzboundary"
    body = (
        (
            f'--{b}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{b}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={b}"


def test_serve_killed_mid_batch_resumes_where_it_was(tmp_path: Path) -> None:
    batch_dir, log, port = tmp_path / "batches", tmp_path / "serve.log", free_port()
    proc = serve(batch_dir, port, log)
    try:
        f = call(port, "POST", "/v1/files", *multipart(write_input(tmp_path / "in.jsonl", 24).read_bytes()))
        ask = {"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        b = call(port, "POST", "/v1/batches", json.dumps(ask).encode())
        end = time.monotonic() + 60
        while call(port, "GET", f"/v1/batches/{b['id']}")["request_counts"]["completed"] < 4:
            assert time.monotonic() < end
            time.sleep(0.02)
    finally:
        proc.kill()  # kill -9, lines in flight
        proc.wait()
    results = batch_dir / "batches" / b["id"] / "results.jsonl"
    before = ids_of(results)
    assert 4 <= len(before) < 24 and len(set(before)) == len(before)
    port = free_port()
    proc = serve(batch_dir, port, log)
    try:
        end = time.monotonic() + 60
        while (got := call(port, "GET", f"/v1/batches/{b['id']}"))["status"] != "completed":
            assert time.monotonic() < end, got
            time.sleep(0.05)
        out = call(port, "GET", f"/v1/files/{got['output_file_id']}/content")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert (
        got["request_counts"] == {"total": 24, "completed": 24, "failed": 0} and got["error_file_id"] is None
    )
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["custom_id"] for x in lines] == [f"id{i}" for i in range(24)]  # none lost, in order
    after = ids_of(results)
    assert after[: len(before)] == before and len(after) == len(set(after)) == 24  # none run twice
    assert "batches: uploads and batch state under" in log.read_text()
