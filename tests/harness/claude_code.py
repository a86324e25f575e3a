"""The Claude Code CLI for tests: installed from the npm registry into goinfer's cache, run headless.

`install()` returns the `claude` executable or raises `Unavailable` with the reason (no npm, the
registry unreachable, an install that failed); callers turn that into a skip that says why.
`run()` runs one `claude -p` task against an Anthropic-compatible base URL and returns its JSON
result (`--output-format json`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

VERSION = "2.1.197"
PACKAGE = f"@anthropic-ai/claude-code@{VERSION}"
CACHE = Path(os.environ.get("GOINFER_CACHE", Path.home() / ".cache" / "goinfer")) / "claude-code" / VERSION


class Unavailable(RuntimeError):
    """The CLI cannot be installed here; the message says why."""


def install(cache: Path = CACHE) -> Path:
    exe = cache / "node_modules" / ".bin" / "claude"
    if exe.exists():
        return exe
    npm = shutil.which("npm")
    if npm is None:
        raise Unavailable("npm is not installed: Claude Code comes from the npm registry")
    cache.mkdir(parents=True, exist_ok=True)
    # The native binary comes in a per-platform optional dependency; the package's install script
    # links it in place of the stub `claude.exe`.
    cmd = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(cache), PACKAGE]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"`npm install {PACKAGE}` took over 10 minutes") from None
    if done.returncode != 0 or not exe.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise Unavailable(f"`npm install {PACKAGE}` failed: {' | '.join(tail)}")
    try:
        check = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
        problem = check.stderr.strip()[:200] if check.returncode != 0 else ""
    except OSError as e:
        problem = str(e)
    if problem:
        shutil.rmtree(cache / "node_modules", ignore_errors=True)  # retried by the next install()
        raise Unavailable(f"the installed claude does not run here: {problem}")
    return exe


def environment(base_url: str, model: str, home: Path, api_key: str = "sk-goinfer") -> dict[str, str]:
    """What points Claude Code at goinfer: the README's variables, plus a private HOME (no user
    settings, no login) and no traffic other than the API's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    return env | {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": api_key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,  # its background requests: a served name, not a 404
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        # A 19k-token first prompt prefills for minutes on 2 cores: the request's timeout, and the
        # stream watchdog's (5 minutes at least; keep-alive pings do not reset it).
        "API_TIMEOUT_MS": str(30 * 60 * 1000),
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(30 * 60 * 1000),
    }


def run(
    exe: Path,
    prompt: str,
    cwd: Path,
    env: dict[str, str],
    *,
    tools: str | None = None,
    allow: str | None = None,
    timeout: float = 1800,
) -> dict[str, Any]:
    """`claude -p PROMPT --output-format json` in `cwd`; its result object (the CLI's own JSON).
    `tools` limits the built-in tools offered (default: all 24); `allow` lets those run unasked."""
    cmd = [str(exe), "-p", prompt, "--output-format", "json"]
    if tools is not None:
        cmd += ["--tools", tools]
    if allow is not None:
        cmd += ["--allowedTools", allow]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    try:
        return json.loads(done.stdout)
    except ValueError:
        raise AssertionError(
            f"claude exited {done.returncode} without a JSON result:\nstdout: {done.stdout[-2000:]}\n"
            f"stderr: {done.stderr[-2000:]}"
        ) from None
