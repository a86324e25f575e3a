"""The `goinfer` command. This is the composition root: the only place that uses both the compiler
and the runtime, each imported lazily so `goinfer generate` on a bundle never loads the compiler.

Bad input ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from goinfer.runtime.scheduler import SchedulerConfig

EXIT_BAD_INPUT = 2
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _fail(message: str) -> None:
    click.echo(f"goinfer: error: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input (reported in one line), not a bug."""
    from goinfer.artifacts.giw import BundleError
    from goinfer.artifacts.zoo_store import StoreError
    from goinfer.compiler.build import BuildError  # light: TVM is imported only inside build()
    from goinfer.compiler.sources.base import SourceError

    return (
        BundleError,
        BuildError,
        SourceError,
        StoreError,
        FileNotFoundError,
        IsADirectoryError,
        PermissionError,
    )


class _OneLineErrors(click.Group):
    """Usage errors as one line (click prints usage and help hints over several)."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("goinfer: aborted", err=True)
            sys.exit(1)
        except _NO_ARGS_IS_HELP as e:  # bare `goinfer`: the help text, as is
            click.echo(e.format_message(), err=True)
            sys.exit(EXIT_BAD_INPUT)
        except click.ClickException as e:
            _fail(e.format_message().replace("\n", " "))
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="goinfer")
def main() -> None:
    """goinfer: compile an LLM checkpoint into a .giw bundle, then run it."""


KV_DTYPES = {"f16": "float16", "f32": "float32"}
kv_dtype_option = click.option(
    "--kv-dtype",
    type=click.Choice(list(KV_DTYPES)),
    default="f16",
    show_default=True,
    help="the KV cache's element type, compiled into the bundle (f16: half the memory and bytes a step)",
)


device_option = click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="where to run a bundle: auto takes its CUDA module when a GPU is usable, else its CPU module",
)


@main.command()
@click.argument("source")
@click.option(
    "--target",
    default="llvm",
    show_default=True,
    help="llvm (CPU), cuda, metal, or several comma-separated (llvm,cuda): one bundle holds them all",
)
@click.option(
    "--cuda-arch", default="sm_90", show_default=True, help="the CUDA compute capability to compile for"
)
@click.option(
    "--quant",
    default="gguf",
    show_default=True,
    help="gguf (the checkpoint's own blocks, value-exact) | int4 | int8int8 | int8 | int4mix | f32",
)
@kv_dtype_option
@click.option("-o", "--output", default=None, help="the .giw file to write [default: beside SOURCE]")
def build(source: str, target: str, cuda_arch: str, quant: str, kv_dtype: str, output: str | None) -> None:
    """Compile SOURCE into a .giw bundle: a .gguf file (any shard of a split one), a checkpoint
    directory (config.json, tokenizer, safetensors), hf:OWNER/REPO:QUANT or :safetensors, or a
    zoo model name."""
    from goinfer.compiler.build import BuildOptions
    from goinfer.compiler.build import build as run_build

    options = BuildOptions(target=target, quant=quant, kv_dtype=KV_DTYPES[kv_dtype], cuda_arch=cuda_arch)
    try:
        run_build(source, output, options)
    except _user_errors() as e:
        _fail(str(e))


def _matrix_options(f):
    """--models, --targets and --quants: the zoo's matrix, each a comma list."""
    f = kv_dtype_option(f)
    f = click.option(
        "--quants", default="gguf", show_default=True, help="comma list of quant modes (as build --quant)"
    )(f)
    f = click.option(
        "--targets",
        default="llvm",
        show_default=True,
        help="comma list of targets, one bundle each; llvm+cuda builds one bundle for both",
    )(f)
    return click.option(
        "--models",
        default=None,
        help="comma list of zoo names, checkpoint paths or hf: references "
        "[default: the zoo's decoder models]",
    )(f)


