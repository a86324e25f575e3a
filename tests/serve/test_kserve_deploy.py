"""deploy/: the Dockerfile and the KServe manifests, checked without a cluster: the YAML's shape and
cross-references (runtime <-> InferenceService, ports, probes, Prometheus annotations), and every
`goinfer serve` argument line parsed by the real CLI. (kubectl --dry-run=client needs a cluster's API
discovery for KServe's CRDs, and the kserve SDK does not install beside this protobuf: neither runs.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from fake_engine import ScriptedEngine
from goinfer.cli.main import serve
from goinfer.serve.app import create_app
from goinfer.serve.config import parse_addr

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(name: str) -> dict[str, Any]:
    (doc,) = list(yaml.safe_load_all((DEPLOY / "kserve" / name).read_text()))
    return doc


def serve_args(args: list[str]) -> dict[str, Any]:
    """The options `goinfer serve` reads from `args` (click refuses an unknown or malformed one)."""
    assert args[0] == "serve"
    return serve.make_context("serve", list(args[1:])).params


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_serving_runtime() -> None:
    rt = load("servingruntime.yaml")
    assert (rt["apiVersion"], rt["kind"]) == ("serving.kserve.io/v1alpha1", "ServingRuntime")
    spec = rt["spec"]
    assert {"v2", "grpc-v2"} <= set(spec["protocolVersions"])
    (c,) = spec["containers"]
    assert c["name"] == "kserve-container"
    params = serve_args(c["args"])
    assert params["models"] == ("zoo:/mnt/models",)  # KServe mounts storageUri there
    http_port = parse_addr(params["addr"])[1]
    grpc_port = parse_addr(params["grpc_addr"])[1]
    assert [p["containerPort"] for p in c["ports"]] == [http_port]
    assert c["livenessProbe"]["grpc"]["port"] == grpc_port
    probe = " ".join(c["readinessProbe"]["exec"]["command"])
    assert f"127.0.0.1:{http_port}/v2/health/ready" in probe and "GOINFER_API_KEY" in probe
    env = {e["name"]: e for e in c["env"]}
    assert "secretKeyRef" in env["GOINFER_API_KEY"]["valueFrom"]  # off loopback, serve refuses without it
    for where in (rt["metadata"]["annotations"], spec["annotations"]):
        assert where["prometheus.kserve.io/port"] == str(http_port)
        assert where["prometheus.kserve.io/path"] == "/metrics"


def test_the_probed_routes_exist() -> None:
    app = create_app({"fake": ScriptedEngine()})
    paths = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    assert {"/v2/health/ready", "/v2/health/live", "/metrics"} <= paths


def test_inference_service_uses_the_runtime() -> None:
    rt, isvc = load("servingruntime.yaml"), load("inferenceservice.yaml")
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    pred = isvc["spec"]["predictor"]
    model = pred["model"]
    assert model["runtime"] == rt["metadata"]["name"]
    formats = {(f["name"], f["version"]) for f in rt["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"]["version"]) in formats
    assert model["protocolVersion"] in rt["spec"]["protocolVersions"]
    assert re.match(r"^(oci|pvc|s3|gs|hf)://", model["storageUri"])
    assert pred["scaleMetric"] == "concurrency" and pred["scaleTarget"] >= 1
    assert 1 <= pred["minReplicas"] <= pred["maxReplicas"]


def test_dockerfile_runs_goinfer_serve() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    assert entry == ["goinfer"]
    params = serve_args(cmd)
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}
    assert {parse_addr(params["addr"])[1], parse_addr(params["grpc_addr"])[1]} == exposed
    for folder in ("artifacts", "compiler", "runtime", "serve", "cli"):  # pyproject's package-dir
        assert f"COPY {folder} ./{folder}" in text
    assert "COPY zoo/ /models/" in (DEPLOY / "modelcar.Dockerfile").read_text()
