"""`goinfer check --hardware`: the kernel self-test (a bundle's, or freshly compiled kernels'),
decided as every model load decides it (runtime/selftest.py), and the machine's report; with
`--fit MODEL`, the memory-fit decisions a load of MODEL would make (runtime/fit.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from goinfer.runtime.config import SchedulerConfig

from .errors import fail, user_errors


@click.command()
@click.option("--hardware", is_flag=True, help="print the block a hardware bug report needs")
@click.option("--fit", "fit_model", metavar="MODEL", help="add the memory-fit decisions for loading MODEL")
@click.option("--ctx", type=click.IntRange(min=0), default=SchedulerConfig.context, help="as serve's --ctx")
@click.option(
    "--kv-tokens",
    type=click.IntRange(min=0),
    default=SchedulerConfig.kv_tokens,
    help="as serve's --kv-tokens",
)
@click.argument("bundle", required=False, type=click.Path(dir_okay=False))
def check(hardware: bool, fit_model: str | None, ctx: int, kv_tokens: int, bundle: str | None) -> None:
    """Self-test the CPU kernels (a BUNDLE's own, or freshly compiled ones) and report the machine."""
    if not hardware:
        fail("nothing to check: pass --hardware")
    from goinfer.runtime import hardware as hw

    try:
        tiers = _self_test_bundle(bundle) if bundle else _self_test_fresh()
    except user_errors() as e:
        fail(str(e))
    except ValueError as e:  # SelfTestError: every tier failed; the report still prints
        click.echo(str(e), err=True)
        tiers = []
    click.echo(hw.render(hw.facts(), tiers))
    if fit_model:
        for line in _fit_lines(fit_model, ctx, kv_tokens):
            click.echo(f"fit       {line}")


def _fit_lines(ref: str, ctx: int, kv_tokens: int) -> list[str]:
    """What a load of `ref` would decide: fits, the context it would shrink to, or the refusal."""
    from goinfer.artifacts import giw
    from goinfer.artifacts.manifest import Manifest
    from goinfer.compiler.build import BuildOptions
    from goinfer.compiler.resolve import resolve
    from goinfer.runtime import fit

    try:
        bundle = resolve(ref, BuildOptions())
        with giw.open_bundle(bundle, verify="none") as b:
            cost = fit.ModelCost.of(ref, b, Manifest.of(b))
    except user_errors() as e:
        fail(f"--fit {ref}: {e}")
    try:
        decision = fit.plan(cost, ctx, kv_tokens)
    except fit.FitError as e:
        return [f"refused: {e}"]
    lines = [line.removeprefix("fit: ") for line in decision.lines]
    if decision.shrunk_from is not None:
        lines.append(f"{ref}: loads with context {decision.context:,} (shrunk from {decision.shrunk_from:,})")
    return lines


def _self_test_bundle(path: str) -> list[tuple[str, str]]:
    """The bundle's CPU tiers, chosen as a load chooses them; its GPU self-test where CUDA is
    usable (its result joins the report's; else the report's gpu line says why it did not run)."""
    from goinfer.artifacts import cache, giw, manifest
    from goinfer.runtime import cuda, selftest

    with giw.open_bundle(path, verify="once") as b:
        m = manifest.Manifest.of(b)
        states = []
        if m.cpu_tiers:
            _tier, result = selftest.choose_tier(b, m, cache.folder("libs"))
            states = selftest.tier_states([t.tier for t in m.cpu_tiers], result)
    if any(g.kind == "cuda" for g in m.gpu_modules) and cuda.probe().usable:
        from goinfer.runtime.model import Model

        Model.load(path, device="cuda").bundle.close()
    return states


def _self_test_fresh() -> list[tuple[str, str]]:
    """No bundle: the self-test kernels compiled for each tier this host has, checked best first
    and stepped down as a bundle's are."""
    import tempfile

    from goinfer.compiler import selftest as build_side
    from goinfer.compiler.tvm import targets
    from goinfer.runtime import selftest

    fixtures = build_side.fixtures()
    cases = [(name, inputs, want) for name, (_f, inputs, want) in fixtures.items()]
    tiers = dict(targets.cpu_tiers())
    with tempfile.TemporaryDirectory() as tmp:

        def check_tier(tier: str) -> list[dict[str, Any]]:
            lib = Path(tmp) / f"{tier}.so"
            lib.write_bytes(build_side.compile_for(fixtures, tiers[tier]))
            return selftest.check_library(str(lib), tier, cases, build_side.TOLERANCE)

        reason = "kernels compiled just now (no bundle given)"
        result = selftest.step_down(list(tiers), check_tier, reason=reason)
    return selftest.tier_states(list(tiers), result)
