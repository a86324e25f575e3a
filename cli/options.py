"""Options several commands share, and `knob`: an option whose default is read from the config
that owns it (BuildOptions, runtime/config.py, serve/config.py, SamplingParams), never restated."""

from __future__ import annotations

import dataclasses
from typing import Any

import click
from goinfer.compiler.build import BuildOptions  # light: TVM is imported only inside build()
from goinfer.runtime.devices import DEVICES
from goinfer.runtime.thinking import MODES, ThinkingConfig

KV_DTYPES = {"f16": "float16", "f32": "float32"}


def knob(flag: str, owner: object, field: str, help: str | None, **attrs: Any):
    """An option that fills `owner`'s field `field` (a config class or instance) and takes its
    default from there: one home for each default."""
    return click.option(flag, field, default=getattr(owner, field), show_default=True, help=help, **attrs)


def config(cls: type, values: dict[str, Any], **fixed: Any) -> Any:
    """`cls` (a dataclass) from the options named as its fields, and `fixed` besides."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in values.items() if k in names}, **fixed})


kv_dtype = click.option(
    "--kv-dtype",
    type=click.Choice(list(KV_DTYPES)),
    default={v: k for k, v in KV_DTYPES.items()}[BuildOptions.kv_dtype],
    show_default=True,
    help="the KV cache's element type, compiled into the bundle (f16: half the memory and bytes a step)",
)
device = click.option(
    "--device",
    type=click.Choice(DEVICES),
    default="auto",
    show_default=True,
    help="where to run a bundle: auto takes its CUDA module when a GPU is usable, else its CPU module",
)
no_selftest = click.option("--no-selftest", is_flag=True, help="skip the startup kernel self-test")
drafter = click.option(
    "--drafter",
    default=None,
    metavar="MODEL",
    help="a small model with the same tokenizer (a .giw, .gguf or zoo name) drafts tokens the model "
    "verifies: the same output, faster where the small one guesses well (CPU; with --spec ngram it "
    "drafts where the n-grams find nothing)",
)
# A drafter's guesses only need to be likely, and it reads all its weights per guess: int4 made
# the 0.5B's step 12.0 ms against 16.7 for its GGUF blocks, and drafting for the 1.5B faster on
# every workload (bench/spec.py)
drafter_quant = click.option(
    "--drafter-quant",
    default="int4",
    show_default=True,
    help="the quant a --drafter checkpoint is built with (a .giw keeps its own)",
)
# Thinking models (runtime/thinking.py): `goinfer serve` and `goinfer chat` alike
thinking = knob(
    "--thinking",
    ThinkingConfig,
    "mode",
    "a thinking model's prompt: template (what its chat template renders when nothing is said), asis "
    "(the prompt as before thinking was modelled), on or off; a request's own choice wins",
    type=click.Choice(MODES),
)
reasoning_budget = knob(
    "--reasoning-budget",
    ThinkingConfig,
    "budget",
    "auto: a thinking block closes by 3/4 of max_tokens, leaving room to answer; N: and holds at most N "
    "tokens; unlimited: neither (a request's thinking_token_budget still holds)",
    metavar="auto|unlimited|N",
)
