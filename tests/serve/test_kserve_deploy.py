"""deploy/: the Dockerfile and the KServe manifests, checked without a cluster: the YAML's shape and
cross-references (runtime <-> InferenceService, ports, probes, Prometheus annotations), every
`goinfer serve` argument line parsed by the real CLI, and each manifest built into the kserve SDK's
own models (in the SDK's venv: tests/kserve_sdk.py). (kubectl --dry-run=client needs a cluster's API
discovery to map even a built-in kind, so it cannot run here.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kserve_sdk
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


def test_the_kserve_sdk_models_hold_the_manifests() -> None:
    """kserve's V1alpha1ServingRuntime and V1beta1InferenceService (with the Kubernetes client's
    V1Container, V1Probe, ... inside) built from the YAML by their own constructors: no field unknown
    to them or of the wrong type, nothing lost when kserve's ApiClient serializes them back, and the
    fields the cluster acts on read through the models' attributes."""
    out = kserve_sdk.manifests()
    rt, isvc = out["servingruntime.yaml"], out["inferenceservice.yaml"]
    assert (rt["model"], isvc["model"]) == ("V1alpha1ServingRuntime", "V1beta1InferenceService"), out
    assert rt["lost"] == [] and rt["added"] == {}
    # the one default the models add: ModelSpec is a container, whose name KServe fills in
    assert isvc["lost"] == [] and isvc["added"] == {"spec.predictor.model.name": ""}

    f = rt["fields"]
    params = serve_args(f["args"])
    http_port, grpc_port = parse_addr(params["addr"])[1], parse_addr(params["grpc_addr"])[1]
    assert f["container"] == "kserve-container" and f["ports"] == [["http1", http_port, "TCP"]]
    assert f["liveness_grpc_port"] == grpc_port and f["readiness_period_s"] > 0
    assert f"127.0.0.1:{http_port}/v2/health/ready" in " ".join(f["readiness_exec"])
    scrape = {"prometheus.kserve.io/port": str(http_port), "prometheus.kserve.io/path": "/metrics"}
    assert f["annotations"] == f["spec_annotations"] == scrape
    assert f["env_secret"] == {"GOINFER_API_KEY": "goinfer-api-key"}
    assert f["formats"] == [["goinfer", "1", True]] and set(f["protocols"]) == {"v2", "grpc-v2"}
    assert f["multi_model"] is False

    i = isvc["fields"]
    want = load("inferenceservice.yaml")["spec"]["predictor"]
    assert (i["runtime"], i["format"], i["protocol"]) == (f["name"], f["formats"][0][:2], "v2")
    assert i["storage_uri"] == want["model"]["storageUri"]
    assert (i["min_replicas"], i["max_replicas"]) == (want["minReplicas"], want["maxReplicas"])
    assert (i["scale_metric"], i["scale_target"]) == ("concurrency", want["scaleTarget"])
    assert i["annotations"] == {"serving.kserve.io/deploymentMode": "RawDeployment"}


def test_the_kserve_sdk_models_refuse_a_broken_manifest(tmp_path: Path) -> None:
    """The check above has teeth: a misspelt field, a port written as a string and a container
    without its name are each refused, with where."""
    rt = (DEPLOY / "kserve" / "servingruntime.yaml").read_text()
    isvc = (DEPLOY / "kserve" / "inferenceservice.yaml").read_text()
    breaks = {
        "misspelt.yaml": isvc.replace("scaleTarget:", "scaleTargt:"),
        "port.yaml": rt.replace("containerPort: 8080", 'containerPort: "8080"'),
        "unnamed.yaml": rt.replace("- name: kserve-container\n      image:", "- image:"),
    }
    for name, text in breaks.items():
        assert text not in (rt, isvc), name
        (tmp_path / name).write_text(text)
    out = kserve_sdk.manifests(tmp_path)
    assert "V1beta1PredictorSpec has no field scaleTargt" in out["misspelt.yaml"]["refused"]
    assert "containerPort: '8080' where int is wanted" in out["port.yaml"]["refused"]
    unnamed = out["unnamed.yaml"]["refused"]
    assert (
        unnamed.startswith("ServingRuntime.spec.containers[0]: V1Container")
        and "name Field required" in unnamed
    )


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