def _cells(models: str | None, targets: str, quants: str, kv_dtype: str):
    from goinfer.compiler import zoo_build

    def split(value: str) -> list[str]:
        return [v.strip() for v in value.split(",") if v.strip()]

    names = split(models) if models is not None else list(zoo_build.DEFAULT_MODELS)
    if not names:
        raise click.BadParameter("no models given", param_hint="--models")
    return zoo_build.plan(names, split(targets), split(quants), KV_DTYPES[kv_dtype])


@main.group()
def zoo() -> None:
    """Pre-build a model x target x quant matrix of bundles into a store, for CI."""


@zoo.command("build")
@_matrix_options
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="the store folder")
def zoo_build_cmd(models: str | None, targets: str, quants: str, kv_dtype: str, output: str) -> None:
    """Build every cell of the matrix not already in the store OUTPUT (by key, verified), and
    write OUTPUT/index.json. Serve one with: goinfer serve --model zoo:OUTPUT/NAME."""
    import time

    from goinfer.compiler import zoo_build

    t0 = time.perf_counter()
    try:
        cells = _cells(models, targets, quants, kv_dtype)
        built, reused = zoo_build.build_store(cells, Path(output), lambda m: click.echo(m, err=True))
    except _user_errors() as e:
        _fail(str(e))
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
def zoo_plan(models: str | None, targets: str, quants: str, kv_dtype: str, fmt: str) -> None:
    """Print the matrix's cells without building anything."""
    from goinfer.compiler import zoo_build

    try:
        cells = _cells(models, targets, quants, kv_dtype)
        if fmt == "github":
            click.echo(zoo_build.github_matrix(cells))
            return
        for cell in cells:
            key = zoo_build.planned_key(cell)
            fields = (cell.name, cell.model, cell.quant, cell.target, key)
            click.echo(key if fmt == "key" else "\t".join(fields))
    except _user_errors() as e:
        _fail(str(e))


@zoo.command("merge")
@click.argument("stores", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="the merged store")
def zoo_merge(stores: tuple[str, ...], output: str) -> None:
    """Join the stores (folders or their index.json) built by separate cells into OUTPUT."""
    from goinfer.compiler import zoo_build

    try:
        entries = zoo_build.merge([Path(s) for s in stores], Path(output), lambda m: click.echo(m, err=True))
    except _user_errors() as e:
        _fail(str(e))
    click.echo(f"{Path(output) / 'index.json'}: {len(entries)} bundles")


def _resolve_bundle(ref: str, quant: str, target: str, kv_dtype: str = "f16") -> Path:
    """A .giw as given (its own quant and KV dtype), or a zoo store's (zoo:DIR/NAME); a checkpoint
    (.gguf, directory, hf: reference or zoo name) is built once into the cache, then reused."""
    if ref.startswith("zoo:"):  # a pre-built store: never builds
        from goinfer.artifacts import zoo_store

        return zoo_store.find(*_zoo_ref(ref))[0]
    path = Path(ref)
    if path.suffix == ".giw":
        if not path.is_file():
            raise FileNotFoundError(f"no such bundle: {ref}")
        return path
    from goinfer.compiler.build import BuildOptions, build
    from goinfer.compiler.sources import zoo

    source = path if path.is_file() else zoo.resolve(ref)
    dtype = KV_DTYPES[kv_dtype]
    bundle = zoo.bundle_path(source, quant, target, kv_dtype=dtype)
    if not bundle.is_file():
        click.echo(f"goinfer: first use of {ref}: building {bundle.name}", err=True)
        bundle.parent.mkdir(parents=True, exist_ok=True)
        # an hf: reference is built as itself (now cached): the bundle records it as its source
        origin = ref if ref.startswith("hf:") else source
        build(origin, bundle, BuildOptions(target=target, quant=quant, kv_dtype=dtype))
    return bundle


