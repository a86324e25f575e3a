"""`goinfer serve` as a user starts it: refusals before any load, the banner, and a real tiny model
served through the real engine adapter."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner
from goinfer.cli.main import main


def _run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], env={"GOINFER_API_KEY": "", **(env or {})})


def _one_line_error(result, needle: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("goinfer: error: ") and needle in lines[0], lines


def test_serve_refuses_before_loading_anything(tmp_path: Path) -> None:
    missing = tmp_path / "missing.giw"
    _one_line_error(_run("serve", "--addr", "0.0.0.0:8080", "--model", missing), "not loopback")
    _one_line_error(_run("serve", "--addr", "[::]:9000", "--model", missing), "--api-key")
    _one_line_error(_run("serve", "--addr", "localhost", "--model", missing), "HOST:PORT")
    _one_line_error(_run("serve", "--tls-cert", tmp_path / "c.pem", "--model", missing), "--tls-key")
    (tmp_path / "junk.pem").write_text("not a certificate")
    junk = tmp_path / "junk.pem"
    _one_line_error(
        _run("serve", "--tls-cert", junk, "--tls-key", junk, "--model", missing), "cannot load --tls"
    )
    _one_line_error(_run("serve", "--model", f"a={missing}", "--model", f"a={missing}"), "given twice")
    # With the key from the environment the address is allowed; then the missing bundle is the error.
    _one_line_error(
        _run("serve", "--addr", "0.0.0.0:8080", "--model", missing, env={"GOINFER_API_KEY": "k"}),
        "missing.giw",
    )


@pytest.fixture
def served(tiny_bundle, monkeypatch):
    """Run `goinfer serve` with the listening step replaced: returns (result, app, config)."""
    from goinfer.serve import server

    got = {}
    monkeypatch.setattr(server, "run", lambda app, config, ctx: got.update(app=app, config=config))

    def serve(*args: str, env: dict[str, str] | None = None):
        result = _run(
            "serve", "--model", f"tiny={tiny_bundle('qwen2', 'f32')}", "--no-selftest", *args, env=env
        )
        assert result.exit_code == 0, result.output
        return result, got["app"], got["config"]

    return serve


def test_banner_names_each_model_and_the_caps(served, tiny_bundle) -> None:
    result, _app, config = served("--max-body-bytes", "2048", "--max-queue", "3")
    out = result.stdout
    assert "OpenAI base URL http://127.0.0.1:8080/v1" in out
    assert f"model tiny: {tiny_bundle('qwen2', 'f32')} (quant f32, target llvm" in out
    assert "context window 256" in out
    assert "body caps: every route 2 KiB" in out
    assert "concurrency: 4 generations per model at once, 3 waiting; admin routes off" in out
    assert "KV cache 256 tokens x " in out and "16 warm sessions kept" in out
    assert "WARNING: no API key" in out
    assert config.max_queue == 3 and config.api_key is None

    keyed, _app, config = served("--addr", "0.0.0.0:8123", "--api-key", "k", "--allow-admin")
    assert "no API key" not in keyed.stdout and "off loopback without TLS" in keyed.stdout
    assert "admin routes on (unload drain wait 5s)" in keyed.stdout
    assert (config.host, config.port, config.api_key) == ("0.0.0.0", 8123, "k")


def test_a_tiny_real_model_serves_what_generate_gives(served, tiny_bundle) -> None:
    from goinfer.runtime.decode import GenerationRequest
    from goinfer.runtime.model import Model
    from goinfer.runtime.sampler import SamplingParams

    model = Model.load(tiny_bundle("qwen2", "f32"), self_test=False)
    messages = [{"role": "user", "content": "Name a prime."}]
    ids = model.chat_prompt(messages)
    events = list(model.generate(GenerationRequest(ids, SamplingParams(temperature=0, max_tokens=10))))
    _result, app, _config = served()

    async def ask() -> tuple[dict, dict]:
        async with TestClient(TestServer(app)) as client:
            body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 10}
            chat = await (await client.post("/v1/chat/completions", json=body)).json()
            listing = await (await client.get("/v1/models")).json()
            again = await (await client.post("/v1/chat/completions", json=body)).json()
            for _ in range(100):  # the finished sequence goes back to the pool just after the reply
                health = await (await client.get("/health")).json()
                if health["models"]["tiny"]["sessions_running"] == 0:
                    break
                await asyncio.sleep(0.02)
            return chat, listing, again, health

    chat, listing, again, health = asyncio.run(ask())
    assert health["models"]["tiny"]["target"].startswith("llvm/")
    assert [r["backend"] for r in health["models"]["tiny"]["selftest"]] == ["cpu"]
    assert chat["choices"][0]["message"]["content"] == "".join(e.text for e in events)
    assert chat["choices"][0]["finish_reason"] == events[-1].finish_reason
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert chat["usage"]["completion_tokens"] == sum(e.token_id is not None for e in events)
    # The same request again: all of its prompt but the last token is reused (runtime/kv_pool.py),
    # from the one warm conversation, and the reply is the same
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": len(ids) - 1}
    assert again["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]
    tiny = health["models"]["tiny"]
    assert tiny["sessions_warm"] == 1 and tiny["sessions_running"] == 0
    assert tiny["pages_used"] > 0 and tiny["pages_free"] > 0 and tiny["page_size"] == 16
    entry = listing["data"][0]
    assert entry["id"] == "tiny" and entry["context_window"] == 256 and entry["vision"] is False
    assert entry["decode_path"].startswith("llvm") and "f32" in entry["decode_path"]


def test_model_specs_are_named_by_zoo_name_or_stem() -> None:
    from goinfer.compiler.resolve import model_specs

    assert model_specs(("smollm2-135m", "x=/m/a.gguf", "/m/b.giw")) == [
        ("smollm2-135m", "smollm2-135m"),
        ("x", "/m/a.gguf"),
        ("b", "/m/b.giw"),
    ]


def test_the_knobs_reach_the_configs_that_own_them(served) -> None:
    """One --max-concurrent: the scheduler's, and the registry admits as many; origins repeat."""
    a, b = "http://a.example", "https://b.example:8443"
    result, app, config = served(
        "--max-concurrent", "2", "--cors-origin", a, "--cors-origin", b, "--temp", "0.5"
    )
    assert config.max_concurrent == 2 and config.cors_origins == (a, b)
    assert config.sampling.temperature == 0.5 and config.sampling.top_p == 1.0
    assert "concurrency: 2 generations per model at once" in result.stdout
    from goinfer.serve.keys import REGISTRY

    (slot,) = app[REGISTRY].slots.values()
    assert slot.max_concurrent == 2 and slot.engine.scheduler.config.max_concurrent == 2


