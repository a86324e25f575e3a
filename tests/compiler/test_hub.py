"""hf: pulls (compiler.sources.hub) against a local server speaking the Hub's HTTP (tests/hub_server.py)."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from goinfer.compiler.sources import hub
from goinfer.compiler.sources.base import SourceError
from hub_server import HubServer
from huggingface_hub import constants as hf_constants
from huggingface_hub import file_download, hf_hub_download


def _blob(tag: str, size: int) -> bytes:
    """Distinct, deterministic bytes (every file must differ: the fake CDN serves by sha256)."""
    return hashlib.shake_256(tag.encode()).digest(size)


def _config(model_type: str = "qwen2") -> bytes:
    return json.dumps({"model_type": model_type, "torch_dtype": "bfloat16", "hidden_size": 64}).encode()


SHARDS = [f"Model-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
ST_SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
ST_INDEX = json.dumps(
    {"metadata": {"total_size": 70_000}, "weight_map": {"a": ST_SHARDS[0], "b": ST_SHARDS[1]}}
)
BIG = ["Big-Q4_K_M-00001-of-00002.gguf", "Big-Q4_K_M-00002-of-00002.gguf"]

REPOS: dict[str, dict[str, bytes]] = {
    "o/gguf": {
        "README.md": b"# a model card\n",
        "Model-Q4_K_M.gguf": b"GGUF" + _blob("q4", 20_000),
        "Model-Q8_0.gguf": b"GGUF" + _blob("q8", 30_000),
        "mmproj-F16.gguf": b"GGUF" + _blob("mm", 5_000),
    },
    "o/split": {
        **{name: b"GGUF" + _blob(name, 9_000 + i) for i, name in enumerate(SHARDS)},
        "Model-Q8_0.gguf": b"GGUF" + _blob("split-q8", 10_000),
    },
    "o/split-missing": {n: b"GGUF" + _blob("m" + n, 4_000) for n in (SHARDS[0], SHARDS[2])},
    "o/st": {
        "README.md": b"# card\n",
        "config.json": _config(),
        "tokenizer.json": b'{"model": {"type": "BPE"}}',
        "tokenizer_config.json": b'{"eos_token": "<|im_end|>"}',
        "generation_config.json": b'{"do_sample": false}',
        "model.safetensors.index.json": ST_INDEX.encode(),
        ST_SHARDS[0]: _blob("st1", 40_000),
        ST_SHARDS[1]: _blob("st2", 30_000),
        "original/consolidated.pth": _blob("pth", 1_000),
    },
    "o/st-missing": {
        "config.json": _config(),
        "tokenizer.json": b"{}",
        "model.safetensors.index.json": ST_INDEX.encode(),
        ST_SHARDS[0]: _blob("stm1", 40_000),
    },
    "o/mamba": {
        "config.json": _config("mamba"),
        "tokenizer.json": b"{}",
        "model.safetensors": _blob("mamba", 10_000),
    },
    "o/no-tokenizer": {"config.json": _config(), "model.safetensors": _blob("notok", 10_000)},
    "o/gated": {"config.json": _config(), "Model-Q4_K_M.gguf": b"GGUF" + _blob("gated", 1_000)},
    "o/private": {"Model-Q4_K_M.gguf": b"GGUF" + _blob("private", 1_000)},
    "o/big": {BIG[0]: b"GGUF" + _blob("big1", 50_000), BIG[1]: _blob("big2", 1 << 20)},
}


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HF_HOME and the goinfer cache under tmp_path, online; returns the goinfer cache root."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("GOINFER_CACHE", str(tmp_path / "cache"))
    # huggingface_hub reads this at import: it keeps the killed-pull subprocess from asking the real
    # Hub for its agent-harness registry (a best-effort call made while building the user agent).
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def server(env: Path, monkeypatch: pytest.MonkeyPatch):
    srv = HubServer(REPOS, gated={"o/gated"}, private={"o/private"}).start()
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    yield srv
    srv.stop()


def _dead_endpoint() -> str:
    """An address nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _pull(ref: str, lines: list[str] | None = None) -> Path:
    return hub.pull(ref, progress=(lines.append if lines is not None else None))


