"""The `goinfer` command. This is the composition root: the only place that uses both the compiler
and the runtime. Each option's default is read from the config that owns the knob (BuildOptions,
runtime/config.py, serve/config.py, SamplingParams), none of which imports TVM; the compiler's
work (compiler/resolve.py, build) and the runtime load lazily, when a command needs them.

Bad input ends with one line on stderr and exit code 2 (errors.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import click
from goinfer.compiler.build import BuildOptions
from goinfer.runtime.config import SchedulerConfig
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.thinking import ThinkingConfig
from goinfer.serve.config import (
    DECISIONS_TEMPLATES,
    BatchConfig,
    SamplingDefaults,
    ServeConfig,
    SwapGuardConfig,
    default_batch_dir,
)

from . import embed as embed_cli
from . import options
from .cache import cache_command
from .chat import chat
from .check import check
from .embed import embed, embed_quant
from .errors import OneLineErrors, fail, user_errors
from .options import KV_DTYPES, knob
from .pulls import ModelPuller
from .zoo import zoo

# `goinfer generate`'s sampling: llama.cpp's CLI filters; the rest SamplingParams' own defaults.
GENERATE = SamplingParams(top_k=40, top_p=0.95)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="goinfer")
def main() -> None:
    """goinfer: compile an LLM checkpoint into a .giw bundle, then run it."""


@main.command()
@click.argument("source")
@knob(
    "--target",
    BuildOptions,
    "target",
    "llvm (CPU), cuda, metal, or several comma-separated (llvm,cuda): one bundle holds them all",
)
@knob("--cuda-arch", BuildOptions, "cuda_arch", "the CUDA compute capability to compile for")
@knob(
    "--quant",
    BuildOptions,
    "quant",
    "gguf (the checkpoint's own blocks, value-exact) | int4 | int8int8 | int8 | int4mix | f32 | q8_0",
)
@options.kv_dtype
@click.option("-o", "--output", default=None, help="the .giw file to write [default: beside SOURCE]")
def build(source: str, target: str, cuda_arch: str, quant: str, kv_dtype: str, output: str | None) -> None:
    """Compile SOURCE into a .giw bundle: a .gguf file (any shard of a split one), a checkpoint
    directory (config.json, tokenizer, safetensors), hf:OWNER/REPO:QUANT or :safetensors, or a
    zoo model name."""
    from goinfer.compiler.build import build as run_build

    build_options = BuildOptions(
        target=target, quant=quant, kv_dtype=KV_DTYPES[kv_dtype], cuda_arch=cuda_arch
    )
    try:
        run_build(source, output, build_options)
    except user_errors() as e:
        fail(str(e))


@main.command()
@click.argument("model")
@click.argument("prompt")
@knob("--max-tokens", GENERATE, "max_tokens", None, type=click.IntRange(min=1))
@knob("--temperature", GENERATE, "temperature", None, type=click.FloatRange(min=0))
@knob("--top-k", GENERATE, "top_k", None, type=click.IntRange(min=0))
@knob("--top-p", GENERATE, "top_p", None, type=click.FloatRange(0, 1))
@click.option("--seed", default=None, type=int)
@click.option("--chat", is_flag=True, help="render PROMPT as a user turn through the model's chat template")
@click.option("--system", default=None, help="a system message (with --chat)")
@knob(
    "--spec",
    SchedulerConfig,
    "spec",
    "ngram: speculative decoding from prompt lookup, the same tokens faster where the reply repeats the "
    "prompt (CPU)",
    type=click.Choice(["off", "ngram"]),
)
@options.drafter
@options.drafter_quant
@knob("--quant", BuildOptions, "quant", "used only when MODEL must be built")
@options.kv_dtype
@click.option("--verbose", "-v", is_flag=True, help="timings on stderr")
@options.no_selftest
@options.device
def generate(
    model: str,
    prompt: str,
    chat: bool,
    system: str | None,
    spec: str,
    drafter: str | None,
    drafter_quant: str,
    quant: str,
    kv_dtype: str,
    verbose: bool,
    no_selftest: bool,
    device: str,
    **sampling: Any,
) -> None:
    """Generate a continuation of PROMPT with MODEL (a .giw, a .gguf or a zoo name)."""
    from goinfer.compiler.resolve import resolve

    try:
        build = BuildOptions(quant=quant, kv_dtype=KV_DTYPES[kv_dtype])
        bundle = resolve(model, build)
        draft_bundle = resolve_drafter(drafter, dataclasses.replace(build, quant=drafter_quant))
        from goinfer.runtime.decode import GenerationRequest
        from goinfer.runtime.model import Model

        m = Model.load(bundle, self_test=False if no_selftest else None, device=device)
        draft = None
        if draft_bundle is not None:
            from goinfer.runtime.draft_model import load_drafter

            one = SchedulerConfig(max_concurrent=1, kv_sessions=0)
            draft = load_drafter(str(draft_bundle), m, m.context_length, one, m.chunk)
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = m.chat_prompt(messages)
        else:
            ids = m.encode(prompt)
        request = GenerationRequest(ids, dataclasses.replace(GENERATE, **sampling))
        out = sys.stdout
        for event in m.generate(request, spec=spec, drafter=draft):
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
    except user_errors() as e:
        fail(str(e))
    except ValueError as e:  # prompt too long, template errors: the runtime's own one-line reasons
        fail(str(e))


_N0, _N1 = click.IntRange(min=0), click.IntRange(min=1)


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
@click.option(
    "--embed-model",
    "embed_models",
    multiple=True,
    metavar="[NAME=]REF",
    help="an embedding model served on /v1/embeddings, beside --model or alone: a .giw, a checkpoint "
    "folder, hf:OWNER/REPO:safetensors or a zoo name (all-minilm-l6-v2); repeat to serve several",
)
@embed_quant
@click.option(
    "--addr",
    default=f"{ServeConfig.host}:{ServeConfig.port}",
    show_default=True,
    help="HOST:PORT to listen on",
)
@click.option(
    "--grpc-addr",
    default=None,
    help="HOST:PORT for the KServe v2 gRPC service (inference.GRPCInferenceService and gRPC health), "
    "over the same models, key and TLS",
)
@knob(
    "--metrics-addr",
    ServeConfig,
    "metrics_addr",
    "HOST:PORT for GET /metrics (Prometheus) on a port of its own instead of the API's: no key there "
    "when bound to loopback, --api-key otherwise",
)
@click.option(
    "--api-key", envvar="GOINFER_API_KEY", default=None, help="require this key (or $GOINFER_API_KEY)"
)
@click.option("--tls-cert", default=None, type=click.Path(dir_okay=False), help="PEM certificate for HTTPS")
@click.option("--tls-key", default=None, type=click.Path(dir_okay=False), help="PEM private key for HTTPS")
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    metavar="ORIGIN",
    help="a browser origin (scheme://host[:port]) besides the server's own that may call the API "
    "routes (never the admin ones); repeat for several",
)
@knob("--max-queue", ServeConfig, "max_queue", "waiting per model", type=_N0)
@knob("--max-body-bytes", ServeConfig, "max_body_bytes", "0: derived per route", type=_N0)
@click.option(
    "--allow-admin",
    is_flag=True,
    help="enable POST /admin/models/load, /unload, /plan and /pull (the web page's Models tab uses them)",
)
@knob(
    "--web/--no-web",
    ServeConfig,
    "web",
    "the chat page and its Models tab on / [default: on when --addr is loopback]",
)
@knob("--unload-drain-wait", ServeConfig, "unload_drain_wait_s", "seconds", type=click.FloatRange(min=0))
@knob(
    "--responses-store",
    ServeConfig,
    "responses_store",
    "stored /v1/responses kept in memory for previous_response_id",
    type=_N0,
)
@knob(
    "--max-concurrent",
    SchedulerConfig,
    "max_concurrent",
    "generations per model at once; their decode steps share one forward (1: one at a time)",
    type=_N1,
)
@knob(
    "--kv-sessions",
    SchedulerConfig,
    "kv_sessions",
    "finished conversations kept warm in the KV cache for prompt-prefix reuse (0: no reuse)",
    type=_N0,
)
@knob(
    "--session-dir",
    SchedulerConfig,
    "session_dir",
    "persist warm sessions here after each request and on shutdown; restored at start",
    type=click.Path(file_okay=False),
)
@knob(
    "--prefill-chunk",
    SchedulerConfig,
    "prefill_chunk",
    "prompt tokens a scheduler step: a long prompt holds running generations up this long at most",
    type=_N1,
)
@knob(
    "--spec",
    SchedulerConfig,
    "spec",
    "ngram: speculative decoding from prompt lookup, output identical to plain decoding (CPU)",
    type=click.Choice(["off", "ngram"]),
)
@options.drafter
@options.drafter_quant
@knob(
    "--prefix-reuse",
    SchedulerConfig,
    "prefix_reuse",
    "exact: replies bit-equal to a cold run's (on the CPU any shared token is reused; a GPU reuses "
    "whole prefill chunks only); longest: a GPU reuses the whole shared prefix too, equal to float "
    "rounding",
    type=click.Choice(["exact", "longest"]),
)
@knob(
    "--cpu-batch",
    SchedulerConfig,
    "batch",
    "batch concurrent generations' decode steps into one forward",
    type=click.Choice(["auto", "on", "off"]),
)
@knob("--ctx", SchedulerConfig, "context", "cap the context window (0: the model's own)", type=_N0)
@knob(
    "--kv-tokens",
    SchedulerConfig,
    "kv_tokens",
    "KV cache capacity in tokens, all sequences together (0: the context window)",
    type=_N0,
)
@knob(
    "--decisions-template",
    ServeConfig,
    "decisions_template",
    "how /v1/systemone puts a question to the model: chat-v1 (its chat template) or bare-v1 (plain text)",
    type=click.Choice(DECISIONS_TEMPLATES),
)
@knob(
    "--decisions-calibration",
    ServeConfig,
    "decisions_calibration",
    "per-kind temperatures for /v1/systemone, from `goinfer decisions-calibrate`",
    type=click.Path(dir_okay=False),
)
@knob(
    "--temp",
    SamplingDefaults,
    "temperature",
    "temperature for requests that set none (Claude Code sends none)",
    type=click.FloatRange(0, 2),
)
@knob("--top-p", SamplingDefaults, "top_p", "top_p for requests that set none", type=click.FloatRange(0, 1))
@knob("--top-k", SamplingDefaults, "top_k", "top_k for requests that set none", type=_N0)
@knob("--min-p", SamplingDefaults, "min_p", "min_p for requests that set none", type=click.FloatRange(0, 1))
@options.thinking
@options.reasoning_budget
@click.option(
    "--batch-dir",
    default=str(default_batch_dir()),
    show_default=True,
    type=click.Path(file_okay=False),
    help="uploads (/v1/files) and batches (/v1/batches, /v1/messages/batches) kept here; a batch the "
    "server stopped in resumes at start",
)
@knob("--max-file-bytes", BatchConfig, "max_file_bytes", "an upload's cap (413 over it)", type=_N1)
@knob("--quant", BuildOptions, "quant", "used only when a model must be built")
@options.kv_dtype
@options.no_selftest
@options.device
def serve(
    bundle: str | None,
    models: tuple[str, ...],
    embed_models: tuple[str, ...],
    embed_quant: str,
    addr: str,
    api_key: str | None,
    drafter: str | None,
    drafter_quant: str,
    quant: str,
    kv_dtype: str,
    no_selftest: bool,
    device: str,
    **knobs: Any,
) -> None:
    """Serve BUNDLE (or the models given by --model) over OpenAI-compatible and Anthropic Messages
    HTTP APIs (base URL http://ADDR/v1), and the embedding models given by --embed-model on
    /v1/embeddings. A model is a .giw, a pre-built store's zoo:DIR/NAME, or a checkpoint built once
    into the cache: a .gguf, a checkpoint directory, hf:OWNER/REPO:QUANT or a zoo name. With only
    --embed-model, no chat model is served."""
    from goinfer.compiler.resolve import model_specs
    from goinfer.compiler.sources.zoo import DEFAULT_MODEL
    from goinfer.serve import decisions, metrics, server
    from goinfer.serve.app import create_app
    from goinfer.serve.config import EmbeddingsConfig, parse_addr
    from goinfer.serve.guards import HALT
    from goinfer.serve.keys import CAPS

    try:
        host, port = parse_addr(addr)
        if knobs.get("grpc_addr"):
            parse_addr(knobs["grpc_addr"])  # the same HOST:PORT form, refused before any model loads
        defaults = BuildOptions(quant=quant, kv_dtype=KV_DTYPES[kv_dtype])
        draft_bundle = resolve_drafter(drafter, dataclasses.replace(defaults, quant=drafter_quant))
        engine = options.config(SchedulerConfig, knobs, drafter=str(draft_bundle) if draft_bundle else None)
        config = options.config(
            ServeConfig,
            knobs,
            host=host,
            port=port,
            api_key=api_key or None,
            max_concurrent=engine.max_concurrent,  # the scheduler's: the registry admits as many
            sampling=options.config(SamplingDefaults, knobs),
            thinking=options.config(ThinkingConfig, knobs),
            embeddings=EmbeddingsConfig(quant=embed_quant),
            batch=BatchConfig(dir=knobs["batch_dir"], max_file_bytes=knobs["max_file_bytes"]),
            swap_guard=SwapGuardConfig.parse(os.environ.get("GOINFER_SWAP_GUARD")),
        )
        server.check_exposure(config)  # before any model loads: a refusal costs nothing
        if config.metrics_addr:
            metrics.metrics_config(config)  # its address, and a key where it is not loopback
        decisions.load_calibration(config.decisions_calibration, config.decisions_template)
        server.log_to_stderr()
        context = server.ssl_context(config)
        load = engine_loader(defaults, not no_selftest, engine, device, config.swap_guard)
        specs = (*((bundle,) if bundle else ()), *models) or (() if embed_models else (DEFAULT_MODEL,))
        named = model_specs(specs)
        encoders = {
            name: load_encoder(name, ref, embed_quant, not no_selftest, device)
            for name, ref in embed_cli.encoder_specs(embed_models, {name for name, _ in named})
        }
        engines = {name: load(name, ref, None) for name, ref in named}
    except ValueError as e:  # bad --addr/--model, exposure, TLS files, and the loader's reasons
        fail(str(e))
    loader = load if config.allow_admin else None
    puller = ModelPuller(defaults) if config.serves_web else None  # the Models tab's pulls and builds
    app = create_app(engines, config, loader=loader, encoders=encoders, puller=puller)
    for line in server.banner(config, app[CAPS], engines, encoders):
        click.echo(line)
    click.echo(f"  {metrics.describe(config)}")
    click.echo(f"  {app[HALT].swap.describe()}")  # its baseline is measured with the models loaded
    if config.grpc_addr:  # KServe v2 gRPC on the app's own loop, started and stopped with it
        from goinfer.serve.kserve import grpc_server

        tls = (config.tls_cert, config.tls_key) if config.tls else None
        app.cleanup_ctx.append(grpc_server.lifetime(config.grpc_addr, tls))  # type: ignore[arg-type]
    server.run(app, config, context)


def load_encoder(name: str, ref: str, quant: str, self_test: bool, device: str):
    try:
        return embed_cli.load_encoder(ref, quant, self_test, device)  # looked up here: tests replace it
    except ValueError as e:
        raise ValueError(f"--embed-model {name}={e}") from None


def resolve_drafter(ref: str | None, defaults: BuildOptions):
    """--drafter's bundle (built once into the cache from a checkpoint or zoo name), or None."""
    if ref is None:
        return None
    from goinfer.compiler.resolve import resolve

    try:
        return resolve(ref, defaults)
    except user_errors() as e:
        raise ValueError(f"--drafter {ref}: {e}") from None


def engine_loader(
    defaults: BuildOptions,
    self_test: bool = True,
    engine: SchedulerConfig | None = None,
    device: str = "auto",
    swap: SwapGuardConfig | None = None,
):
    """(name, ref, quant or None) -> a ModelEngine: what `serve` loads its models with, and the
    admin route its later ones (a checkpoint built with `defaults`, the quant given). A reason not
    to load is one ValueError line: what was wrong with the file, never what it holds (the admin
    route passes it on to the caller)."""

    def load(name: str, ref: str, quant: str | None):
        from goinfer.compiler.resolve import resolve
        from goinfer.serve.guards import load_guarded
        from goinfer.serve.model_engine import ModelEngine

        try:
            bundle = resolve(ref, dataclasses.replace(defaults, quant=quant or defaults.quant))
            config, terms = fit_config(name, bundle, engine or SchedulerConfig())
            return load_guarded(
                swap or SwapGuardConfig(threshold_mb=None),
                lambda: ModelEngine.load(
                    bundle, self_test=None if self_test else False, config=config, device=device
                ),
                terms,
                lambda e: e.close(),
            )
        except user_errors() as e:
            raise ValueError(f"--model {name}={ref}: {e}") from None

    return load


def fit_config(name: str, bundle, engine: SchedulerConfig) -> tuple[SchedulerConfig, str]:
    """The model priced before it loads (runtime/fit.py): the scheduler config to load it with (its
    context shrunk when --ctx was not given and it does not fit), and the priced terms. FitError (a
    ValueError) refuses in one line."""
    from goinfer.artifacts import giw
    from goinfer.artifacts.manifest import Manifest
    from goinfer.runtime import fit

    with giw.open_bundle(bundle, verify="none") as b:  # the load verifies; this reads the manifest
        cost = fit.ModelCost.of(name, b, Manifest.of(b))
    decision = fit.plan(cost, engine.context, engine.kv_tokens, log=lambda line: click.echo(line, err=True))
    if decision.shrunk_from is not None:
        engine = dataclasses.replace(engine, context=decision.context)
    return engine, decision.price.describe()


@main.command("decisions-calibrate")
@click.argument("model")
@click.argument("labelled", type=click.Path(dir_okay=False))
@click.option(
    "-o", "--output", default="calibration.json", show_default=True, type=click.Path(dir_okay=False)
)
@knob("--template", ServeConfig, "decisions_template", None, type=click.Choice(DECISIONS_TEMPLATES))
@knob("--quant", BuildOptions, "quant", "used only when MODEL must be built")
@options.no_selftest
def decisions_calibrate(
    model: str, labelled: str, output: str, decisions_template: str, quant: str, no_selftest: bool
) -> None:
    """Fit /v1/systemone's per-kind temperatures on LABELLED (JSONL: a request's state and
    questions a line, with "answers" {question: the right option}) and write them for
    `serve --decisions-calibration`."""
    from pathlib import Path

    from goinfer.serve import decisions

    try:
        lines = Path(labelled).read_text().splitlines()
        engine = engine_loader(BuildOptions(quant=quant), not no_selftest)("model", model, None)
        try:
            fitted = decisions.calibrate(engine, lines, decisions_template)
        finally:
            engine.close()
        Path(output).write_text(json.dumps(fitted, indent=1) + "\n")
    except OSError as e:
        fail(f"{e.filename or labelled}: {e.strerror or e}")
    except ValueError as e:
        fail(f"{labelled}: {e}")
    for kind, t in fitted["temperatures"].items():
        click.echo(f"{kind}: temperature {t} from {fitted['fitted_on'][kind]} answers")
    click.echo(f"wrote {output}")


@main.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="the manifest as JSON")
@click.option("--verify", is_flag=True, help="hash every blob too (exit 2 on the first that does not match)")
def inspect(bundle: str, as_json: bool, verify: bool) -> None:
    """Show a bundle's manifest."""
    from goinfer.artifacts import giw, manifest

    try:
        # "full": every tensor's and module's sha256 and the zero padding between them, whatever
        # the cache remembers; the header's checksum over the manifest is checked on every open.
        with giw.open_bundle(bundle, verify="full" if verify else "none") as b:
            if as_json:
                # The typed manifest (checked as the runtime checks it), then the container's tables.
                body = {**manifest.Manifest.of(b).to_json(), **{k: b.manifest[k] for k in giw.RESERVED_KEYS}}
                click.echo(json.dumps(body, indent=2, sort_keys=True))
            else:
                click.echo(manifest.describe(b))
            if verify:  # on stderr under --json: stdout stays one JSON document
                blobs = f"{len(b.tensor_names())} tensors and {len(b.module_keys())} modules"
                click.echo(f"verified: {blobs} match their sha256", err=as_json)
    except user_errors() as e:
        fail(str(e))


main.add_command(zoo)
main.add_command(embed)
main.add_command(check)
main.add_command(chat)
main.add_command(cache_command)

if __name__ == "__main__":
    main()
