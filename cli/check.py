"""`goinfer check --hardware`: the kernel self-test (a bundle's, or freshly compiled kernels'),
decided as every model load decides it (runtime/selftest.py), and the machine's report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .errors import fail, user_errors


@click.command()
@click.option("--hardware", is_flag=True, help="print the block a hardware bug report needs")
@click.argument("bundle", required=False, type=click.Path(dir_okay=False))
def check(hardware: bool, bundle: str | None) -> None:
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