# ---------------------------------------------------------------------------------------------- refs


def test_parse() -> None:
    assert hub.parse("hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:q4_k_m") == hub.HubRef(
        "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "Q4_K_M", "main"
    )
    assert hub.parse("hf:o/r:SafeTensors") == hub.HubRef("o/r", "safetensors")
    ref = hub.parse("hf:o/r@v1.0:Q8_0")
    assert (ref.revision, ref.dirname, str(ref)) == ("v1.0", "Q8_0@v1.0", "hf:o/r@v1.0:Q8_0")
    for bad in ("hf:o/r", "hf:o:Q4_K_M", "o/r:Q4_K_M", "hf:o/r/x:Q4_K_M", "hf:o/r:", "hf:/r:Q4"):
        with pytest.raises(SourceError, match="expected hf:<owner>/<repo>:<QUANT>"):
            hub.parse(bad)


def test_quants_in_file_names() -> None:
    names = [
        "a-Q4_K_M.gguf",
        "a-q8_0.gguf",
        "a-IQ2_XXS.gguf",
        "b.UD-Q4_K_XL-00001-of-00002.gguf",
        "c-BF16.gguf",
    ]
    assert hub.quants_in(names) == ["BF16", "IQ2_XXS", "Q4_K_M", "Q8_0", "UD-Q4_K_XL"]


# ---------------------------------------------------------------------------------------------- pulls


def test_pull_gguf_quant(server: HubServer, env: Path) -> None:
    lines: list[str] = []
    path = _pull("hf:o/gguf:q4_k_m", lines)  # the quant matches whatever its case
    assert path == env / "hub" / "o--gguf" / "Q4_K_M" / "Model-Q4_K_M.gguf"
    assert path.read_bytes() == REPOS["o/gguf"]["Model-Q4_K_M.gguf"]
    assert sorted(p.name for p in path.parent.iterdir()) == [".goinfer-pull.json", "Model-Q4_K_M.gguf"]
    marker = json.loads((path.parent / ".goinfer-pull.json").read_text())
    assert marker["repo"] == "o/gguf" and marker["commit"] == server.repos["o/gguf"].commit
    assert marker["files"][0]["size"] == path.stat().st_size
    # Only the chosen file moved: not the other quant, the projector or the card.
    assert {h.path.rsplit("/", 1)[-1] for h in server.file_requests()} == {"Model-Q4_K_M.gguf"}
    assert any("plan at commit" in ln for ln in lines) and any("Model-Q4_K_M.gguf" in ln for ln in lines)
    # A complete pull is returned from the cache without asking the Hub again.
    n = len(server.hits())
    assert _pull("hf:o/gguf:Q4_K_M") == path
    assert len(server.hits()) == n


def test_pull_split_gguf(server: HubServer) -> None:
    path = _pull("hf:o/split:Q4_K_M")
    assert path.name == SHARDS[0]
    for name in SHARDS:  # side by side, as the split-GGUF loader wants them
        assert (path.parent / name).read_bytes() == REPOS["o/split"][name]
    assert "Model-Q8_0.gguf" not in {h.path.rsplit("/", 1)[-1] for h in server.file_requests()}


def test_pull_safetensors(server: HubServer, env: Path) -> None:
    lines: list[str] = []
    out = _pull("hf:o/st:safetensors", lines)
    assert out == env / "hub" / "o--st" / "safetensors" and out.is_dir()
    want = {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        *ST_SHARDS,
    }
    assert {p.name for p in out.iterdir()} == want | {".goinfer-pull.json"}
    for name in want:
        assert (out / name).read_bytes() == REPOS["o/st"][name]
    assert len(server.hits("config.json", "GET")) == 1  # read while planning, not fetched twice
    assert not server.hits("README.md") and not server.hits("original/consolidated.pth")
    flag = [ln for ln in lines if "full-precision" in ln]
    assert len(flag) == 1 and "about 4x a GGUF q4" in flag[0], lines
    assert json.loads((out / ".goinfer-pull.json").read_text())["family"] == "qwen2"


