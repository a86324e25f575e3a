"""`goinfer zoo`: pre-build a model x target x quant matrix into a store (compiler/zoo_build.py)."""

from __future__ import annotations

import time
from pathlib import Path

import click
from goinfer.compiler.build import BuildOptions

from . import options
from .errors import fail, user_errors


def _matrix_options(f):
    """--models, --targets and --quants: the zoo's matrix, each a comma list."""
    f = options.kv_dtype(f)
    f = options.knob("--quants", BuildOptions, "quant", "comma list of quant modes (as build --quant)")(f)
    help = "comma list of targets, one bundle each; llvm+cuda builds one bundle for both"
    f = options.knob("--targets", BuildOptions, "target", help)(f)
    return click.option(
        "--models",
        default=None,
        help="comma list of zoo names, checkpoint paths or hf: references "
        "[default: the zoo's decoder models]",
    )(f)


def _cells(models: str | None, target: str, quant: str, kv_dtype: str):
    from goinfer.compiler import zoo_build

    def split(value: str) -> list[str]:
        return [v.strip() for v in value.split(",") if v.strip()]

    names = split(models) if models is not None else list(zoo_build.DEFAULT_MODELS)
    if not names:
        raise click.BadParameter("no models given", param_hint="--models")
    return zoo_build.plan(names, split(target), split(quant), options.KV_DTYPES[kv_dtype])


@click.group()
def zoo() -> None:
    """Pre-build a model x target x quant matrix of bundles into a store, for CI."""


@zoo.command("build")
@_matrix_options
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="the store folder")
def zoo_build_cmd(models: str | None, target: str, quant: str, kv_dtype: str, output: str) -> None:
    """Build every cell of the matrix not already in the store OUTPUT (by key, verified), and
    write OUTPUT/index.json. Serve one with: goinfer serve --model zoo:OUTPUT/NAME."""
    from goinfer.compiler import zoo_build

    t0 = time.perf_counter()
    try:
        cells = _cells(models, target, quant, kv_dtype)
        built, reused = zoo_build.build_store(cells, Path(output), lambda m: click.echo(m, err=True))
    except user_errors() as e:
        fail(str(e))
    click.echo(zoo_build.describe(built, reused, Path(output), time.perf_counter() - t0))


@zoo.command("plan")
@_matrix_options
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["github", "text", "key"]),
    default="text",
    show_default=True,
    help="github: JSON for strategy.matrix (fromJSON), one job per cell; key: each cell's key on "
    "this machine (a CI cache key); text: name, model, quant, target and key",
)
def zoo_plan(models: str | None, target: str, quant: str, kv_dtype: str, fmt: str) -> None:
    """Print the matrix's cells without building anything."""
    from goinfer.compiler import zoo_build

    try:
        cells = _cells(models, target, quant, kv_dtype)
        if fmt == "github":
            click.echo(zoo_build.github_matrix(cells))
            return
        for cell in cells:
            key = zoo_build.planned_key(cell)
            fields = (cell.name, cell.model, cell.quant, cell.target, key)
            click.echo(key if fmt == "key" else "\t".join(fields))
    except user_errors() as e:
        fail(str(e))


@zoo.command("merge")
@click.argument("stores", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="the merged store")
def zoo_merge(stores: tuple[str, ...], output: str) -> None:
    """Join the stores (folders or their index.json) built by separate cells into OUTPUT."""
    from goinfer.compiler import zoo_build

    try:
        entries = zoo_build.merge([Path(s) for s in stores], Path(output), lambda m: click.echo(m, err=True))
    except user_errors() as e:
        fail(str(e))
    click.echo(f"{Path(output) / 'index.json'}: {len(entries)} bundles")