@main.command()
@click.argument("model")
@click.argument("prompt")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.8, show_default=True, type=click.FloatRange(min=0))
@click.option("--top-k", default=40, show_default=True, type=click.IntRange(min=0))
@click.option("--top-p", default=0.95, show_default=True, type=click.FloatRange(0, 1))
@click.option("--seed", default=None, type=int)
@click.option("--chat", is_flag=True, help="render PROMPT as a user turn through the model's chat template")
@click.option("--system", default=None, help="a system message (with --chat)")
@click.option("--quant", default="gguf", show_default=True, help="used only when MODEL must be built")
@kv_dtype_option
@click.option("--verbose", "-v", is_flag=True, help="timings on stderr")
@click.option("--no-selftest", is_flag=True, help="skip the startup kernel self-test")
@device_option
def generate(
    model: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    chat: bool,
    system: str | None,
    quant: str,
    kv_dtype: str,
    verbose: bool,
    no_selftest: bool,
    device: str,
) -> None:
    """Generate a continuation of PROMPT with MODEL (a .giw, a .gguf or a zoo name)."""
    try:
        bundle = _resolve_bundle(model, quant, "llvm", kv_dtype)
        from goinfer.runtime.model import Model
        from goinfer.runtime.sampler import SamplingParams

        m = Model.load(bundle, self_test=False if no_selftest else None, device=device)
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = m.chat_prompt(messages)
        else:
            ids = m.encode(prompt)
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens
        )
        out = sys.stdout
        for event in m.generate(ids, params):
            if event.text:
                out.write(event.text)
                out.flush()
            if event.finish_reason is not None:
                out.write("\n")
                if verbose:
                    t = event.timings
                    click.echo(
                        f"load {m.load_seconds:.2f}s | prompt {t['prompt_tokens']} tok, "
                        f"{t['prefill_tok_s']:.1f} tok/s | gen {t['completion_tokens']} tok, "
                        f"{t['decode_tok_s']:.1f} tok/s | finish {event.finish_reason}",
                        err=True,
                    )
    except _user_errors() as e:
        _fail(str(e))
    except ValueError as e:  # prompt too long, template errors: the runtime's own one-line reasons
        _fail(str(e))


