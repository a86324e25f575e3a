"""The startup self-test: every tier's kernels checked, a failing tier stepped down, all-fail refused."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from goinfer.artifacts import cache, giw
from goinfer.artifacts.manifest import Manifest
from goinfer.cli.main import main
from goinfer.runtime import selftest
from goinfer.runtime.model import Model


@pytest.fixture(autouse=True)
def _fresh_selftest(monkeypatch):
    monkeypatch.setattr(selftest, "_DONE", {})
    monkeypatch.setattr(selftest, "RESULTS", [])
    monkeypatch.delenv("GOINFER_NO_SELFTEST", raising=False)


def test_bundle_carries_tiers_and_fixtures(tiny_bundle):
    with giw.open_bundle(tiny_bundle("qwen2", "int4")) as b:
        m = Manifest.of(b)
        tiers = m.cpu_tiers
        assert tiers[0].module == "llvm" and len(tiers) >= 2, tiers
        kernels = {c.kernel for c in m.selftest.cases}
        assert {"int4_m1", "int4_m6", "int8_m6", "int8int8_m6", "f32_m6", "f32_gemm_m40"} <= kernels
        for t in tiers:
            assert t.module in b.module_keys() and t.selftest in b.module_keys()


def test_every_tier_passes_here(tiny_bundle):
    path = tiny_bundle("qwen2", "int4")
    with giw.open_bundle(path) as b:
        manifest = Manifest.of(b)
        for tier in manifest.cpu_tiers:
            assert selftest._check_tier(b, manifest, tier, cache.folder("libs")) == [], tier.tier
    m = Model.load(path)
    assert m.self_test.status == "pass" and m.tier == m.manifest.cpu_tiers[0].tier
    # Timed, not bounded: a busy 2-core machine may take any time, but the kernels did run.
    assert m.self_test.elapsed_ms > 0 and [m.self_test] == selftest.RESULTS


def test_a_wrong_kernel_is_caught(tiny_bundle):
    """The check compares real outputs: a fixture whose answer is off fails it."""
    with giw.open_bundle(tiny_bundle("qwen2", "int4")) as b:
        m = Manifest.of(b)
        case = m.selftest.cases[0]
        inputs = [b.tensor(n) for n in case.inputs]
        want = b.tensor(case.want).copy()
        want.flat[0] += 1e-3 * np.abs(want).max()
        lib = b.extract_module(m.cpu_tiers[0].selftest, cache.folder("libs"))
        bad = selftest.check_library(str(lib), "t", [(case.kernel, inputs, want)], m.selftest.tolerance)
    assert bad and bad[0]["observed"] > m.selftest.tolerance


def test_failing_tier_steps_down_with_one_warning(tiny_bundle, monkeypatch, capsys):
    path = tiny_bundle("qwen2", "int4")
    real = selftest._check_tier

    def best_tier_broken(bundle, manifest, tier, lib_dir):
        if tier.module == "llvm":
            return [{"kernel": "int4_m1", "tier": tier.tier, "observed": 0.02, "allowed": 1e-5}]
        return real(bundle, manifest, tier, lib_dir)

    ref = Model.load(path, self_test=False)
    ids = ref.encode("hello world")
    want = ref.prefill(ids)

    monkeypatch.setattr(selftest, "_check_tier", best_tier_broken)
    m = Model.load(path)
    err = capsys.readouterr().err
    warns = [line for line in err.splitlines() if line.startswith("WARN: self-test:")]
    assert len(warns) == 1 and "int4_m1" in warns[0] and "stepping down" in warns[0], err
    tiers = m.manifest.cpu_tiers
    assert m.tier == tiers[1].tier and m.self_test.status == "repaired"
    assert m.self_test.stepped_down == [tiers[0].tier]
    # The lower tier's model module runs and agrees with the best tier's.
    np.testing.assert_allclose(m.prefill(ids), want, rtol=1e-4, atol=1e-4)


def test_all_tiers_failing_is_refused(tiny_bundle, monkeypatch):
    monkeypatch.setattr(
        selftest,
        "_check_tier",
        lambda b, m, tier, d: [{"kernel": "f32_m6", "tier": tier.tier, "observed": 1.0, "allowed": 1e-5}],
    )
    with pytest.raises(selftest.SelfTestError, match="every CPU tier failed"):
        Model.load(tiny_bundle("qwen2", "int4"))
    assert selftest.RESULTS[-1].status == "declined"


def test_no_selftest_skips(tiny_bundle, monkeypatch):
    monkeypatch.setenv("GOINFER_NO_SELFTEST", "1")
    m = Model.load(tiny_bundle("qwen2", "int4"))
    assert m.self_test.status == "skipped" and m.tier == m.manifest.cpu_tiers[0].tier


def test_check_hardware_report(tiny_bundle):
    res = CliRunner().invoke(main, ["check", "--hardware", str(tiny_bundle("qwen2", "int4"))])
    assert res.exit_code == 0, res.output
    out = res.output
    for key in ("goinfer ", "cpu ", "isa ", "tiers ", "memory ", "backends ", "selftest  pass"):
        assert key in out, out
    assert "(in use)" in out
    import os
    import re
    import socket

    assert not re.search(rf"\b{re.escape(socket.gethostname())}\b", out)
    assert os.path.expanduser("~") not in out


def test_check_without_flag_is_one_line_error():
    res = CliRunner().invoke(main, ["check"])
    assert res.exit_code == 2
    assert res.stdout == "" and res.stderr == "goinfer: error: nothing to check: pass --hardware\n"


def test_step_down_is_the_one_rule_for_pass_repaired_and_declined():
    ok, bad = [], [{"kernel": "k", "tier": "t", "observed": 1.0, "allowed": 1e-5}]
    warned: list[str] = []
    assert selftest.step_down(["a", "b"], lambda t: ok, warned.append).status == "pass"
    result = selftest.step_down(["a", "b", "c"], lambda t: bad if t == "a" else ok, warned.append)
    assert (result.status, result.tier, result.stepped_down) == ("repaired", "b", ["a"])
    assert selftest.tier_states(["a", "b", "c"], result) == [
        ("a", "failed self-test"),
        ("b", "in use"),
        ("c", "available"),  # not run: the first tier that passes is the one used
    ]
    assert len(warned) == 1 and "stepping down to b" in warned[0]
    with pytest.raises(selftest.SelfTestError):
        selftest.step_down(["a"], lambda t: bad, warned.append)
    assert selftest.RESULTS[-1].status == "declined"


def test_check_without_a_bundle_steps_down_as_a_load_does(monkeypatch):
    """`goinfer check --hardware` on freshly compiled kernels: a failing best tier is "repaired"
    on the next, as runtime/selftest.py decides for a bundle (the compile is stubbed out here)."""
    from goinfer.compiler import selftest as build_side
    from goinfer.compiler.tvm import targets

    fixtures = {"k": (None, [np.zeros(1)], np.zeros(1))}
    monkeypatch.setattr(build_side, "fixtures", lambda: fixtures)
    monkeypatch.setattr(build_side, "compile_for", lambda fx, target: b"")
    monkeypatch.setattr(targets, "cpu_tiers", lambda: [("best", {}), ("lower", {})])
    wrong = [{"kernel": "k", "tier": "best", "observed": 0.5, "allowed": 1e-5}]
    monkeypatch.setattr(
        selftest, "check_library", lambda lib, tier, cases, tol: wrong if tier == "best" else []
    )
    res = CliRunner().invoke(main, ["check", "--hardware"])
    assert res.exit_code == 0, res.output
    assert "tiers     best (failed self-test), lower (in use)" in res.stdout
    assert "selftest  repaired, tier lower" in res.stdout and "stepped down from best" in res.stdout
