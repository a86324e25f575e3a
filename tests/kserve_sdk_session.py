"""Runs in the kserve SDK's own venv (bench.reference_venv.KSERVE; tests/kserve_sdk.py starts it),
never in the project's: kserve pins protobuf 6 and our gRPC code is protobuf 7's. It imports only
kserve and its dependencies, and prints what kserve's clients and models saw as one JSON line.

  clients:   kserve's InferenceGRPCClient and InferenceRESTClient (v2) against a running server:
             health, model readiness, infer with the LLM tensors (text_input, sampling_parameters ->
             text_output) in each of the SDK's encodings, and the errors the SDK raises; model
             metadata through kserve's generated gRPC stub and its REST v2 pydantic models (its
             clients have no metadata call).
  manifests: each deploy/kserve/*.yaml built into kserve's models (V1alpha1ServingRuntime,
             V1beta1InferenceService, with the Kubernetes client's V1Container, V1Probe, ...) by the
             models' own constructors, then serialized back by kserve's ApiClient.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

NOPE = "no-such-model"


def _text(values: Any) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values.flatten()]


def _param(value: Any) -> Any:
    """A response parameter as plain JSON: gRPC's come as InferParameter messages."""
    if hasattr(value, "WhichOneof"):
        return getattr(value, value.WhichOneof("parameter_choice"))
    return value


def describe(response: Any) -> dict[str, Any]:
    """An InferResponse as JSON: its id, model and parameters, and each output's tensor."""
    return {
        "id": response.id,
        "model_name": response.model_name,
        "parameters": {k: _param(v) for k, v in (response.parameters or {}).items()},
        "outputs": [
            {"name": o.name, "datatype": o.datatype, "shape": list(o.shape), "text": _text(o.as_numpy())}
            for o in response.outputs
        ],
    }


def llm_request(model: str, a: argparse.Namespace, binary: bool, rid: str) -> Any:
    """The LLM tensor convention (Triton's vLLM backend, KServe's huggingface runtime): one BYTES
    prompt, the sampling knobs as one JSON BYTES tensor; `binary` picks the SDK's raw encoding
    (gRPC raw_input_contents / REST binary extension) or its explicit one (contents / JSON data)."""
    import numpy as np
    from kserve import InferInput, InferRequest

    tensors = [
        ("text_input", "BYTES", np.array([a.prompt.encode()], dtype=np.object_)),
        ("sampling_parameters", "BYTES", np.array([a.params.encode()], dtype=np.object_)),
    ]
    if a.exclude_input:
        tensors.append(("exclude_input_in_output", "BOOL", np.array([True], dtype=bool)))
    inputs = []
    for name, datatype, values in tensors:
        t = InferInput(name, list(values.shape), datatype)
        t.set_data_from_numpy(values, binary_data=binary)
        inputs.append(t)
    return InferRequest(model_name=model, infer_inputs=inputs, request_id=rid)


async def grpc_session(a: argparse.Namespace) -> dict[str, Any]:
    import grpc
    from google.protobuf import json_format
    from kserve import InferenceGRPCClient
    from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
    from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub

    auth = (("authorization", f"Bearer {a.key}"),)
    out: dict[str, Any] = {}
    async with InferenceGRPCClient(a.grpc, timeout=a.timeout) as c:
        out["live"] = await c.is_server_live(headers=auth)
        out["ready"] = await c.is_server_ready(headers=auth)
        out["model_ready"] = await c.is_model_ready(a.model, headers=auth)
        for how, binary in (("raw", True), ("contents", False)):
            r = await c.infer(llm_request(a.model, a, binary, f"grpc-{how}"), headers=auth)
            out[f"infer_{how}"] = describe(r)
        for what, call in (
            ("missing_model", c.infer(llm_request(NOPE, a, True, "nope"), headers=auth)),
            ("no_key", c.is_server_live()),
        ):
            try:
                await call
                out[what] = ["OK", ""]
            except grpc.RpcError as e:
                out[what] = [e.code().name, e.details()]
    async with grpc.aio.insecure_channel(a.grpc) as channel:
        stub = GRPCInferenceServiceStub(channel)
        meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name=a.model), metadata=auth)
        out["model_metadata"] = json_format.MessageToDict(meta, preserving_proto_field_name=True)
        server = await stub.ServerMetadata(pb.ServerMetadataRequest(), metadata=auth)
        out["server_metadata"] = json_format.MessageToDict(server, preserving_proto_field_name=True)
    return out