@main.command()
@click.argument("bundle", required=False, metavar="[BUNDLE]")
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="[NAME=]PATH",
    help="a .giw, zoo:DIR/NAME (or zoo:DIR: all of a store), a .gguf, a checkpoint directory, "
    "hf:OWNER/REPO:QUANT or a zoo name, optionally named; repeat to serve several "
    "(default: the zoo's default model)",
)
@click.option("--addr", default="127.0.0.1:8080", show_default=True, help="HOST:PORT to listen on")
@click.option(
    "--api-key", envvar="GOINFER_API_KEY", default=None, help="require this key (or $GOINFER_API_KEY)"
)
@click.option("--tls-cert", default=None, type=click.Path(dir_okay=False), help="PEM certificate for HTTPS")
@click.option("--tls-key", default=None, type=click.Path(dir_okay=False), help="PEM private key for HTTPS")
@click.option(
    "--max-queue", default=8, show_default=True, type=click.IntRange(min=0), help="waiting per model"
)
@click.option(
    "--max-body-bytes", default=0, show_default=True, type=click.IntRange(min=0), help="0: derived per route"
)
@click.option("--allow-admin", is_flag=True, help="enable POST /admin/models/load and /unload")
@click.option(
    "--unload-drain-wait", default=5.0, show_default=True, type=click.FloatRange(min=0), help="seconds"
)
@click.option(
    "--responses-store",
    default=256,
    show_default=True,
    type=click.IntRange(min=0),
    help="stored /v1/responses kept in memory for previous_response_id",
)
@click.option(
    "--max-concurrent",
    default=4,
    show_default=True,
    type=click.IntRange(min=1),
    help="generations per model at once; their decode steps share one forward (1: one at a time)",
)
@click.option(
    "--kv-sessions",
    default=16,
    show_default=True,
    type=click.IntRange(min=0),
    help="finished conversations kept warm in the KV cache for prompt-prefix reuse (0: no reuse)",
)
@click.option(
    "--session-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="persist warm sessions here after each request and on shutdown; restored at start",
)
@click.option(
    "--prefill-chunk",
    default=128,  # runtime.model.DEFAULT_PREFILL_CHUNK (not imported: it would load TVM at startup)
    show_default=True,
    type=click.IntRange(min=1),
    help="prompt tokens a scheduler step: a long prompt holds running generations up this long at most",
)
@click.option(
    "--prefix-reuse",
    default="exact",
    show_default=True,
    type=click.Choice(["exact", "longest"]),
    help="exact: reuse whole prefill chunks only, replies bit-equal to a cold run's; longest: the "
    "whole shared prefix, faster turns, equal to float rounding",
)
@click.option(
    "--cpu-batch",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "on", "off"]),
    help="batch concurrent generations' decode steps into one forward",
)
@click.option(
    "--ctx", default=0, type=click.IntRange(min=0), help="cap the context window (0: the model's own)"
)
@click.option(
    "--kv-tokens",
    default=0,
    type=click.IntRange(min=0),
    help="KV cache capacity in tokens, all sequences together (0: the context window)",
)
@click.option(
    "--temp",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0, 2),
    help="temperature for requests that set none (Claude Code sends none)",
)
@click.option(
    "--top-p",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0, 1),
    help="top_p for requests that set none",
)
@click.option(
    "--top-k",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="top_k for requests that set none",
)
@click.option(
    "--min-p",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0, 1),
    help="min_p for requests that set none",
)
@click.option("--quant", default="gguf", show_default=True, help="used only when a model must be built")
@kv_dtype_option
@click.option("--no-selftest", is_flag=True, help="skip the startup kernel self-test")
@device_option
def serve(
    bundle: str | None,
    models: tuple[str, ...],
    addr: str,
    api_key: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    max_queue: int,
    max_body_bytes: int,
    allow_admin: bool,
    unload_drain_wait: float,
    responses_store: int,
    max_concurrent: int,
    kv_sessions: int,
    session_dir: str | None,
    prefill_chunk: int,
    prefix_reuse: str,
    cpu_batch: str,
    ctx: int,
    kv_tokens: int,
    temp: float,
    top_p: float,
    top_k: int,
    min_p: float,
    quant: str,
    kv_dtype: str,
    no_selftest: bool,
    device: str,
) -> None:
    """Serve BUNDLE (or the models given by --model) over OpenAI-compatible and Anthropic Messages
    HTTP APIs (base URL http://ADDR/v1). A model is a .giw, a pre-built store's zoo:DIR/NAME, or a
    checkpoint built once into the cache: a .gguf, a checkpoint directory, hf:OWNER/REPO:QUANT or a
    zoo name."""
    from goinfer.runtime.scheduler import SchedulerConfig
    from goinfer.serve import server
    from goinfer.serve.app import create_app
    from goinfer.serve.config import SamplingDefaults, ServeConfig, parse_addr
    from goinfer.serve.keys import CAPS

    try:
        host, port = parse_addr(addr)
        config = ServeConfig(
            host=host,
            port=port,
            api_key=api_key or None,
            max_queue=max_queue,
            max_body_bytes=max_body_bytes,
            allow_admin=allow_admin,
            unload_drain_wait_s=unload_drain_wait,
            tls_cert=tls_cert,
            tls_key=tls_key,
            responses_store=responses_store,
            max_concurrent=max_concurrent,
            sampling=SamplingDefaults(temp, top_p, top_k, min_p),
        )
        engine = SchedulerConfig(
            max_concurrent=max_concurrent,
            kv_sessions=kv_sessions,
            prefill_chunk=prefill_chunk,
            prefix_reuse=prefix_reuse,
            batch=cpu_batch,
            kv_tokens=kv_tokens,
            context=ctx,
            session_dir=session_dir,
        )
        server.check_exposure(config)  # before any model loads: a refusal costs nothing
        server.log_to_stderr()
        context = server.ssl_context(config)
        load = _engine_loader(quant, no_selftest, engine, kv_dtype, device)
        engines = {}
        from goinfer.compiler.sources.zoo import DEFAULT_MODEL

        for name, ref in _model_specs((*((bundle,) if bundle else ()), *models) or (DEFAULT_MODEL,)):
            engines[name] = load(name, ref, None)
    except ValueError as e:  # bad --addr/--model, exposure, TLS files, and the loader's reasons
        _fail(str(e))
    app = create_app(engines, config, loader=load if allow_admin else None)
    for line in server.banner(config, app[CAPS], engines):
        click.echo(line)
    server.run(app, config, context)


