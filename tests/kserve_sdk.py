"""The kserve SDK's own clients and models, run from the tests. kserve pins protobuf<7 and our
checked-in gRPC code is protobuf 7's, so the SDK lives in a venv of its own
(bench.reference_venv.KSERVE, made on first use: about a minute and 450 MB under the cache) and
tests/kserve_sdk_session.py runs there as a subprocess, printing what it saw as JSON."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from bench import reference_venv

SESSION = Path(__file__).with_name("kserve_sdk_session.py")
DEPLOY_KSERVE = Path(__file__).resolve().parents[1] / "deploy" / "kserve"


def run(*args: str, timeout: float = 600) -> dict[str, Any]:
    """kserve_sdk_session.py's JSON for `args`, the venv made first where it is missing."""
    python = reference_venv.ensure(spec=reference_venv.KSERVE)
    proc = subprocess.run(
        [str(python), str(SESSION), *args],
        env=reference_venv.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-30:])
        raise AssertionError(f"kserve SDK session failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.splitlines()[-1])


def clients(
    grpc: str,
    rest: str,
    key: str,
    model: str,
    prompt: str,
    params: dict[str, Any],
    exclude_input: bool = False,
    timeout: float = 60,
) -> dict[str, Any]:
    """kserve's InferenceGRPCClient (at host:port `grpc`) and InferenceRESTClient (at `rest`)."""
    args = ["clients", "--grpc", grpc, "--rest", rest, "--key", key, "--model", model]
    args += ["--prompt", prompt, "--params", json.dumps(params), "--timeout", str(timeout)]
    if exclude_input:
        args.append("--exclude-input")
    return run(*args)


def manifests(folder: Path = DEPLOY_KSERVE) -> dict[str, Any]:
    return run("manifests", str(folder))