def test_serve_takes_the_bundle_as_its_argument_and_a_device(tiny_bundle, monkeypatch) -> None:
    from goinfer.serve import server

    got = {}
    monkeypatch.setattr(server, "run", lambda app, config, ctx: got.update(app=app))
    bundle = tiny_bundle("qwen2", "f32")
    result = _run("serve", bundle, "--device", "cpu", "--no-selftest")
    assert result.exit_code == 0, result.output
    assert f"model {bundle.stem}: {bundle} (quant f32, target llvm/" in result.stdout
    # This bundle has no CUDA module: asking for the GPU is a one-line error naming the fix.
    _one_line_error(_run("serve", bundle, "--device", "cuda"), "has no CUDA module (built for llvm)")
    _one_line_error(_run("serve", bundle, "--device", "tpu"), "'tpu' is not one of")


def test_an_admin_load_says_what_is_wrong_with_a_file_never_what_it_holds(
    tmp_path: Path, monkeypatch
) -> None:
    """POST /admin/models/load reads whatever path it is given, through the loader `serve` uses: a
    file that is no model (here a stand-in for /etc/shadow) is refused saying what is wrong with
    it, and none of its bytes come back."""
    from goinfer.cli.main import engine_loader
    from goinfer.compiler.build import BuildOptions
    from goinfer.serve.app import create_app
    from goinfer.serve.config import ServeConfig

    monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / "cache"))
    secret = b"root:secret:19000:0:99999:7:::\n"
    (tmp_path / "shadow").write_bytes(secret)
    (tmp_path / "shadow.gguf").write_bytes(secret)
    (tmp_path / "shadow.giw").write_bytes(secret)
    for name, body in (("notjson", secret), ("notutf8", b"\xff" + secret)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_bytes(body)
    why = {
        "shadow": "not a GGUF file",
        "shadow.gguf": "not a GGUF file",
        "shadow.giw": "bad magic",
        "notjson": "config.json: not JSON",
        "notutf8": "config.json: not UTF-8",
    }
    app = create_app({}, ServeConfig(allow_admin=True), loader=engine_loader(BuildOptions()))

    async def load_each() -> dict[str, tuple[int, str]]:
        got = {}
        async with TestClient(TestServer(app)) as client:
            for name in why:
                resp = await client.post("/admin/models/load", json={"path": str(tmp_path / name)})
                got[name] = (resp.status, await resp.text())
        return got

    for name, (status, text) in asyncio.run(load_each()).items():
        assert status == 400 and why[name] in text, (name, text)
        said = text.replace(str(tmp_path), "<dir>")  # the path is the caller's own (and may hold "root")
        assert "root" not in said and "secret" not in said and "\\u00ff" not in said, (name, said)