def _model_specs(specs: tuple[str, ...]) -> list[tuple[str, str]]:
    """`NAME=REF` or `REF` -> (name, ref). A bare REF is named by its zoo name, its file stem (a
    split GGUF's without the shard number) or its store entry; `zoo:DIR` (a store, no NAME) serves
    every bundle in it, each under its entry's name."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, ref = spec.partition("=")
        if not sep or "/" in name or ":" in name or not name:
            name, ref = "", spec
        for each_name, each_ref in _expand(ref) if not name else [(name, ref)]:
            if each_name in out:
                raise ValueError(f"--model {spec}: the name {each_name!r} is given twice; name them NAME=REF")
            out[each_name] = each_ref
    return list(out.items())


def _expand(ref: str) -> list[tuple[str, str]]:
    """The (name, ref) pairs a bare --model REF serves."""
    if ref.startswith("zoo:"):
        from goinfer.artifacts import zoo_store

        folder, name = _zoo_ref(ref)
        if not name:
            entries = zoo_store.read_index(folder)
            if not entries:
                raise ValueError(f"--model {ref}: no zoo index in {folder}")
            return [(e.name, f"zoo:{folder}/{e.name}") for e in entries]
        return [(name, ref)]
    if ref.startswith("hf:"):  # pulled here to be named: the GGUF's name, or the repo's
        from goinfer.compiler.sources import zoo

        path = zoo.resolve(ref)
        return [(path.name if path.is_dir() else _stem(path), ref)]
    path = Path(ref)
    if path.is_dir():
        return [(path.name, ref)]
    if path.suffix == ".giw":
        return [(path.stem, ref)]
    return [(_stem(path) if path.suffix == ".gguf" else ref, ref)]


def _stem(path: Path) -> str:
    """A checkpoint's name, a split GGUF's without its shard number (the compiler side knows it)."""
    from goinfer.compiler.sources.gguf_file import model_stem

    return model_stem(path)


def _zoo_ref(ref: str) -> tuple[Path, str]:
    """`zoo:DIR/NAME` -> (DIR, NAME); `zoo:DIR` or `zoo:DIR/index.json` -> (DIR, "")."""
    from goinfer.artifacts import zoo_store

    path = Path(ref.removeprefix("zoo:")).expanduser()
    if path.name == zoo_store.INDEX or (path / zoo_store.INDEX).is_file():
        return zoo_store.index_path(path).parent, ""
    return path.parent, path.name


def _engine_loader(
    default_quant: str,
    no_selftest: bool,
    engine: SchedulerConfig | None = None,
    kv_dtype: str = "f16",
    device: str = "auto",
):
    """(name, path, quant) -> a ModelEngine: a .giw as is, a .gguf or zoo name built once into the cache."""
    from goinfer.runtime.scheduler import SchedulerConfig

    config = engine or SchedulerConfig()

    def load(name: str, ref: str, quant: str | None):
        from goinfer.serve.model_engine import ModelEngine

        try:
            bundle = _resolve_bundle(ref, quant or default_quant, "llvm", kv_dtype)
            self_test = False if no_selftest else None
            return ModelEngine.load(bundle, self_test=self_test, config=config, device=device)
        except _user_errors() as e:
            raise ValueError(f"--model {name}={ref}: {e}") from None

    return load


@main.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="the manifest as JSON")
@click.option("--verify", is_flag=True, help="hash every blob too")
def inspect(bundle: str, as_json: bool, verify: bool) -> None:
    """Show a bundle's manifest."""
    from goinfer.artifacts import giw, manifest

    try:
        with giw.open_bundle(bundle, verify="full" if verify else "none") as b:
            if as_json:
                # The typed manifest (checked as the runtime checks it), then the container's tables.
                body = {**manifest.Manifest.of(b).to_json(), **{k: b.manifest[k] for k in giw.RESERVED_KEYS}}
                click.echo(json.dumps(body, indent=2, sort_keys=True))
            else:
                click.echo(manifest.describe(b))
    except _user_errors() as e:
        _fail(str(e))


