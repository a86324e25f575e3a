"""`goinfer serve` as its own process on a free loopback port, started the way a user starts it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, key: str, log: Path, timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"goinfer serve exited with {proc.returncode}: {log.read_text()}")
        try:
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("goinfer serve did not come up")


@contextlib.contextmanager
def serving(name: str, bundle: Path, key: str, *extra: str, log: Path | None = None) -> Iterator[str]:
    """Yields the server's base URL (http://127.0.0.1:PORT); the process ends with the block.
    Its output goes to a file, `log` when given: a pipe nobody reads would fill with its log lines
    and stall the server."""
    port = free_port()
    cmd = [sys.executable, "-m", "goinfer.cli.main", "serve", "--model", f"{name}={bundle}"]
    cmd += ["--addr", f"127.0.0.1:{port}", "--api-key", key, *extra]
    with contextlib.ExitStack() as stack:
        log = log or Path(stack.enter_context(tempfile.TemporaryDirectory())) / "serve.log"
        out = stack.enter_context(log.open("w"))
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=os.environ)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}/health", key, log)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=30)
