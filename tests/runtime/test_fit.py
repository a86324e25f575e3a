"""runtime/fit.py on fake figures: fits, shrinks the context by halves to 4,096 with a line each,
refuses an explicit --ctx or --kv-tokens in one line; and the CLI's use of it (check --fit, serve)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from goinfer.cli.main import main
from goinfer.runtime import fit
from goinfer.runtime.fit import FitError, GiB, MiB, ModelCost, plan

# a 7B-ish model: 4 GiB of weights, 128 KiB of KV a token (32 layers x 2 x 8 heads x 128 x f32), 32k window
COST = ModelCost("m", weights=4 * GiB, kv_per_token=128 * 1024, window=32768, scratch=512 * MiB)


def avail(n: int | None):
    return lambda: n


def test_a_model_that_fits_keeps_its_context() -> None:
    lines: list[str] = []
    f = plan(COST, memory=avail(16 * GiB), log=lines.append)
    assert f.context == 0 and f.shrunk_from is None  # 0: the model's own window
    assert f.price.kv == 32768 * 128 * 1024 == 4 * GiB and f.price.total == 8 * GiB + 512 * MiB
    assert lines == [] and f.lines[0].endswith(": fits")  # nothing to say at load: it changed nothing
    assert "weights 4.00 GiB (mapped) + KV 4.00 GiB (32,768 tokens) + scratch 512.0 MiB" in f.lines[0]


def test_the_context_shrinks_by_halves_and_logs_each_step() -> None:
    lines: list[str] = []
    # 4 GiB weights + 0.5 scratch + KV: 16k costs 2 GiB, 8k 1 GiB: 5.6 GiB fits only at 8k
    f = plan(COST, memory=avail(int(5.6 * GiB)), log=lines.append)
    assert (f.context, f.shrunk_from) == (8192, 32768)
    assert [line.split(" (does not fit")[0] for line in lines] == [
        "fit: m: context 32,768 -> 16,384",
        "fit: m: context 16,384 -> 8,192",
    ]
    assert f.price.kv_tokens == 8192 and f.price.fits


def test_the_shrink_stops_at_4096() -> None:
    with pytest.raises(FitError) as e:
        plan(COST, memory=avail(4 * GiB))  # not even the weights fit
    assert "does not fit even at context 4,096" in str(e.value) and "\n" not in str(e.value)
    lines: list[str] = []
    f = plan(COST, memory=avail(int(5.1 * GiB)), log=lines.append)  # 4,096 tokens: 0.5 GiB of KV
    assert f.context == fit.MIN_CONTEXT == 4096 and len(lines) == 3


def test_an_explicit_ctx_or_kv_tokens_is_refused_in_one_line_with_the_figures() -> None:
    with pytest.raises(FitError) as e:
        plan(COST, context=32768, memory=avail(6 * GiB))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("m does not fit with --ctx 32768: ")
    assert "weights 4.00 GiB (mapped) + KV 4.00 GiB (32,768 tokens) + scratch 512.0 MiB (estimate)" in msg
    assert "= 8.50 GiB, against 6.00 GiB available" in msg
    with pytest.raises(FitError, match="with --kv-tokens 65536"):
        plan(COST, kv_tokens=65536, memory=avail(6 * GiB))
    # an explicit --ctx that fits is kept as given (and a larger one than the window is capped)
    assert plan(COST, context=8192, memory=avail(6 * GiB)).context == 8192
    assert plan(COST, context=99999, memory=avail(9 * GiB)).price.kv_tokens == 32768


def test_unknown_memory_is_not_checked() -> None:
    f = plan(COST, memory=avail(None))
    assert f.context == 0 and f.lines[0].endswith("MemAvailable unknown: not checked")


def test_meminfo_and_kv_bytes() -> None:
    text = "MemTotal: 16384 kB\nMemAvailable:    8192 kB\nSwapTotal: 0 kB\n"
    assert fit.meminfo(text)["MemAvailable"] == 8192 * 1024
    assert fit.mem_available(lambda: text) == 8192 * 1024

    def gone() -> str:
        raise FileNotFoundError("/proc/meminfo")

    assert fit.mem_available(gone) is None


def test_the_price_of_a_real_bundle_matches_the_loaded_model(tiny_bundle) -> None:
    from goinfer.artifacts import giw
    from goinfer.artifacts.manifest import Manifest
    from goinfer.runtime.model import Model

    path = tiny_bundle("qwen2", "f32")
    with giw.open_bundle(path, verify="none") as b:
        cost = ModelCost.of("tiny", b, Manifest.of(b))
    model = Model.load(path, self_test=False)
    try:
        assert cost.kv_per_token == model.kv_bytes_per_token and cost.window == model.context_length
        assert cost.weights == sum(model.bundle.tensor_info(p).nbytes for p in model.manifest.params) > 0
        assert cost.scratch > fit.RUNTIME_ALLOWANCE
    finally:
        model.bundle.close()


def test_check_hardware_fit_prints_the_decisions(tiny_bundle, monkeypatch) -> None:
    path = str(tiny_bundle("qwen2", "f32"))
    monkeypatch.setattr(fit, "mem_available", lambda: 64 * GiB)
    res = CliRunner().invoke(main, ["check", "--hardware", "--fit", path])
    assert res.exit_code == 0, res.output
    got = [line for line in res.stdout.splitlines() if line.startswith("fit       ")]
    assert len(got) == 1 and "context 256: weights" in got[0] and got[0].endswith(": fits"), got
    monkeypatch.setattr(fit, "mem_available", lambda: 1 * MiB)
    res = CliRunner().invoke(main, ["check", "--hardware", "--fit", path, "--ctx", "128"])
    got = [line for line in res.stdout.splitlines() if line.startswith("fit       ")]
    assert len(got) == 1 and got[0].startswith(f"fit       refused: {path} does not fit with --ctx 128: "), (
        got
    )
    assert "against 1.0 MiB available" in got[0]


def test_serve_refuses_an_explicit_ctx_that_does_not_fit(tiny_bundle, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(fit, "mem_available", lambda: 1 * MiB)
    path = tiny_bundle("qwen2", "f32")
    res = CliRunner().invoke(
        main,
        ["serve", "--model", f"tiny={path}", "--no-selftest", "--ctx", "128"],
        env={"GOINFER_API_KEY": ""},
    )
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "tiny does not fit with --ctx 128: weights " in lines[0], lines