async def rest_session(a: argparse.Namespace) -> dict[str, Any]:
    import httpx
    from kserve import InferenceRESTClient, RESTConfig
    from kserve.protocol.rest.v2_datamodels import ModelMetadataResponse, ServerMetadataResponse

    auth = {"authorization": f"Bearer {a.key}"}
    out: dict[str, Any] = {}
    # the SDK writes its content-type headers into the dict it is given: a fresh one a call
    async with InferenceRESTClient(RESTConfig(protocol="v2", timeout=a.timeout)) as c:
        out["live"] = await c.is_server_live(a.rest, headers=dict(auth))
        out["ready"] = await c.is_server_ready(a.rest, headers=dict(auth))
        out["model_ready"] = await c.is_model_ready(a.rest, a.model, headers=dict(auth))
        out["missing_model_ready"] = await c.is_model_ready(a.rest, NOPE, headers=dict(auth))
        for how, binary in (("binary", True), ("json", False)):
            req = llm_request(a.model, a, binary, f"rest-{how}")
            out[f"infer_{how}"] = describe(await c.infer(a.rest, req, model_name=a.model, headers=dict(auth)))
        for what, call in (
            ("missing_model", c.infer(a.rest, llm_request(NOPE, a, False, "n"), NOPE, dict(auth))),
            ("no_key", c.is_server_live(a.rest)),
        ):
            try:
                await call
                out[what] = [200, ""]
            except httpx.HTTPStatusError as e:  # the SDK's message carries the server's error text
                out[what] = [e.response.status_code, str(e)]
    async with httpx.AsyncClient(timeout=a.timeout) as h:
        meta = (await h.get(f"{a.rest}/v2/models/{a.model}", headers=auth)).json()
        out["model_metadata"] = ModelMetadataResponse.model_validate(meta).model_dump()
        server = (await h.get(f"{a.rest}/v2", headers=auth)).json()
        out["server_metadata"] = ServerMetadataResponse.model_validate(server).model_dump()
    return out


async def clients(a: argparse.Namespace) -> dict[str, Any]:
    return {"kserve": version("kserve"), "grpc": await grpc_session(a), "rest": await rest_session(a)}


# --- manifests -------------------------------------------------------------------------------------

PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
}


class Refused(ValueError):
    pass