def test_plan_lists_files_before_any_weight_moves(server: HubServer) -> None:
    lines: list[str] = []
    p = hub.plan("hf:o/st:safetensors", progress=lines.append)
    assert [f.name for f in p.files if f.weight] == ST_SHARDS
    assert p.weight_bytes == 70_000 and p.family == "qwen2" and p.kind == "safetensors"
    by_name = {f.name: f for f in p.files}
    assert by_name[ST_SHARDS[0]].sha256 and by_name["config.json"].blob_id
    assert server.weight_gets() == []
    assert f"  {ST_SHARDS[0]}  0.0 MB" in lines


# ------------------------------------------------------------------------------- interruption, resume


KILLED_PULL = """
import sys
from huggingface_hub import constants
constants.DOWNLOAD_CHUNK_SIZE = 1 << 16  # small writes, so part of the file is on disk when killed
from goinfer.compiler.sources import hub
hub.pull(sys.argv[1], progress=None)
"""


def _wait(cond, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"pull exited early: {proc.stderr.read().decode() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the pull to stall")
        time.sleep(0.02)


def test_killed_pull_resumes_with_a_range_request(server: HubServer, env: Path) -> None:
    """SIGKILL mid-download: nothing is published; the next run keeps the finished shard and asks for
    the rest of the partial one with a Range request."""
    server.stall_after[BIG[1]] = 300_000
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_PULL, "hf:o/big:Q4_K_M"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    repo_dir = env / "hub" / "o--big"
    staging = repo_dir / ".partial-Q4_K_M"
    part = staging / (BIG[1] + ".incomplete")
    try:
        _wait(lambda: server.stalled.is_set() and part.is_file() and part.stat().st_size >= 4 << 16, proc)
    finally:
        proc.kill()
        proc.wait()
    server.release()

    assert not (repo_dir / "Q4_K_M").exists() and hub.cached("hf:o/big:Q4_K_M") is None
    assert not (staging / ".goinfer-pull.json").exists()
    assert (staging / BIG[0]).read_bytes() == REPOS["o/big"][BIG[0]]  # finished before the kill
    have = part.stat().st_size
    assert 0 < have < len(REPOS["o/big"][BIG[1]])
    first_gets = len(server.hits(BIG[0], "GET"))

    lines: list[str] = []
    path = _pull("hf:o/big:Q4_K_M", lines)
    assert path == repo_dir / "Q4_K_M" / BIG[0]
    assert (path.parent / BIG[1]).read_bytes() == REPOS["o/big"][BIG[1]]
    assert server.hits(BIG[1], "GET")[-1].range == f"bytes={have}-"
    assert len(server.hits(BIG[0], "GET")) == first_gets  # the finished shard was not fetched again
    assert any("resuming" in ln for ln in lines) and any("already fetched" in ln for ln in lines)
    assert not staging.exists()


