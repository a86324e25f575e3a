"""KServe v2 tensors in and out: gRPC's (contents or raw_input_contents) and REST's JSON, each
read into {name: its one element} for llm.py. Every LLM input holds one element; any shape whose
elements number one ([1], [1, 1]) is taken, since batching clients add a dimension."""

from __future__ import annotations

import math
import struct
from typing import Any

from ..errors import bad_request
from . import grpc_predict_v2_pb2 as pb
from .llm import INPUTS, TEXT_OUTPUT

InferRequest = pb.ModelInferRequest


def _check(name: str, datatype: str, shape: list[int]) -> None:
    want = INPUTS.get(name, (None,))[0]
    if want is not None and datatype != want:
        raise bad_request(f"input {name!r} must have datatype {want}, not {datatype!r}", name)
    if any(d < 0 for d in shape) or math.prod(shape) != 1:
        raise bad_request(f"input {name!r} must hold one element (shape [1]), not shape {list(shape)}", name)


def _text(b: bytes, name: str) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(f"input {name!r} is not UTF-8 text", name) from None


def grpc_inputs(req: InferRequest) -> dict[str, Any]:
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise bad_request(
            f"raw_input_contents holds {len(raw)} tensors for {len(req.inputs)} inputs", "inputs"
        )
    out: dict[str, Any] = {}
    for i, t in enumerate(req.inputs):
        if t.name in out:
            raise bad_request(f"input {t.name!r} is given twice", t.name)
        _check(t.name, t.datatype, list(t.shape))
        if t.datatype == "BYTES":
            items = _raw_bytes(raw[i], t.name) if raw else list(t.contents.bytes_contents)
            value: Any = _text(_one(items, t.name), t.name)
        elif t.datatype == "BOOL":
            items = [b != 0 for b in raw[i]] if raw else list(t.contents.bool_contents)
            value = _one(items, t.name)
        else:
            value = None  # an input no LLM here takes: llm.py names it
        out[t.name] = value
    return out


def _one(items: list[Any], name: str) -> Any:
    if len(items) != 1:
        raise bad_request(f"input {name!r} must hold one element, not {len(items)}", name)
    return items[0]


def _raw_bytes(raw: bytes, name: str) -> list[bytes]:
    """Triton's raw BYTES: each element a 4-byte little-endian length, then that many bytes."""
    items, at = [], 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise bad_request(f"input {name!r}: raw BYTES end inside a length prefix", name)
        (n,) = struct.unpack_from("<I", raw, at)
        if at + 4 + n > len(raw):
            raise bad_request(f"input {name!r}: raw BYTES element runs past the data", name)
        items.append(raw[at + 4 : at + 4 + n])
        at += 4 + n
    return items


def raw_bytes(text: str) -> bytes:
    b = text.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def grpc_params(params: Any) -> dict[str, Any]:
    """A request's `parameters` map as plain values."""
    return {
        k: getattr(v, v.WhichOneof("parameter_choice"))
        for k, v in params.items()
        if v.WhichOneof("parameter_choice")
    }


def set_params(target: Any, values: dict[str, Any]) -> None:
    for k, v in values.items():
        p = target[k]
        if isinstance(v, bool):
            p.bool_param = v
        elif isinstance(v, int):
            p.int64_param = v
        elif isinstance(v, float):
            p.double_param = v
        else:
            p.string_param = str(v)


def check_outputs(names: list[str]) -> None:
    for n in names:
        if n != TEXT_OUTPUT:
            raise bad_request(f"requested output {n!r} does not exist: this model has {TEXT_OUTPUT!r}", n)


def json_inputs(body: Any, binary: bytes = b"") -> tuple[dict[str, Any], dict[str, Any], list[str], str]:
    """REST v2's infer body -> (inputs, parameters, requested outputs, id). An input whose
    `parameters.binary_data_size` is set takes its bytes from `binary`, in input order (Triton's
    binary extension), in the raw layout gRPC's raw_input_contents has."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        raise bad_request("the body must be a JSON object with an 'inputs' list", "inputs")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise bad_request("parameters must be an object", "parameters")
    out: dict[str, Any] = {}
    at = 0
    for i, t in enumerate(body["inputs"]):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad_request(f"inputs.{i} must be an object with a name", f"inputs.{i}")
        name, shape, data = t["name"], t.get("shape"), t.get("data")
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or at + size > len(binary):
                raise bad_request(f"input {name!r}: binary_data_size runs past the body", name)
            chunk, at = binary[at : at + size], at + size
            want = INPUTS.get(name, ("",))[0]
            data = (
                [_text(b, name) for b in _raw_bytes(chunk, name)]
                if want == "BYTES"
                else [b != 0 for b in chunk]
            )
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise bad_request(f"input {name!r}: shape must be a list of integers", name)
        _check(name, t.get("datatype"), shape)
        while isinstance(data, list) and len(data) == 1:
            data = data[0]  # [x] and [[x]]: the one element
        want = INPUTS.get(name, ("",))[0]
        if (want == "BYTES" and not isinstance(data, str)) or (want == "BOOL" and not isinstance(data, bool)):
            raise bad_request(f"input {name!r}: data must hold one {want} element", name)
        out[name] = data
    outputs = body.get("outputs") or []
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise bad_request("outputs must be a list of objects", "outputs")
    ident = body.get("id", "")
    return out, params, [str(o.get("name")) for o in outputs], ident if isinstance(ident, str) else str(ident)
