"""`goinfer embed`, and the encoder loader `goinfer serve --embed-model` shares with it.

An encoder reference is resolved as --model's are (compiler/resolve.py): a .giw as given, a
checkpoint (a Hugging Face folder, hf:OWNER/REPO:safetensors, a zoo name such as all-minilm-l6-v2)
built once into the cache with the encoder's quant, then reused.
"""

from __future__ import annotations

import json
import sys

import click
from goinfer.compiler.build import BuildOptions
from goinfer.serve.config import EMBED_QUANTS, INPUT_TYPES, EmbeddingsConfig

from . import options
from .errors import fail, user_errors

embed_quant = click.option(
    "--embed-quant",
    type=click.Choice(EMBED_QUANTS),
    default=EmbeddingsConfig.quant,
    show_default=True,
    help="the quant an --embed-model checkpoint is built with (a .giw keeps its own)",
)


def load_encoder(ref: str, quant: str, self_test: bool = True, device: str = "auto"):
    """REF -> a loaded runtime Encoder. A reason not to is one ValueError line."""
    from goinfer.compiler.resolve import resolve

    try:
        bundle = resolve(ref, BuildOptions(quant=quant))
        from goinfer.runtime.encoder import Encoder  # the runtime (TVM) once there is a bundle

        return Encoder.load(bundle, self_test=None if self_test else False, device=device)
    except user_errors() as e:
        raise ValueError(f"{ref}: {e}") from None


def encoder_specs(specs: tuple[str, ...], taken: set[str]) -> list[tuple[str, str]]:
    """--embed-model's `[NAME=]REF`s -> (name, ref), named as --model's are; a name a decoder
    (`taken`) or another encoder has is refused."""
    from goinfer.compiler.resolve import model_specs

    out: list[tuple[str, str]] = []
    for spec in specs:
        for name, ref in model_specs([spec]):
            if name in taken:
                why = f"the name {name!r} is given twice; name them NAME=REF"
                raise ValueError(f"--embed-model {spec}: {why}")
            taken.add(name)
            out.append((name, ref))
    return out


@click.command()
@click.argument("model")
@click.argument("texts", nargs=-1)
@click.option(
    "--dimensions",
    type=click.IntRange(min=1),
    default=None,
    help="cut each vector to its first N and normalize again (Matryoshka) [default: the model's width]",
)
@click.option(
    "--input-type",
    type=click.Choice(INPUT_TYPES),
    default=None,
    help="the model's query or document prompt, where its card defines them [default: document]",
)
@click.option("--truncate", is_flag=True, help="cut a text over the model's positions instead of refusing it")
@click.option(
    "--quant",
    type=click.Choice(EMBED_QUANTS),
    default=EmbeddingsConfig.quant,
    show_default=True,
    help="used only when MODEL must be built",
)
@options.no_selftest
@options.device
def embed(
    model: str,
    texts: tuple[str, ...],
    dimensions: int | None,
    input_type: str | None,
    truncate: bool,
    quant: str,
    no_selftest: bool,
    device: str,
) -> None:
    """Print the vectors of TEXTS (or of each non-empty line of stdin, when none are given) by the
    embedding model MODEL (a .giw, a checkpoint folder, hf:OWNER/REPO:safetensors or a zoo name),
    as one JSON object: model, dimensions, task, usage and data (index, embedding)."""
    from goinfer.serve import embeddings
    from goinfer.serve.errors import APIError

    items = list(texts) or [line for line in sys.stdin.read().splitlines() if line.strip()]
    if not items:
        fail("no texts: give them as arguments or as lines on stdin")
    try:
        [(name, ref)] = encoder_specs((model,), set())
        encoder = load_encoder(ref, quant, not no_selftest, device)
        try:
            task = embeddings.task_of(dict(encoder.prompts), True, input_type)
            size = embeddings.width(dimensions, encoder.dimensions, name)
            ids, cut = embeddings.token_ids(encoder, name, items, task.prompt, truncate)
            vectors = embeddings.shorten(encoder.embed_ids(ids), size)
        finally:
            encoder.close()
    except APIError as e:
        fail(e.message)
    except ValueError as e:  # the loader's reasons, and the encoder's own
        fail(str(e).splitlines()[0])
    out = {
        "model": name,
        "dimensions": size,
        "task": task.to_json(),
        "usage": {"prompt_tokens": sum(map(len, ids))},
        "data": [{"index": i, "embedding": row.tolist()} for i, row in enumerate(vectors)],
    }
    if truncate:
        out["truncated"] = cut
    click.echo(json.dumps(out))
