"""POST /v1/embeddings (OpenAI's shape) on a served encoder.

`input` is a string, an array of strings, an array of token ids or an array of token-id arrays.
Text gets the task's prompt prefix and the model's special tokens; token ids are the whole model
input, as given (checked against the vocabulary). Vectors are L2-normalized; `dimensions` cuts
them to their first N and normalizes again (Matryoshka); `encoding_format: base64` sends each as
little-endian float32 bytes, as the openai SDK decodes them.

Non-standard fields (the seed's): `input_type` "query" | "document" (default document, the
Cohere/Voyage convention) picks the model's prompt of that name where its card defines one;
`task` names any of the model's prompts, or "none"; `truncate: true` cuts an input over the
model's positions (kept, with the final special token) instead of refusing it, and the reply lists
the indices cut in `goinfer_truncated`. Every reply says which prompt it applied, in `goinfer_task`
{"name", "prompt"} and the X-Goinfer-Embedding-Task header: an index built under one prompt and
queried under another retrieves worse without any error, and the echo lets that be seen.

The inputs are tokenized off the event loop, then queued on the encoder's own worker
(embed_queue.py), which batches them with other requests'.
"""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal

import numpy as np
from aiohttp import web
from pydantic import Field

from .config import INPUT_TYPES
from .embed_queue import EncoderSlot
from .engine import Embedder
from .errors import bad_request
from .keys import CONFIG, REGISTRY
from .middleware import Body, body_cap_for, embeddings_body, parse, read_body

TASK_HEADER = "X-Goinfer-Embedding-Task"
NO_TASK = "none"
TokenIds = list[Annotated[int, Field(ge=0)]]


class EmbeddingsRequest(Body):
    input: str | list[str] | TokenIds | list[TokenIds]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # accepted, unused
    input_type: Literal["query", "document"] | None = None
    task: str | None = None
    truncate: bool = False


Inputs = list[str] | list[list[int]]


def inputs_of(req: EmbeddingsRequest, max_inputs: int) -> Inputs:
    """The request's inputs as a list of texts or of id lists; an empty one is a 400 naming it."""
    given = req.input
    single = isinstance(given, str) or (bool(given) and isinstance(given[0], int))
    items: Inputs = [given] if single else given  # type: ignore[assignment,list-item]
    if not items or (single and not given):
        raise bad_request("input is empty: give a string, an array of strings or of token ids", "input")
    if len(items) > max_inputs:
        raise bad_request(f"input has {len(items)} items; at most {max_inputs} a request", "input")
    for i, item in enumerate(items):
        if not item:
            raise bad_request(f"input[{i}] is empty", "input")
    return items


@dataclass(frozen=True)
class Task:
    name: str  # "none" where no prompt is applied
    prompt: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "prompt": self.prompt}


def task_of(prompts: dict[str, str], text: bool, input_type: str | None, task: str | None = None) -> Task:
    """The prompt the inputs get: `task` by name, else `input_type`'s (document by default) where
    the model defines it, else none. Token-id inputs (`text` False) are taken as given: no prompt."""
    if task is not None and task != NO_TASK and task not in prompts:
        names = ", ".join([*sorted(prompts), NO_TASK])
        raise bad_request(f"task {task!r} is not one of this model's prompts: {names}", "task")
    name = task or input_type or INPUT_TYPES[1]
    if not text or name not in prompts:
        return Task(NO_TASK, "")
    return Task(name, prompts[name])


def width(dimensions: int | None, full: int, name: str) -> int:
    """The reply's vector width: `dimensions` where given, never over the model's."""
    if dimensions is not None and dimensions > full:
        raise bad_request(
            f"dimensions {dimensions} is over the width of model {name!r} ({full})", "dimensions"
        )
    if dimensions is not None and dimensions < 1:
        raise bad_request(f"dimensions {dimensions}: at least 1", "dimensions")
    return dimensions or full


def token_ids(
    encoder: Embedder, name: str, items: Inputs, prompt: str, truncate: bool
) -> tuple[list[list[int]], list[int]]:
    """(each input's ids as the model takes them, the indices cut). Blocking: tokenizes."""
    vocab, most = encoder.spec.vocab_size, encoder.max_tokens
    out, cut = [], []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = encoder.tokenize(prompt + item)
        else:
            ids = list(item)
            if max(ids) >= vocab:
                where = f"the vocabulary of model {name!r} (size {vocab})"
                raise bad_request(f"input[{i}]: token id {max(ids)} is outside {where}", "input")
        if len(ids) > most:
            if not truncate:
                raise bad_request(
                    f"input[{i}] is {len(ids)} tokens; model {name!r} takes at most {most} tokens an "
                    'input (send "truncate": true to cut it)',
                    "input",
                    code="context_length_exceeded",
                )
            ids = encoder.truncate(ids)
            cut.append(i)
        out.append(ids)
    return out, cut