@main.command()
@click.option("--hardware", is_flag=True, help="print the block a hardware bug report needs")
@click.argument("bundle", required=False, type=click.Path(dir_okay=False))
def check(hardware: bool, bundle: str | None) -> None:
    """Self-test the CPU kernels (a BUNDLE's own, or freshly compiled ones) and report the machine."""
    if not hardware:
        _fail("nothing to check: pass --hardware")
    from goinfer.runtime import hardware as hw

    try:
        tiers = _self_test_bundle(bundle) if bundle else _self_test_fresh()
    except _user_errors() as e:
        _fail(str(e))
    except ValueError as e:  # SelfTestError: every tier failed; the report still prints
        click.echo(str(e), err=True)
        tiers = []
    click.echo(hw.render(hw.facts(), tiers))


def _self_test_bundle(path: str) -> list[tuple[str, str]]:
    from goinfer.artifacts import cache, giw, manifest
    from goinfer.runtime import selftest

    with giw.open_bundle(path, verify="once") as b:
        m = manifest.Manifest.of(b)
        states = []
        if m.cpu_tiers:
            chosen, result = selftest.choose_tier(b, m, cache.folder("libs"))
            states = [(t.tier, _tier_state(t.tier, chosen.tier, result.stepped_down)) for t in m.cpu_tiers]
    if any(g.kind == "cuda" for g in m.gpu_modules):
        _self_test_gpu(path)
    return states


def _self_test_gpu(path: str) -> None:
    """The bundle's GPU self-test where CUDA is usable (its result joins the report's); else the
    report's gpu line says why it did not run."""
    from goinfer.runtime import cuda
    from goinfer.runtime.model import Model

    if cuda.probe().usable:
        Model.load(path, device="cuda").bundle.close()


def _self_test_fresh() -> list[tuple[str, str]]:
    """No bundle: compile the self-test kernels for each tier this host has, and run them."""
    import tempfile
    import time

    from goinfer.compiler import selftest as build_side
    from goinfer.compiler.lower import tvm_api
    from goinfer.runtime import selftest

    fixtures = build_side.fixtures()
    cases = [(name, inputs, want) for name, (_f, inputs, want) in fixtures.items()]
    states, stepped, chosen, mismatches = [], [], None, []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for tier, target in tvm_api.cpu_tiers():
            lib = Path(tmp) / f"{tier}.so"
            lib.write_bytes(build_side.compile_for(fixtures, target))
            bad = selftest.check_library(str(lib), tier, cases, build_side.TOLERANCE)
            mismatches += bad
            if bad:
                stepped.append(tier)
            elif chosen is None:
                chosen = tier
            states.append(tier)
    status = "declined" if chosen is None else "repaired" if stepped and stepped[0] == states[0] else "pass"
    selftest.RESULTS.append(
        selftest.SelfTestResult(
            "cpu",
            status,
            chosen,
            (time.perf_counter() - t0) * 1e3,
            mismatches,
            stepped,
            reason="kernels compiled just now (no bundle given)",
        )
    )
    return [(t, _tier_state(t, chosen, stepped)) for t in states]


def _tier_state(tier: str, chosen: str | None, stepped: list[str]) -> str:
    if tier == chosen:
        return "in use"
    return "failed self-test" if tier in stepped else "available"


if __name__ == "__main__":
    main()