def build(data: Any, kind: str, where: str) -> Any:
    """`data` (parsed YAML) as the OpenAPI type `kind`, built by the models' own constructors (which
    check required fields); a key the model does not know, or a value of the wrong type, is refused
    with its path. kserve's ApiClient resolves only kserve's model names, so the Kubernetes ones
    (V1Container, V1Probe, ...) come from the Kubernetes client here, as KServe's CRDs embed them."""
    import kserve.models
    import kubernetes.client.models

    # kserve's generator writes list[X] and dict(str, X); the Kubernetes client's, List[X] and Dict[str, X]
    if m := re.fullmatch(r"[Ll]ist\[(.+)\]", kind):
        if not isinstance(data, list):
            raise Refused(f"{where}: {type(data).__name__} where a list is wanted")
        return [build(v, m.group(1), f"{where}[{i}]") for i, v in enumerate(data)]
    if m := re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", kind):
        if not isinstance(data, dict):
            raise Refused(f"{where}: {type(data).__name__} where a mapping is wanted")
        item = m.group(1) or m.group(2)
        return {k: build(v, item, f"{where}.{k}") for k, v in data.items()}
    if kind == "object":
        return data
    if kind in PRIMITIVES:
        if not isinstance(data, PRIMITIVES[kind]) or (kind != "bool" and isinstance(data, bool)):
            raise Refused(f"{where}: {data!r} where {kind} is wanted")
        return data
    cls = getattr(kserve.models, kind, None) or getattr(kubernetes.client.models, kind)
    if not isinstance(data, dict):
        raise Refused(f"{where}: {type(data).__name__} where {kind} is wanted")
    known = {key: attr for attr, key in cls.attribute_map.items()}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise Refused(f"{where}: {kind} has no field {', '.join(unknown)}")
    kwargs = {known[k]: build(v, cls.openapi_types[known[k]], f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:  # a missing required field (the Kubernetes models are pydantic's)
        raise Refused(f"{where}: {kind}: {' '.join(str(e).split())}") from e


def servingruntime_fields(rt: Any) -> dict[str, Any]:
    """What the cluster acts on, read through the models' attributes."""
    (c,) = rt.spec.containers
    return {
        "name": rt.metadata.name,
        "annotations": rt.metadata.annotations,
        "spec_annotations": rt.spec.annotations,
        "formats": [[f.name, f.version, f.auto_select] for f in rt.spec.supported_model_formats],
        "protocols": rt.spec.protocol_versions,
        "multi_model": rt.spec.multi_model,
        "container": c.name,
        "args": c.args,
        "ports": [[p.name, p.container_port, p.protocol] for p in c.ports],
        "readiness_exec": c.readiness_probe._exec.command,
        "readiness_period_s": c.readiness_probe.period_seconds,
        "liveness_grpc_port": c.liveness_probe.grpc.port,
        "env_secret": {e.name: e.value_from.secret_key_ref.name for e in c.env if e.value_from},
        "env": {e.name: e.value for e in c.env if e.value is not None},
        "memory_limit": c.resources.limits["memory"],
    }


def inferenceservice_fields(isvc: Any) -> dict[str, Any]:
    pred = isvc.spec.predictor
    model = pred.model
    return {
        "name": isvc.metadata.name,
        "annotations": isvc.metadata.annotations,
        "runtime": model.runtime,
        "format": [model.model_format.name, model.model_format.version],
        "protocol": model.protocol_version,
        "storage_uri": model.storage_uri,
        "min_replicas": pred.min_replicas,
        "max_replicas": pred.max_replicas,
        "scale_metric": pred.scale_metric,
        "scale_target": pred.scale_target,
        "cpu_request": model.resources.requests["cpu"],
    }


def differences(doc: Any, back: Any, where: str) -> tuple[list[str], dict[str, Any]]:
    """What the round trip through the models lost (paths whose value changed or went missing) and
    what it added (paths the models fill with their defaults)."""
    if isinstance(doc, dict) and isinstance(back, dict):
        lost: list[str] = []
        added = {f"{where}.{k}".lstrip("."): back[k] for k in back.keys() - doc.keys()}
        for k, v in doc.items():
            if k not in back:
                lost.append(f"{where}.{k}".lstrip("."))
                continue
            sub_lost, sub_added = differences(v, back[k], f"{where}.{k}")
            lost += sub_lost
            added.update(sub_added)
        return lost, added
    if isinstance(doc, list) and isinstance(back, list) and len(doc) == len(back):
        lost, added = [], {}
        for i, (d, b) in enumerate(zip(doc, back, strict=True)):
            sub_lost, sub_added = differences(d, b, f"{where}[{i}]")
            lost += sub_lost
            added.update(sub_added)
        return lost, added
    return ([] if doc == back and type(doc) is type(back) else [where.lstrip(".")]), {}


KINDS = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): ("V1alpha1ServingRuntime", servingruntime_fields),
    ("serving.kserve.io/v1beta1", "InferenceService"): ("V1beta1InferenceService", inferenceservice_fields),
}


def manifests(a: argparse.Namespace) -> dict[str, Any]:
    import kserve
    import yaml

    api = kserve.ApiClient()
    out: dict[str, Any] = {"kserve": version("kserve")}
    for path in sorted(Path(a.folder).glob("*.yaml")):
        (doc,) = list(yaml.safe_load_all(path.read_text()))
        model_name, fields = KINDS[(doc["apiVersion"], doc["kind"])]
        try:
            model = build(doc, model_name, doc["kind"])
        except Refused as e:
            out[path.name] = {"model": model_name, "refused": str(e)}
            continue
        back = api.sanitize_for_serialization(model)
        lost, added = differences(doc, back, "")
        out[path.name] = {"model": type(model).__name__, "lost": lost, "added": added}
        out[path.name]["fields"] = fields(model)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("clients")
    c.add_argument("--grpc", required=True, help="host:port of the gRPC server")
    c.add_argument("--rest", required=True, help="http://host:port of the HTTP server")
    c.add_argument("--key", required=True)
    c.add_argument("--model", required=True)
    c.add_argument("--prompt", required=True)
    c.add_argument("--params", default="{}", help="sampling_parameters, as JSON")
    c.add_argument("--exclude-input", action="store_true", help="send exclude_input_in_output")
    c.add_argument("--timeout", type=float, default=60.0)
    m = sub.add_parser("manifests")
    m.add_argument("folder", help="the folder of KServe manifests (deploy/kserve)")
    a = p.parse_args()
    # `import kserve` parses sys.argv with its model server's options (and takes --grpc for a
    # prefix of its --grpc_port): it must see none of ours
    del sys.argv[1:]
    out = asyncio.run(clients(a)) if a.command == "clients" else manifests(a)
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