def shorten(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The first `dimensions` of each (normalized) vector, normalized again (Matryoshka)."""
    if dimensions >= vectors.shape[1]:
        return vectors
    v = vectors[:, :dimensions].astype(np.float32)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.where(norms > 0, norms, 1).astype(np.float32)


def encoded(row: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(row, "<f4").tobytes()).decode("ascii")
    return row.tolist()  # float32 values as doubles: each parses back to the same float32


def reply_body(
    vectors: np.ndarray, model: str, tokens: int, fmt: str, task: Task, cut: list[int] | None
) -> bytes:
    """The reply's JSON. Blocking (thousands of vectors are seconds of float formatting)."""
    data = [
        {"object": "embedding", "index": i, "embedding": encoded(row, fmt)} for i, row in enumerate(vectors)
    ]
    body: dict[str, Any] = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "goinfer_task": task.to_json(),
    }
    if cut is not None:
        body["goinfer_truncated"] = cut
    return json.dumps(body).encode()


def task_header(task: Task) -> str:
    # a header is ASCII: a prompt name from a model card that is not is sent escaped
    return task.name.encode("ascii", "backslashreplace").decode("ascii")


# -- the route ---------------------------------------------------------------------------------------
routes = web.RouteTableDef()


@routes.post("/v1/embeddings")
@embeddings_body
async def embeddings(request: web.Request) -> web.Response:
    loop = asyncio.get_running_loop()
    raw = await read_body(request, body_cap_for(request))
    # a batch body may be tens of MiB of ids: validated off the event loop
    req: EmbeddingsRequest = await loop.run_in_executor(None, parse, EmbeddingsRequest, raw)
    config = request.config_dict[CONFIG]
    items = inputs_of(req, config.embeddings.max_inputs)
    slot = request.config_dict[REGISTRY].route_encoder(req.model)
    encoder = slot.encoder
    size = width(req.dimensions, encoder.dimensions, slot.name)
    task = task_of(dict(encoder.prompts), isinstance(items[0], str), req.input_type, req.task)
    tokenize = partial(token_ids, encoder, slot.name, items, task.prompt, req.truncate)
    ids, cut = await loop.run_in_executor(None, tokenize)
    vectors = shorten(await slot.embed(ids, config.retry_after_s), size)
    tokens = sum(map(len, ids))
    args = (vectors, slot.name, tokens, req.encoding_format, task, cut if req.truncate else None)
    body = await loop.run_in_executor(None, reply_body, *args)
    # a page allowed by --cors-origin may read which prompt was applied, as a script can
    headers = {TASK_HEADER: task_header(task), "Access-Control-Expose-Headers": TASK_HEADER}
    return web.Response(body=body, content_type="application/json", headers=headers)


# -- /v1/models and /health ---------------------------------------------------------------------------
def target(encoder: Embedder) -> str:
    if encoder.device in ("cpu", "llvm"):
        return f"llvm/{encoder.tier}" if encoder.tier else "llvm"
    return encoder.device


def model_entry(slot: EncoderSlot, created: int) -> dict[str, Any]:
    e = slot.encoder
    return {
        "id": slot.name,
        "object": "model",
        "created": created,
        "owned_by": "goinfer",
        "kind": "embedding",
        "dimensions": e.dimensions,
        "max_tokens": e.max_tokens,
        "pooling": e.pooling,
        "prompts": dict(e.prompts),  # the task names `input_type` and `task` may pick
        "quant": e.manifest.quant,
        "target": target(e),
        "vision": False,
        "decisions": False,
    }


def health(slot: EncoderSlot) -> dict[str, Any]:
    e = slot.encoder
    return {
        "kind": "embedding",
        "loaded": True,
        "running_or_queued": slot.admitted,
        "target": target(e),
        "tier": e.tier,
        "load_seconds": round(e.load_seconds, 3),
        "selftest": e.self_test.to_json() if e.self_test is not None else None,
        "forwards": slot.forwards,
    }
