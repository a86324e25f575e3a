"""Startup self-test: the bundle's CPU kernels, per ISA tier, against their portable answers.

A wrong kernel on a CPU nobody here owns does not crash; it returns slightly wrong numbers. So the
first load of a bundle in a process runs each tier's self-test library (compiled beside the model
for the same target, see compiler/selftest.py) on the bundle's fixed fixtures, best tier first. A
tier that disagrees is stepped down to the next, with one `WARN: self-test:` line on stderr; the
model then runs on the first tier that passes. It costs a few milliseconds.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from goinfer.artifacts import giw
from goinfer.artifacts.manifest import CpuTier, Manifest

from . import tvm_runtime as rt


class SelfTestError(ValueError):
    """Every CPU tier in the bundle failed its self-test: nothing here computes correctly."""


@dataclass(frozen=True)
class SelfTestResult:
    backend: str
    status: str  # "pass" | "repaired" (stepped down, then passed) | "declined" | "skipped"
    tier: str | None  # the tier the model runs on
    elapsed_ms: float
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    stepped_down: list[str] = field(default_factory=list)
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v or k in ("status", "elapsed_ms", "backend")}


RESULTS: list[SelfTestResult] = []  # every self-test this process ran (GET /health reports them)
_DONE: dict[str, tuple[CpuTier, SelfTestResult]] = {}  # by bundle sha: once per process


def disabled_by_env() -> bool:
    return os.environ.get("GOINFER_NO_SELFTEST", "") not in ("", "0")


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_library(
    lib_path: str, tier: str, cases: list[tuple[str, list[np.ndarray], np.ndarray]], allowed: float
) -> list[dict[str, Any]]:
    """Run each (kernel, inputs, want) through one tier's library; returns the ones it gets wrong."""
    lib = rt.load_kernels(lib_path)
    bad = []
    for kernel, inputs, want in cases:
        got = rt.run_kernel(lib, kernel, inputs, want)
        scale = float(np.abs(want).max()) or 1.0
        err = float(np.abs(got - want).max()) / scale if np.isfinite(got).all() else float("inf")
        if not err <= allowed:
            bad.append({"kernel": kernel, "tier": tier, "observed": err, "allowed": allowed})
    return bad


def _check_tier(bundle: giw.Bundle, m: Manifest, tier: CpuTier, lib_dir: Path) -> list[dict[str, Any]]:
    """The fixtures this tier of the bundle gets wrong (empty: it passes)."""
    cases = [
        (c.kernel, [bundle.tensor(n) for n in c.inputs], bundle.tensor(c.want)) for c in m.selftest.cases
    ]
    lib = bundle.extract_module(tier.selftest, lib_dir)
    return check_library(str(lib), tier.tier, cases, m.selftest.tolerance)


def choose_tier(
    bundle: giw.Bundle,
    m: Manifest,
    lib_dir: Path,
    enabled: bool = True,
    warn: Callable[[str], None] = _warn,
    check: Callable[[giw.Bundle, Manifest, CpuTier, Path], list[dict[str, Any]]] | None = None,
) -> tuple[CpuTier, SelfTestResult]:
    """The CPU tier to run this bundle's model on, and the self-test's result."""
    tiers = m.cpu_tiers
    if not enabled:
        result = SelfTestResult("cpu", "skipped", tiers[0].tier, 0.0, reason="disabled (--no-selftest)")
        RESULTS.append(result)
        return tiers[0], result
    if bundle.header_sha256 in _DONE:
        return _DONE[bundle.header_sha256]
    run = check or _check_tier
    by_name = {t.tier: t for t in tiers}
    result = step_down(list(by_name), lambda name: run(bundle, m, by_name[name], lib_dir), warn)
    chosen = next(t for t in tiers if t.tier == result.tier)  # step_down raised if none passed
    _DONE[bundle.header_sha256] = (chosen, result)
    return chosen, result


def step_down(
    tiers: Sequence[str],
    check: Callable[[str], list[dict[str, Any]]],
    warn: Callable[[str], None] = _warn,
    reason: str = "",
) -> SelfTestResult:
    """Check the tiers best first and stop at the first that passes; each failure steps down with
    one warning. "pass": the best tier passed; "repaired": a lower one did; "declined": none did
    (recorded, then SelfTestError). `goinfer check` and every model load decide by this alone."""
    t0 = time.perf_counter()
    mismatches: list[dict[str, Any]] = []
    stepped: list[str] = []
    chosen = None
    for i, tier in enumerate(tiers):
        bad = check(tier)
        if not bad:
            chosen = tier
            break
        mismatches += bad
        stepped.append(tier)
        worst = max(bad, key=lambda b: b["observed"])
        nxt = tiers[i + 1] if i + 1 < len(tiers) else None
        warn(
            f"WARN: self-test: {worst['kernel']} on CPU tier {tier}: relative error "
            f"{worst['observed']:.3g} > {worst['allowed']:.0e}; "
            + (f"stepping down to {nxt}" if nxt else "no lower tier left")
        )
    ms = (time.perf_counter() - t0) * 1e3
    status = "declined" if chosen is None else "repaired" if stepped else "pass"
    result = SelfTestResult("cpu", status, chosen, ms, mismatches, stepped, reason)
    RESULTS.append(result)
    if chosen is None:
        raise SelfTestError(
            f"self-test: every CPU tier failed ({', '.join(stepped)}); refusing to return wrong numbers "
            "(GOINFER_NO_SELFTEST=1 skips the check)"
        )
    return result


def tier_states(tiers: Sequence[str], result: SelfTestResult | None) -> list[tuple[str, str]]:
    """Each tier, best first, with what the self-test made of it (`goinfer check --hardware`)."""
    chosen, stepped = (result.tier, result.stepped_down) if result else (None, [])
    return [
        (t, "in use" if t == chosen else "failed self-test" if t in stepped else "available") for t in tiers
    ]
