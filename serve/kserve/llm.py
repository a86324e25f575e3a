"""The LLM tensor convention of Triton's vLLM backend, read into a completions-style Job.

Inputs: `text_input` BYTES [1] (the prompt), optional `stream` BOOL [1], `sampling_parameters`
BYTES [1] holding a JSON object (vLLM's SamplingParams names), `exclude_input_in_output` BOOL [1].
Output: `text_output` BYTES [1]. Request parameters (gRPC's `parameters` map, the generate
routes' `parameters` object) may carry the same sampling keys and `stream`; the tensor wins.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..errors import bad_request
from ..events import CompletionChunks
from ..pipeline import Job, Sampling
from ..routes import DEFAULT_COMPLETION_MAX_TOKENS, MAX_STOPS

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
INPUTS = {  # name -> (datatype, optional): what ModelMetadata lists
    TEXT_INPUT: ("BYTES", False),
    "stream": ("BOOL", True),
    "sampling_parameters": ("BYTES", True),
    "exclude_input_in_output": ("BOOL", True),
}
FLOATS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0)}
FLOATS |= {"frequency_penalty": (-2.0, 2.0), "presence_penalty": (-2.0, 2.0)}
INTS = {"top_k": -1, "max_tokens": 1, "seed": None}  # name -> least value (None: any)
OTHER = {"stop", "stream", "exclude_input_in_output"}
# Request parameters that are transport, not sampling (Triton's own, KServe's): read past, not refused.
TRANSPORT = {"triton_enable_empty_final_response", "binary_data_output", "headers", "priority", "timeout"}


@dataclass(frozen=True)
class LLMRequest:
    prompt: str
    stream: bool
    exclude_input: bool
    sampling: Sampling


def llm_request(inputs: dict[str, Any], params: dict[str, Any]) -> LLMRequest:
    """`inputs`: tensor name -> its one element (str for BYTES, bool for BOOL), already decoded;
    `params`: the request's parameters. Every fault is a 400 naming the tensor or key."""
    unknown = sorted(set(inputs) - set(INPUTS))
    if unknown:
        raise bad_request(
            f"unknown input tensor {unknown[0]!r}: this model takes {sorted(INPUTS)}", unknown[0]
        )
    if TEXT_INPUT not in inputs:
        raise bad_request("input tensor 'text_input' (BYTES, shape [1]) is required", TEXT_INPUT)
    prompt = inputs[TEXT_INPUT]
    if not prompt:
        raise bad_request("text_input is empty", TEXT_INPUT)
    knobs = {k: v for k, v in params.items() if k not in TRANSPORT}
    raw = inputs.get("sampling_parameters")
    if raw:
        knobs |= _json_object(raw)
    stream = _bool(inputs.get("stream", knobs.pop("stream", False)), "stream")
    exclude = _bool(inputs.get("exclude_input_in_output", knobs.pop("exclude_input_in_output", False)), "")
    return LLMRequest(prompt, stream, exclude, sampling(knobs))


def _json_object(raw: str) -> dict[str, Any]:
    try:
        out = json.loads(raw)
    except ValueError as e:
        raise bad_request(f"sampling_parameters is not JSON: {e}", "sampling_parameters") from None
    if not isinstance(out, dict):
        raise bad_request("sampling_parameters must be a JSON object", "sampling_parameters")
    return out


def sampling(knobs: dict[str, Any]) -> Sampling:
    """vLLM's names (temperature, top_p, top_k with -1 for off, min_p, seed, max_tokens, stop,
    frequency/presence_penalty); numbers may come as strings, as Triton's parameters carry them."""
    unknown = sorted(set(knobs) - set(FLOATS) - set(INTS) - OTHER)
    if unknown:
        known = sorted({*FLOATS, *INTS, "stop"})
        raise bad_request(
            f"sampling parameter {unknown[0]!r} is not supported (supported: {known})", unknown[0]
        )
    f = {k: _float(knobs[k], k, *FLOATS[k]) for k in FLOATS if knobs.get(k) is not None}
    i = {k: _int(knobs[k], k, INTS[k]) for k in INTS if knobs.get(k) is not None}
    top_k = i.get("top_k")
    return Sampling(
        temperature=f.get("temperature"),
        top_p=f.get("top_p"),
        top_k=None if top_k is None else max(top_k, 0),  # vLLM's -1 is off, as 0 is here
        min_p=f.get("min_p"),
        seed=i.get("seed"),
        frequency_penalty=f.get("frequency_penalty"),
        presence_penalty=f.get("presence_penalty"),
        max_tokens=i.get("max_tokens"),
        default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS,  # vLLM's default too
        stops=_stops(knobs.get("stop")),
    )


def job(model: str, req: LLMRequest) -> Job:
    """A /v1/completions Job: the same pipeline, the same scheduler."""
    return Job(
        model=model,
        sampling=req.sampling,
        reply=lambda r: CompletionChunks(r.model, True, r.logprobs),
        prompt=req.prompt,
        prompt_field=TEXT_INPUT,
        stream=req.stream,
    )


def _bool(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    name = name or "exclude_input_in_output"
    raise bad_request(f"{name} must be a boolean, not {v!r}", name)


def _float(v: Any, name: str, lo: float, hi: float) -> float:
    try:
        x = float(v) if not isinstance(v, bool) else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if not lo <= x <= hi:  # NaN fails both
        raise bad_request(f"{name} must be a number in [{lo:g}, {hi:g}], not {v!r}", name)
    return x


def _int(v: Any, name: str, least: int | None) -> int:
    ok = isinstance(v, int) and not isinstance(v, bool)
    if (isinstance(v, str) and v.strip().lstrip("-").isdigit()) or (isinstance(v, float) and v.is_integer()):
        v, ok = int(v), True
    if not ok or (least is not None and v < least):
        floor = f" of at least {least}" if least is not None else ""
        raise bad_request(f"{name} must be an integer{floor}, not {v!r}", name)
    return v


def _stops(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop must be a string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop: at most {MAX_STOPS} strings", "stop")
    return tuple(stops)