def test_dropped_connection_is_resumed_within_the_run(
    server: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    server.cut_after[BIG[1]] = 200_000
    path = _pull("hf:o/big:Q4_K_M")
    assert (path.parent / BIG[1]).read_bytes() == REPOS["o/big"][BIG[1]]
    ranges = [h.range for h in server.hits(BIG[1], "GET")]
    assert ranges[0] is None and ranges[-1] is not None and ranges[-1].startswith("bytes=")


def test_hub_lost_mid_download(server: HubServer, env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub goes away mid-file: one line saying to run again, nothing published, and the next run
    (Hub back) resumes the partial file."""
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    monkeypatch.setattr(
        file_download, "time", SimpleNamespace(sleep=lambda _s: None)
    )  # http_get's retry pause
    server.cut_after[BIG[1]] = 200_000
    server.down_after_cut = True
    with pytest.raises(
        SourceError, match=rf"^hf:o/big:Q4_K_M: lost the Hub while fetching {BIG[1]} \(.*\); run"
    ):
        _pull("hf:o/big:Q4_K_M")
    assert hub.cached("hf:o/big:Q4_K_M") is None and not (env / "hub" / "o--big" / "Q4_K_M").exists()
    have = (env / "hub" / "o--big" / ".partial-Q4_K_M" / (BIG[1] + ".incomplete")).stat().st_size
    assert have > 0
    server.down = False
    path = _pull("hf:o/big:Q4_K_M")
    assert (path.parent / BIG[1]).read_bytes() == REPOS["o/big"][BIG[1]]
    assert server.hits(BIG[1], "GET")[-1].range == f"bytes={have}-"


def test_corrupt_download_is_refused_and_nothing_published(server: HubServer, env: Path) -> None:
    server.corrupt.add("Model-Q8_0.gguf")
    with pytest.raises(
        SourceError, match=r"Model-Q8_0.gguf failed verification \(sha256 .*nothing was published"
    ):
        _pull("hf:o/gguf:Q8_0")
    assert not (env / "hub" / "o--gguf" / "Q8_0").exists()
    staging = env / "hub" / "o--gguf" / ".partial-Q8_0"
    assert not list(staging.glob("*.gguf*"))  # the bad bytes are not kept for a resume either
    server.corrupt.clear()
    assert _pull("hf:o/gguf:Q8_0").read_bytes() == REPOS["o/gguf"]["Model-Q8_0.gguf"]


def test_damaged_copy_is_pulled_again(server: HubServer) -> None:
    path = _pull("hf:o/gguf:Q4_K_M")
    path.write_bytes(b"truncated")
    assert hub.cached("hf:o/gguf:Q4_K_M") is None
    assert _pull("hf:o/gguf:Q4_K_M").read_bytes() == REPOS["o/gguf"]["Model-Q4_K_M.gguf"]


# --------------------------------------------------------------------------------------------- offline


def test_complete_pull_resolves_offline(server: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _pull("hf:o/st:safetensors")
    n = len(server.hits())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _pull("hf:o/st:safetensors") == path
    monkeypatch.delenv("HF_HUB_OFFLINE")
    server.stop()  # the Hub gone altogether
    assert _pull("hf:o/st:safetensors") == path
    assert len(server.hits()) == n


def test_no_network_and_no_cache(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", _dead_endpoint())
    with pytest.raises(
        SourceError, match=r"^hf:o/r:Q4_K_M: cannot reach the Hub \(.*\) and no complete copy is cached$"
    ):
        _pull("hf:o/r:Q4_K_M")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        SourceError, match=r"cannot reach the Hub \(HF_HUB_OFFLINE is set\) and no complete copy"
    ):
        _pull("hf:o/r:Q4_K_M")


# ------------------------------------------------------------------------------- refused while planning


def test_gated_repo_refused_before_any_file_is_read(server: HubServer) -> None:
    with pytest.raises(SourceError, match=r"^o/gated is gated: goinfer pulls anonymously only"):
        _pull("hf:o/gated:Q4_K_M")
    assert server.file_requests() == []


def test_private_or_unknown_repo(server: HubServer) -> None:
    for ref in ("hf:o/private:Q4_K_M", "hf:o/nope:Q4_K_M"):
        with pytest.raises(SourceError, match=r"no repo o/\w+ on the Hub \(or it is private"):
            _pull(ref)
    assert server.file_requests() == []


def test_unknown_revision(server: HubServer) -> None:
    with pytest.raises(SourceError, match=r"has no revision 'v9'"):
        _pull("hf:o/gguf@v9:Q4_K_M")


def test_no_gguf_for_the_quant(server: HubServer) -> None:
    with pytest.raises(SourceError) as e:
        _pull("hf:o/gguf:Q5_K_M")
    assert str(e.value) == "hf:o/gguf:Q5_K_M: no GGUF for quant Q5_K_M; the repo has Q4_K_M, Q8_0"
    with pytest.raises(SourceError, match=r"no GGUF files; try hf:o/st:safetensors"):
        _pull("hf:o/st:Q4_K_M")
    assert server.file_requests() == []


def test_missing_gguf_shard_refused_before_any_download(server: HubServer) -> None:
    with pytest.raises(
        SourceError, match=r"missing shard Model-Q4_K_M-00002-of-00003.gguf \(the repo lists 2 of 3\)"
    ):
        _pull("hf:o/split-missing:Q4_K_M")
    assert server.file_requests() == []


def test_missing_safetensors_shard_refused_before_any_weight(server: HubServer, env: Path) -> None:
    with pytest.raises(
        SourceError, match=r"missing shard model-00002-of-00002.safetensors: .*index.json names it"
    ):
        _pull("hf:o/st-missing:safetensors")
    assert server.weight_gets() == []
    assert not (env / "hub" / "o--st-missing" / "safetensors").exists()


def test_unsupported_model_type_refused_before_any_weight(server: HubServer) -> None:
    with pytest.raises(
        SourceError, match=r"^hf:o/mamba:safetensors: unsupported model_type 'mamba'; supported: "
    ):
        _pull("hf:o/mamba:safetensors")
    assert server.weight_gets() == []
    assert len(server.hits("config.json", "GET")) == 1


def test_checkpoint_without_tokenizer_json_refused_before_any_weight(server: HubServer) -> None:
    with pytest.raises(SourceError, match=r"has no tokenizer.json \(only fast-tokenizer checkpoints"):
        _pull("hf:o/no-tokenizer:safetensors")
    assert server.weight_gets() == []


# ------------------------------------------------------------------------------------ the fake itself


def test_fake_hub_serves_huggingface_hub_downloads(server: HubServer, tmp_path: Path) -> None:
    """The stand-in answers hf_hub_download's HEAD + redirect + GET as the Hub does."""
    for name in ("Model-Q4_K_M.gguf", "README.md"):
        got = hf_hub_download(
            "o/gguf",
            name,
            local_dir=tmp_path / "dl",
            cache_dir=tmp_path / "hfc",
            endpoint=server.url,
            token=False,
        )
        assert Path(got).read_bytes() == REPOS["o/gguf"][name]
    assert server.hits("Model-Q4_K_M.gguf", "HEAD")[0].status == 302


def _tiny_encoder_repo() -> dict[str, bytes]:
    """A tiny nomic_bert sentence-transformers repo (tests/tiny_encoder.py), as files."""
    import tempfile

    from tiny_encoder import write_tiny_encoder

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_encoder(Path(tmp) / "enc", "nomic_bert", pooling="cls")
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    return files | {"README.md": b"# an embedding model\n", "onnx/model.onnx": _blob("onnx", 3_000)}


def test_pull_an_encoder_with_its_pooling_and_prompts(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hf:...:safetensors of an encoder brings sentence-transformers' files with the weights: the
    Pooling module's config (in its folder) and the task prompts, which the build reads."""
    from goinfer.compiler.sources import load_checkpoint
    from tiny_encoder import PROMPTS

    repo = _tiny_encoder_repo()
    srv = HubServer({"o/enc": repo}).start()
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    try:
        out = _pull("hf:o/enc:safetensors")
    finally:
        srv.stop()
    fetched = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert fetched == {n for n in repo if n not in ("README.md", "onnx/model.onnx")} | {".goinfer-pull.json"}
    assert json.loads((out / ".goinfer-pull.json").read_text())["family"] == "nomic_bert"
    ckpt = load_checkpoint("hf:o/enc:safetensors")
    assert ckpt.spec.family == "nomic_bert" and ckpt.embedding.pooling == "cls"
    assert dict(ckpt.embedding.prompts) == PROMPTS and ckpt.source == "hf:o/enc:safetensors"
