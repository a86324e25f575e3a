"""The serving engine against llama.cpp, through the OpenAI HTTP API: `python -m bench.serving`.

    python -m bench.serving                          # agent, concurrency and depth on both Qwen coders
    python -m bench.serving --bench agent --models qwen2.5-coder-0.5b --rounds 3
    python -m bench.serving --bench agent --agent-prefix 15000   # an agent-sized prefix
    python -m bench.serving --bench concurrency --clients 1,4 --goinfer-args "--max-concurrent 4"
    python -m bench.serving --bench depth --depths 1024 --models qwen2.5-coder-0.5b

Both engines get the same GGUF (ours as its bundle, built on first use and cached) and `--threads`
threads each, in the same run; requests go to one server then the other (A/B) wherever a bench
allows. Every request is streamed at temperature 0 with `stream_options.include_usage`. Progress goes
to stderr, the tables to stdout, everything measured to `--json` (bench/results/serving.json), with
the load average before each bench. `--goinfer-args` passes flags to `goinfer serve` (the defaults
are its own); the server logs go to /tmp/bench-*.log.

agent: a `--turns` (4) turn chat over a fixed prefix of about 4,000 tokens, a long system prompt and
  20 OpenAI `tools`, written here deterministically (`--agent-prefix N`: about N tokens, the rest a
  generated file index in the system prompt). Each turn appends the previous reply (and a
  fixed result for each tool call in it) and a short user message, as an agent harness sends them;
  each server keeps its own conversation. Per turn: TTFT, the request sent to the first content or
  tool-call delta; prompt tokens, and the tokens the server reused, from `usage.prompt_tokens_details.
  cached_tokens` (llama-server: that, else `timings.cache_n`). llama-server runs one slot with its
  default prompt cache (`-np 1 -c 8192`, more for a longer prefix, `cache_prompt` on). Every round
  opens its system prompt with its own number, so no round reuses another's prefix. Target: from
  turn 2 on, TTFT <= 0.7x llama-server's.

concurrency: 1, 2, 4 and 8 clients (`--clients`), threads released together, each one request with a
  distinct prompt that asks for a long answer, `--max-tokens` (128). Neither server can be told to
  ignore EOS, so the tokens counted are those produced (`usage.completion_tokens`). Aggregate tok/s
  is all of them over the wall time from the release to the last reply's end; latency is a whole
  request's time, p50 and p99 over every request of every round (with 8 requests p99 is close to the
  slowest). llama-server runs `-np 4` with 1,024 tokens a slot. Targets: ours at 4 clients >= 2x ours
  at 1, and >= 1.5x llama-server at 4.

depth: decode tok/s with 1k, 4k and 16k tokens already in context (`--depths`). llama.cpp's figure is
  `llama-bench -d D -p 0 -n 64` (the context filled with D tokens, then 64 single-token steps).
  Ours is measured through the server, not by driving `runtime.model.Model` from here: a
  /v1/completions request whose prompt is D token ids of Python source (so the model keeps writing),
  64 tokens streamed, and the rate is the tokens after the first over the time from the first to
  the last. The server is where a decode step at depth is decided (the KV cache's dtype and size,
  the scheduler's step, how the prompt was prefilled: `--kv-dtype`, `--ctx`, `--prefill-chunk`,
  `--max-concurrent`), so a Model driven directly would time a configuration that no request runs.
  The rate leaves out the prefill and the first token, as llama-bench's tg test does, but keeps what
  the server adds to every token (greedy sampling, detokenizing, one SSE write) that llama-bench does
  not have: the comparison errs against us. The depths' prompts share their beginning; a server
  that reuses it prefills less, which leaves the decode rate as it is. Target: >= 1.5x llama-bench
  at every depth.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import llama_cpp
from bench.run import MODELS, _ensure_bundle, median, parse_list, ratio
from bench.serve import _free_port, _log, _wait_ready

BENCHES = ("agent", "concurrency", "depth")
DEFAULT_MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
RESULTS = Path(__file__).parent / "results" / "serving.json"
AGENT_TARGET, CONC_SCALE_TARGET, CONC_PEER_TARGET, DEPTH_TARGET = 0.7, 2.0, 1.5, 1.5
LLAMA_SLOT_CTX = 1024  # tokens a llama-server slot holds in the concurrency bench

# -- the agent's prefix --------------------------------------------------------------------------------
_RULES = (
    "You are Forge, an autonomous software engineering agent working inside a developer's repository. "
    "You read code, run commands and edit files through the tools listed below, and you report back "
    "in plain, concise language. You never invent file contents, command output or test results: when "
    "you need to know something about the repository, you look it up with a tool first.",
    "Work in small, verifiable steps. Before changing a file, read the part you intend to change and "
    "the code that calls it. After changing it, run the narrowest test that exercises the change, "
    "then the wider suite when the narrow one passes. If a test fails, read the failure in full before "
    "you try a fix, and never weaken or delete a test to make it pass unless the user asks for that.",
    "Keep edits minimal and in the style of the surrounding code: the same naming, the same error "
    "handling, the same formatting. Do not reformat code you did not otherwise change, do not add "
    "dependencies without asking, and do not leave debugging output, commented-out code or TODO notes "
    "behind. Prefer the standard library and the helpers the project already has.",
    "Treat the user's machine with care. Never run commands that delete data outside the repository, "
    "rewrite published history, push to a remote, install system packages or touch credentials. Ask "
    "before any command that takes longer than a few minutes or that changes state outside the "
    "working tree. Shell commands run with a timeout; a command that hangs is killed and reported.",
    "When the user's request is ambiguous, make the most reasonable assumption, say which one you made "
    "in one sentence, and proceed; ask a clarifying question only when a wrong guess would waste "
    "significant work or cannot be undone. When a request cannot be done, say so plainly and explain "
    "what is missing, instead of doing something different from what was asked.",
    "Report what you did, not what you intended to do. A good report names the files you changed, "
    "the commands you ran and their outcome, and anything left undone or uncertain. Keep it short: a "
    "few sentences or a short list. Quote code only when the user needs to see it, and quote the "
    "smallest piece that makes the point.",
    "Tests are part of every change. A bug fix comes with a test that fails before the fix and passes "
    "after it; a new function comes with tests of its ordinary use, its edge cases and its errors. "
    "Tests must be deterministic: no sleeps, no network, no dependence on the current time or on the "
    "order in which tests run. Use the fixtures in tests/conftest.py rather than building new ones.",
    "Errors are handled where something useful can be done about them and nowhere else. Do not catch "
    "broad exceptions to silence them; let unexpected errors propagate to the request handler, which "
    "logs them with the request id and answers with the standard error envelope. Messages name the "
    "value that was wrong and what was expected, in one line, without stack traces for user errors.",
    "Performance matters on the request path. Avoid queries inside loops, fetch related rows in one "
    "query, stream large results in pages, and keep work that can wait in background jobs. Before "
    "optimizing, measure: the project has a profiling helper in scripts/profile.py and benchmarks "
    "under bench/, and a change that claims to be faster should say by how much on which benchmark.",
    "Security is not optional. Validate every input at the boundary, use parameterized queries only, "
    "never log secrets or personal data, escape everything rendered into templates, and check "
    "permissions in the handler even when the UI hides the action. Dependencies are pinned; a change "
    "that updates one must say why, and must pass the dependency audit job in CI.",
)
_AREAS = (
    ("api", "the HTTP handlers, request validation and the error envelope"),
    ("auth", "API keys, session tokens and the permission checks every handler runs"),
    ("billing", "invoices, usage metering and the nightly reconciliation job"),
    ("cache", "the read-through cache in front of the database and its invalidation rules"),
    ("cli", "the command-line entry points and their argument parsing"),
    ("db", "the schema, migrations and the query helpers built on the connection pool"),
    ("events", "the outbox table, the event bus and the consumers that replay it"),
    ("export", "CSV and Parquet exports, streamed in pages so memory stays flat"),
    ("jobs", "the background worker, its retry policy and the dead-letter queue"),
    ("mail", "templated email, the provider client and bounce handling"),
    ("metrics", "counters, histograms and the Prometheus endpoint"),
    ("search", "the full-text index, its analyzers and the query parser"),
    ("storage", "object storage uploads, signed URLs and lifecycle rules"),
    ("ui", "the server-rendered pages, their templates and the static assets"),
    ("audit", "the append-only audit log of administrative actions and its retention policy"),
    ("flags", "feature flags, their rollout percentages and the admin page that edits them"),
    ("i18n", "message catalogs, locale negotiation and number and date formatting"),
    ("imports", "bulk CSV imports, validated row by row with a report of rejected rows"),
    ("notify", "in-app notifications, their preferences and the websocket fan-out"),
    ("payments", "the payment provider client, webhooks and idempotency keys"),
    ("reports", "scheduled reports, their SQL templates and the PDF renderer"),
    ("tenancy", "tenant isolation, per-tenant configuration and the tenant-aware query filter"),
    ("webhooks", "outgoing webhooks, their signatures, retries and the delivery log"),
)


def _project_notes() -> str:
    lines = ["Repository map (each package has its own tests under tests/<package>/):"]
    for i, (pkg, what) in enumerate(_AREAS):
        lines.append(
            f"- src/app/{pkg}/: {what}. Owner team {chr(65 + i % 6)}; entry module src/app/{pkg}/"
            f"__init__.py; run its tests with `pytest tests/{pkg} -q` (about {10 + 7 * i} seconds)."
        )
    lines.append(
        "Conventions: Python 3.11, type hints everywhere, ruff for linting and formatting, pytest "
        "for tests, structured logging through app.log.get_logger, configuration read once at "
        "start-up from environment variables prefixed APP_, and no global mutable state."
    )
    return "\n".join(lines)


AGENT_PREFIX = 4000  # tokens, about: the rules, the notes and the 20 tools' schemas
CHARS_PER_TOKEN = 3.5  # about, for this English and these paths on the Qwen tokenizer


def _file_index(tokens: int) -> str:
    """About `tokens` tokens of a repository's file index (a long agent prefix), deterministic."""
    lines, budget, i = ["File index (generated; path: purpose, size):"], tokens * CHARS_PER_TOKEN, 0
    while sum(len(x) + 1 for x in lines) < budget:
        pkg, what = _AREAS[i % len(_AREAS)]
        lines.append(
            f"- src/app/{pkg}/part_{i // len(_AREAS):03d}.py: helpers for {what.split(',')[0]}; "
            f"{40 + (i * 37) % 400} lines, last changed in release {1 + i % 9}.{i % 13}"
        )
        i += 1
    return "\n".join(lines)


def agent_system_prompt(round_no: int, prefix_tokens: int = AGENT_PREFIX) -> str:
    """The agent's system prompt; `round_no` opens it, so each round's prefix is new to both servers.
    Past the default size, a file index makes up the rest of `prefix_tokens`."""
    head = f"Session {round_no + 1}."
    extra = [_file_index(prefix_tokens - AGENT_PREFIX)] if prefix_tokens > AGENT_PREFIX else []
    return "\n\n".join([head, *_RULES, _project_notes(), *extra])


# name, description, parameters: name -> (JSON type, description); a leading "?" marks an optional one
_TOOLS: tuple[tuple[str, str, dict[str, tuple[str, str]]], ...] = (
    ("read_file", "Read a text file from the repository, optionally a range of lines.",
     {"path": ("string", "Path relative to the repository root."),
      "?start_line": ("integer", "First line to return, 1-based."),
      "?end_line": ("integer", "Last line to return, inclusive.")}),
    ("write_file", "Create a file or replace its whole content.",
     {"path": ("string", "Path relative to the repository root."),
      "content": ("string", "The complete new content of the file.")}),
    ("edit_file", "Replace one exact occurrence of a string in a file with another string.",
     {"path": ("string", "Path relative to the repository root."),
      "old": ("string", "Text to find; it must occur exactly once."),
      "new": ("string", "Text to put in its place.")}),
    ("list_dir", "List the entries of a directory, with sizes and types.",
     {"path": ("string", "Directory relative to the repository root."),
      "?recursive": ("boolean", "List subdirectories too.")}),
    ("glob", "Find files whose paths match a glob pattern.",
     {"pattern": ("string", "A glob such as src/**/*.py."),
      "?limit": ("integer", "Most paths to return.")}),
    ("grep", "Search file contents with a regular expression.",
     {"pattern": ("string", "A Python regular expression."),
      "?path": ("string", "Directory or file to search; the repository by default."),
      "?context": ("integer", "Lines of context around each match.")}),
    ("run_command", "Run a shell command in the repository and return its output and exit status.",
     {"command": ("string", "The command line, run with bash."),
      "?timeout_s": ("integer", "Seconds before the command is killed.")}),
    ("run_tests", "Run the test suite or a part of it with pytest.",
     {"target": ("string", "A test path or node id; empty for the whole suite."),
      "?keyword": ("string", "Only tests whose names match this -k expression.")}),
    ("git_status", "Show changed, staged and untracked files.", {}),
    ("git_diff", "Show the diff of the working tree or of one file.",
     {"?path": ("string", "Limit the diff to this path."),
      "?staged": ("boolean", "Show the staged diff instead.")}),
    ("git_log", "Show recent commits, optionally for one path.",
     {"?path": ("string", "Limit the log to this path."),
      "?count": ("integer", "Number of commits to show.")}),
    ("git_commit", "Commit the staged changes with a message.",
     {"message": ("string", "The commit message, a summary line first.")}),
    ("find_symbol", "Find where a function, class or variable is defined.",
     {"name": ("string", "The symbol's name, optionally qualified with its module."),
      "?kind": ("string", "One of function, class or variable.")}),
    ("find_references", "Find every place that uses a symbol.",
     {"name": ("string", "The symbol's qualified name."),
      "?limit": ("integer", "Most references to return.")}),
    ("python_eval", "Evaluate a short Python expression in the project's environment.",
     {"expression": ("string", "A single Python expression; its repr is returned.")}),
    ("http_request", "Send an HTTP request to the development server.",
     {"method": ("string", "GET, POST, PUT, PATCH or DELETE."),
      "path": ("string", "The path, such as /api/v1/items."),
      "?body": ("string", "A JSON request body.")}),
    ("db_query", "Run a read-only SQL query against the development database.",
     {"sql": ("string", "One SELECT statement."),
      "?limit": ("integer", "Most rows to return.")}),
    ("web_search", "Search the web for documentation and return the top results.",
     {"query": ("string", "The search terms."),
      "?site": ("string", "Restrict results to this domain.")}),
    ("ask_user", "Ask the user a question and wait for the answer.",
     {"question": ("string", "One clear question.")}),
    ("todo_write", "Replace the task list shown to the user.",
     {"items": ("string", "The tasks, one per line, done ones prefixed with [x].")}),
)  # fmt: skip


def agent_tools() -> list[dict[str, Any]]:
    """The 20 tool definitions in OpenAI's form."""
    tools = []
    for name, desc, params in _TOOLS:
        props = {p.lstrip("?"): {"type": t, "description": d} for p, (t, d) in params.items()}
        required = [p for p in params if not p.startswith("?")]
        schema = {"type": "object", "properties": props, "required": required}
        tools.append(
            {"type": "function", "function": {"name": name, "description": desc, "parameters": schema}}
        )
    return tools


USER_TURNS = (
    "Without calling any tool yet: in two sentences, how would you find where APP_ settings are read?",
    "Good. In one sentence, which package's tests would you run after changing the cache rules?",
    "Thanks. Briefly, what would you check before committing a change to the db migrations?",
    "Last question: in one sentence, what should your final report to me contain?",
)
TOOL_RESULT = "ok (no output)"


def reply_messages(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The assistant message as a harness appends it, and a fixed result for each call it made."""
    out: list[dict[str, Any]] = [message]
    for call in message.get("tool_calls") or []:
        out.append({"role": "tool", "tool_call_id": call.get("id") or "", "content": TOOL_RESULT})
    return out


# -- the other benches' prompts -----------------------------------------------------------------------
_SUBJECTS = (
    "implementing a hash map with open addressing in C",
    "building a small REST API in Go with the standard library",
    "writing a recursive descent parser for arithmetic in Python",
    "designing a rate limiter with a token bucket in Rust",
    "using SQL window functions for running totals and rankings",
    "implementing a least-recently-used cache in Java",
    "writing a concurrent web crawler with asyncio in Python",
    "building a binary search tree with deletion in C++",
)


def concurrency_prompt(i: int) -> str:
    """A distinct prompt that asks for a long answer (client `i`)."""
    part = f" (variant {i // len(_SUBJECTS) + 1})" if i >= len(_SUBJECTS) else ""
    subject = _SUBJECTS[i % len(_SUBJECTS)]
    return f"Write a detailed, step-by-step tutorial on {subject}{part}, with complete code and explanations."


def source_text(n_funcs: int) -> str:
    """Deterministic Python source that a model keeps extending: `n_funcs` similar functions."""
    parts = []
    for i in range(n_funcs):
        lim, cut = i % 7 + 3, i * 13 % 97
        parts.append(
            f"def transform_{i}(records, limit={lim}):\n"
            f'    """Return up to {lim} records whose score exceeds {cut}, tagged with stage {i}."""\n'
            "    kept = []\n"
            "    for rec in records:\n"
            f'        if rec.get("score", 0) > {cut} and len(kept) < limit:\n'
            f'            kept.append({{**rec, "stage": {i}}})\n'
            "    return kept\n\n\n"
        )
    return "".join(parts)


def depth_prompt(encode: Callable[[str], list[int]], depth: int) -> list[int]:
    """Exactly `depth` token ids of `source_text`."""
    n = max(1, depth // 60)
    while len(ids := encode(source_text(n))) < depth:
        n *= 2
    return ids[:depth]


# -- streaming -----------------------------------------------------------------------------------------
@dataclass
class Stream:
    """One streamed reply, timed at the client (perf_counter seconds)."""

    start: float
    end: float
    first: float | None = None  # the first output delta (content, text or a tool call)
    last: float | None = None
    deltas: int = 0  # output deltas (both servers send one a token for plain text)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    message: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float:
        return (self.first - self.start) if self.first is not None else float("nan")

    @property
    def latency_s(self) -> float:
        return self.end - self.start

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.deltas

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the time after the first (deltas, one a token)."""
        if self.first is None or self.last is None or self.deltas < 2 or self.last <= self.first:
            return float("nan")
        return (self.deltas - 1) / (self.last - self.first)


def cached_tokens(usage: dict[str, Any] | None, timings: dict[str, Any] | None) -> int | None:
    """Reused prompt tokens: OpenAI's `prompt_tokens_details.cached_tokens`, else llama-server's
    `timings.cache_n`; None when the server says neither."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    if timings and timings.get("cache_n") is not None:
        return int(timings["cache_n"])
    return None


class _Reply:
    """Folds the chunks of a chat or completions stream into a Stream and the assistant message."""

    def __init__(self, start: float) -> None:
        self.s = Stream(start=start, end=start)
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any], now: float) -> None:
        if "error" in chunk:
            raise SystemExit(f"bench: the stream carried an error: {json.dumps(chunk['error'])[:300]}")
        self.usage = chunk.get("usage") or self.usage
        self.timings = chunk.get("timings") or self.timings
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or choice.get("text") or ""
            self.content.append(text)
            for t in delta.get("tool_calls") or []:
                call = self.calls.setdefault(t.get("index", 0), {"type": "function", "function": {}})
                call["id"] = t.get("id") or call.get("id")
                fn, piece = call["function"], t.get("function") or {}
                fn["name"] = piece.get("name") or fn.get("name")
                fn["arguments"] = fn.get("arguments", "") + (piece.get("arguments") or "")
            if text or delta.get("tool_calls"):
                self.s.deltas += 1
                self.s.last = now
                self.s.first = self.s.first or now

    def finish(self, end: float) -> Stream:
        s, usage = self.s, self.usage or {}
        s.end = end
        s.prompt_tokens, s.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        s.cached_tokens = cached_tokens(self.usage, self.timings)
        text = "".join(self.content)
        s.message = {"role": "assistant", "content": text if text or not self.calls else None}
        if self.calls:
            s.message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return s


def stream(port: int, path: str, body: dict[str, Any], timeout_s: float = 3600) -> Stream:
    """POST `body` to `path` streamed, with usage, and time its deltas as they arrive."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    start = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"bench: server on port {port} answered {resp.status}: {resp.read()[:300]!r}")
    reply = _Reply(start)
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            reply.add(json.loads(line[6:]), time.perf_counter())
    conn.close()
    return reply.finish(time.perf_counter())


def chat(port: int, model: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> Stream:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    return stream(port, "/v1/chat/completions", body)


def together(n: int, fn: Callable[[int], Stream]) -> list[Stream]:
    """`fn(0..n-1)` on n threads released at once by a barrier."""
    barrier = threading.Barrier(n)

    def work(i: int) -> Stream:
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(n) as pool:
        return [f.result() for f in [pool.submit(work, i) for i in range(n)]]


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the nearest ranks."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# -- servers -------------------------------------------------------------------------------------------
@dataclass
class Server:
    name: str  # "goinfer" or "llama-server"
    port: int
    command: list[str]
    log: str


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: str, n: int = 15) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])


@contextmanager
def launched(name: str, cmd: list[str], env: dict[str, str] | None, port: int) -> Iterator[Server]:
    """Run a server (its output to a log file), wait until /health answers 200, stop it on exit."""
    fd, log = tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")
    _log(f"starting {name} on port {port} (log {log})")
    with open(fd, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            _wait_ready(port, proc, name)
        except SystemExit:
            print(_tail(log), file=sys.stderr)
            raise
        yield Server(name, port, cmd, log)
    finally:
        _stop(proc)


def goinfer_server(name: str, bundle: Path, threads: int, extra: list[str]) -> AbstractContextManager[Server]:
    port = _free_port()
    cmd = [sys.executable, "-m", "goinfer.cli.main", "serve", "--model", f"{name}={bundle}"]
    cmd += ["--addr", f"127.0.0.1:{port}", "--max-queue", "64", *extra]
    env = {**os.environ, "TVM_NUM_THREADS": str(threads)}
    return launched("goinfer", cmd, env, port)


def llama_tool(name: str) -> Path:
    """A llama.cpp tool from the cache, building llama.cpp (AMX off) when it is not there yet."""
    return llama_cpp.find_llama_binary(name) or llama_cpp.build() / name


def llama_server(gguf: Path, threads: int, args: list[str]) -> AbstractContextManager[Server]:
    port, binary = _free_port(), llama_tool("llama-server")
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), "--no-webui", *args]
    return launched("llama-server", cmd, llama_cpp.llama_env(binary), port)


def warm(server: Server, model: str) -> None:
    """One short unrelated request: pages the weights in, so the first measured request is not cold."""
    chat(server.port, model, [{"role": "user", "content": "Say hello."}], 4)


# -- agent ---------------------------------------------------------------------------------------------
def _turn_row(turn: int, s: Stream) -> dict[str, Any]:
    return {
        "turn": turn,
        "ttft_s": s.ttft_s,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "completion_tokens": s.completion_tokens,
        "tool_calls": len(s.message.get("tool_calls") or []),
    }


def run_agent(
    servers: list[Server], model: str, rounds: int, turns: int, max_tokens: int, prefix: int = AGENT_PREFIX
) -> dict:
    """Per server, per round, per turn: TTFT, prompt and cached tokens."""
    tools = agent_tools()
    raw: dict[str, list[list[dict[str, Any]]]] = {s.name: [] for s in servers}
    for r in range(rounds):
        convs = {s.name: [{"role": "system", "content": agent_system_prompt(r, prefix)}] for s in servers}
        for s in servers:
            raw[s.name].append([])
        for t in range(turns):
            for s in servers:  # A/B within a turn; each server continues its own conversation
                msgs = convs[s.name]
                msgs.append({"role": "user", "content": USER_TURNS[t % len(USER_TURNS)]})
                reply = chat(s.port, model, msgs, max_tokens, tools=tools)
                msgs += reply_messages(reply.message)
                raw[s.name][r].append(_turn_row(t + 1, reply))
                _log(
                    f"agent round {r + 1}/{rounds} turn {t + 1}/{turns} {s.name}: TTFT {reply.ttft_s:.2f} s, "
                    f"prompt {reply.prompt_tokens}, cached {reply.cached_tokens}"
                )
    return {"rounds": rounds, "turns": turns, "max_tokens": max_tokens, "prefix": prefix, "raw": raw}


def agent_summary(res: dict) -> list[dict[str, Any]]:
    """Per turn: median TTFT of each server over the rounds, ours over theirs, the first round's tokens."""
    rows = []
    ours, peer = res["raw"]["goinfer"], res["raw"]["llama-server"]
    for t in range(res["turns"]):
        o, p = [r[t] for r in ours], [r[t] for r in peer]
        row = {"turn": t + 1, "ttft_ours_s": median([x["ttft_s"] for x in o])}
        row["ttft_peer_s"] = median([x["ttft_s"] for x in p])
        row["ttft_ratio"] = ratio(row["ttft_ours_s"], row["ttft_peer_s"])
        for key in ("prompt_tokens", "cached_tokens"):
            row[f"{key}_ours"], row[f"{key}_peer"] = o[0][key], p[0][key]
        rows.append(row)
    return rows


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)


def agent_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'turn':>4} {'prompt ours':>11} {'l.cpp':>6} {'cached ours':>11} {'l.cpp':>6} "
        f"{'TTFT ours s':>11} {'l.cpp s':>8} {'ours/l.cpp':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['turn']:>4} {_n(r['prompt_tokens_ours']):>11} {_n(r['prompt_tokens_peer']):>6} "
            f"{_n(r['cached_tokens_ours']):>11} {_n(r['cached_tokens_peer']):>6} {r['ttft_ours_s']:>11.3f} "
            f"{r['ttft_peer_s']:>8.3f} {r['ttft_ratio']:>9.2f}x"
        )
    return "\n".join(lines)


def agent_target(rows: list[dict[str, Any]]) -> tuple[bool, str]:
    later = [r for r in rows if r["turn"] >= 2]
    if not later:
        return False, f"target: TTFT from turn 2 on <= {AGENT_TARGET}x llama-server's: no turn 2 measured"
    worst = max(later, key=lambda r: r["ttft_ratio"] if not math.isnan(r["ttft_ratio"]) else math.inf)
    met = all(r["ttft_ratio"] <= AGENT_TARGET for r in later)
    return met, (
        f"target: TTFT from turn 2 on <= {AGENT_TARGET}x llama-server's: {'met' if met else 'NOT met'} "
        f"(worst {worst['ttft_ratio']:.2f}x, turn {worst['turn']})"
    )


# -- concurrency ---------------------------------------------------------------------------------------
def clients_once(server: Server, model: str, n: int, max_tokens: int) -> dict[str, Any]:
    """n clients at once, one request each: aggregate tok/s, and each request's latency and TTFT."""
    streams = together(
        n,
        lambda i: chat(server.port, model, [{"role": "user", "content": concurrency_prompt(i)}], max_tokens),
    )
    wall = max(s.end for s in streams) - min(s.start for s in streams)
    tokens = sum(s.tokens for s in streams)
    return {
        "clients": n,
        "wall_s": wall,
        "completion_tokens": tokens,
        "tok_s": tokens / wall if wall > 0 else float("nan"),
        "latency_s": [s.latency_s for s in streams],
        "ttft_s": [s.ttft_s for s in streams],
    }


def run_concurrency(
    servers: list[Server], model: str, clients: list[int], rounds: int, max_tokens: int
) -> dict:
    raw: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
    for r in range(rounds):
        for n in clients:
            for s in servers:  # A/B per client count
                res = clients_once(s, model, n, max_tokens)
                raw[s.name].append({"round": r + 1, **res})
                _log(
                    f"concurrency round {r + 1}/{rounds} {n} clients {s.name}: {res['tok_s']:.1f} tok/s, "
                    f"{res['completion_tokens']} tokens in {res['wall_s']:.1f} s"
                )
    return {"rounds": rounds, "clients": clients, "max_tokens": max_tokens, "raw": raw}


def concurrency_summary(res: dict) -> list[dict[str, Any]]:
    rows = []
    for n in res["clients"]:
        row: dict[str, Any] = {"clients": n}
        for side, name in (("ours", "goinfer"), ("peer", "llama-server")):
            runs = [x for x in res["raw"][name] if x["clients"] == n]
            lat = [v for x in runs for v in x["latency_s"]]
            row[f"tok_s_{side}"] = median([x["tok_s"] for x in runs])
            row[f"p50_{side}_s"], row[f"p99_{side}_s"] = percentile(lat, 50), percentile(lat, 99)
            row[f"tokens_{side}"] = sum(x["completion_tokens"] for x in runs)
        row["tok_s_ratio"] = ratio(row["tok_s_ours"], row["tok_s_peer"])
        rows.append(row)
    return rows


def concurrency_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'clients':>7} {'tok/s ours':>10} {'l.cpp':>7} {'ours/l.cpp':>10} {'p50 ours s':>10} "
        f"{'p99':>7} {'p50 l.cpp':>9} {'p99':>7} {'tokens ours':>11} {'l.cpp':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['clients']:>7} {r['tok_s_ours']:>10.1f} {r['tok_s_peer']:>7.1f} {r['tok_s_ratio']:>9.2f}x "
            f"{r['p50_ours_s']:>10.2f} {r['p99_ours_s']:>7.2f} {r['p50_peer_s']:>9.2f} "
            f"{r['p99_peer_s']:>7.2f} {r['tokens_ours']:>11} {r['tokens_peer']:>6}"
        )
    return "\n".join(lines)


def concurrency_targets(rows: list[dict[str, Any]]) -> list[tuple[bool, str]]:
    by = {r["clients"]: r for r in rows}
    if 4 not in by:
        return [(False, "targets: need a 4-client run (--clients with 4)")]
    four = by[4]
    out = []
    if 1 in by:
        scale = ratio(four["tok_s_ours"], by[1]["tok_s_ours"])
        met = scale >= CONC_SCALE_TARGET
        out.append((met, f"target: ours at 4 clients >= {CONC_SCALE_TARGET}x ours at 1: "
                         f"{'met' if met else 'NOT met'} ({scale:.2f}x)"))  # fmt: skip
    met = four["tok_s_ratio"] >= CONC_PEER_TARGET
    out.append((met, f"target: ours at 4 clients >= {CONC_PEER_TARGET}x llama-server at 4: "
                     f"{'met' if met else 'NOT met'} ({four['tok_s_ratio']:.2f}x)"))  # fmt: skip
    return out


# -- depth ---------------------------------------------------------------------------------------------
def bundle_tokenizer(bundle: Path) -> tuple[Callable[[str], list[int]], int]:
    """The bundle's own tokenizer (no special tokens added), and its context window."""
    from goinfer.artifacts import giw
    from goinfer.artifacts.manifest import Manifest
    from goinfer.runtime.model import tokenizer_json
    from tokenizers import Tokenizer

    with giw.open_bundle(bundle, verify="none") as b:
        m = Manifest.of(b)
        tok = Tokenizer.from_str(tokenizer_json(b, m))
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), m.context_length


def depth_ours(server: Server, model: str, ids: list[int], n: int) -> dict[str, Any]:
    s = stream(
        server.port, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0}
    )
    return {
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "tokens": s.tokens,
        "deltas": s.deltas,
        "ttft_s": s.ttft_s,
        "tok_s": s.decode_tok_s,
    }


def llama_bench_depth(gguf: Path, depth: int, n: int, threads: int, reps: int) -> dict[str, Any]:
    """`llama-bench -d depth -p 0 -n n`: decode tok/s with `depth` tokens in the context."""
    binary = llama_tool("llama-bench")
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-d", str(depth), "-p", "0", "-n", str(n)]
    cmd += ["-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, env=llama_cpp.llama_env(binary), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench: llama-bench failed: {out.stderr.strip().splitlines()[-1:]}")
    (row,) = [r for r in json.loads(out.stdout) if r["n_gen"] == n and r.get("n_depth", 0) == depth]
    return {"tok_s": float(row["avg_ts"]), "samples_tok_s": row["samples_ts"], "command": cmd}


def run_depth(
    server: Server, model: str, gguf: Path, bundle: Path, depths: list[int], n: int, threads: int, rounds: int
) -> dict:
    encode, window = bundle_tokenizer(bundle)
    rows = []
    for d in depths:
        if d + n > window:
            _log(f"depth {d}: skipped, {d} + {n} tokens exceed the {window}-token window")
            continue
        ids = depth_prompt(encode, d)
        ours = []
        for r in range(rounds):
            _log(f"depth {d} round {r + 1}/{rounds}: goinfer (prefill first: minutes at 16k)")
            ours.append(depth_ours(server, model, ids, n))
            _log(f"depth {d}: goinfer {ours[-1]['tok_s']:.1f} tok/s over {ours[-1]['deltas']} deltas")
        _log(f"depth {d}: llama-bench -d {d} -p 0 -n {n} -r {rounds}")
        peer = llama_bench_depth(gguf, d, n, threads, rounds)
        _log(f"depth {d}: llama-bench {peer['tok_s']:.1f} tok/s")
        tok_s = median([o["tok_s"] for o in ours])
        rows.append({"depth": d, "tok_s_ours": tok_s, "tok_s_peer": peer["tok_s"],
                     "ratio": ratio(tok_s, peer["tok_s"]), "ours": ours, "peer": peer})  # fmt: skip
    return {"tokens": n, "rounds": rounds, "rows": rows}


def depth_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'depth':>6} {'tok/s ours':>10} {'llama-bench':>11} {'ours/l.cpp':>10} {'tokens ours':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        toks = ",".join(str(o["tokens"]) for o in r["ours"])
        lines.append(
            f"{r['depth']:>6} {r['tok_s_ours']:>10.1f} {r['tok_s_peer']:>11.1f} {r['ratio']:>9.2f}x "
            f"{toks:>11}"
        )
    return "\n".join(lines)


def depth_target(rows: list[dict[str, Any]]) -> tuple[bool, str]:
    if not rows:
        return False, "target: no depth measured"
    worst = min(rows, key=lambda r: r["ratio"] if not math.isnan(r["ratio"]) else -math.inf)
    met = all(r["ratio"] >= DEPTH_TARGET for r in rows)
    return met, (
        f"target: decode >= {DEPTH_TARGET}x llama-bench at every depth: {'met' if met else 'NOT met'} "
        f"(worst {worst['ratio']:.2f}x at {worst['depth']})"
    )


# -- the run -------------------------------------------------------------------------------------------
def _print_targets(targets: list[tuple[bool, str]]) -> None:
    for _, line in targets:
        print(line)


def agent_bench(a: argparse.Namespace, name: str, gguf: Path, ours: Server, out: dict[str, Any]) -> None:
    ctx = max(8192, a.agent_prefix + 4096)  # the prefix, four turns and their replies
    with llama_server(gguf, a.threads, ["-c", str(ctx), "-np", "1"]) as peer:
        out["commands"]["llama-server agent"] = peer.command
        warm(peer, name)
        res = run_agent([ours, peer], name, a.rounds, a.turns, a.agent_max_tokens, a.agent_prefix)
    rows = agent_summary(res)
    met, line = agent_target(rows)
    out["agent"] = {**res, "summary": rows, "target_met": met}
    print(
        f"\n{name} {a.quant}, agent: ~{a.agent_prefix}-token prefix, {a.turns} turns, {len(_TOOLS)} tools, "
        f"max_tokens {a.agent_max_tokens}, "
        f"median of {a.rounds} round(s); TTFT to the first content or tool-call delta"
    )
    print(agent_table(rows))
    _print_targets([(met, line)])


def concurrency_bench(
    a: argparse.Namespace, name: str, gguf: Path, ours: Server, out: dict[str, Any]
) -> None:
    slots = ["-np", str(a.llama_np), "-c", str(a.llama_np * LLAMA_SLOT_CTX)]
    with llama_server(gguf, a.threads, slots) as peer:
        out["commands"]["llama-server concurrency"] = peer.command
        warm(peer, name)
        res = run_concurrency([ours, peer], name, a.clients, a.rounds, a.max_tokens)
    rows = concurrency_summary(res)
    targets = concurrency_targets(rows)
    out["concurrency"] = {**res, "summary": rows, "targets_met": [m for m, _ in targets]}
    print(
        f"\n{name} {a.quant}, concurrency: max_tokens {a.max_tokens}, llama-server -np {a.llama_np}, "
        f"{a.rounds} round(s); tok/s = all completion tokens / wall time; latency = whole request"
    )
    print(concurrency_table(rows))
    _print_targets(targets)


def depth_bench(
    a: argparse.Namespace, name: str, gguf: Path, bundle: Path, ours: Server, out: dict[str, Any]
) -> None:
    res = run_depth(ours, name, gguf, bundle, a.depths, a.depth_tokens, a.threads, a.rounds)
    met, line = depth_target(res["rows"])
    out["depth"] = {**res, "target_met": met}
    print(
        f"\n{name} {a.quant}, depth: decode tok/s over {a.depth_tokens} tokens after D in context; "
        f"ours streamed from the server, llama-bench -d D -p 0 -n {a.depth_tokens}"
    )
    print(depth_table(res["rows"]))
    _print_targets([(met, line)])


def _load_before(bench: str, out: dict[str, Any]) -> None:
    """Record (and say, when high) the machine's load before a bench: other work on a shared host
    slows both servers, llama.cpp's spinning threads most (on a 2-core host busy with a test run,
    llama-server decoded ten times slower and more)."""
    load = os.getloadavg()[0]
    out.setdefault("loadavg_before", {})[bench] = load
    _log(f"{bench}: load average {load:.2f} before it")
    if load >= 1.0:
        print(f"note: load average {load:.2f} before the {bench} bench: other work shares the cores")


def bench_model(a: argparse.Namespace, name: str, report: dict[str, Any]) -> None:
    """Every selected bench on one model: prints the tables, and saves `report` after each bench."""
    from goinfer.compiler.sources import zoo

    out = report["models"].setdefault(name, {})
    gguf = zoo.resolve(name)
    bundle = _ensure_bundle(gguf, a.quant)
    with goinfer_server(name, bundle, a.threads, shlex.split(a.goinfer_args)) as ours:
        out["commands"] = {"goinfer": ours.command}
        warm(ours, name)
        if "agent" in a.benches:
            _load_before("agent", out)
            agent_bench(a, name, gguf, ours, out)
            save(a.json, report)
        if "concurrency" in a.benches:
            _load_before("concurrency", out)
            concurrency_bench(a, name, gguf, ours, out)
            save(a.json, report)
        if "depth" in a.benches:
            _load_before("depth", out)
            depth_bench(a, name, gguf, bundle, ours, out)
            save(a.json, report)


def save(path: str, report: dict[str, Any]) -> None:
    """Write the whole report so far (after every bench, so a later failure keeps what was measured)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n")


def _ints(value: str, what: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"bench: --{what} takes comma-separated integers, not {value!r}") from None
    if not items or min(items) < 1:
        raise SystemExit(f"bench: --{what} needs positive integers")
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default=",".join(BENCHES), help="any of agent,concurrency,depth")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--quant", default="gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="agent conversations / client rounds / depth runs")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--agent-max-tokens", type=int, default=32)
    ap.add_argument(
        "--agent-prefix", type=int, default=AGENT_PREFIX, help="agent: the prefix's tokens, about"
    )
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=128, help="concurrency: tokens a request")
    ap.add_argument("--llama-np", type=int, default=4, help="llama-server slots in the concurrency bench")
    ap.add_argument("--depths", default="1024,4096,16384")
    ap.add_argument("--depth-tokens", type=int, default=64)
    ap.add_argument("--goinfer-args", default="", help="extra `goinfer serve` flags, one shell-quoted string")
    ap.add_argument("--json", default=str(RESULTS), help="results file ('' for none)")
    a = ap.parse_args(argv)
    a.benches = parse_list(a.bench, BENCHES, "bench")
    a.model_names = parse_list(a.models, MODELS, "model")
    a.clients, a.depths = _ints(a.clients, "clients"), _ints(a.depths, "depths")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": llama_cpp.cpu_name(), "threads": a.threads,
        "quant": a.quant, "benches": a.benches, "goinfer_args": a.goinfer_args, "models": {},
    }  # fmt: skip
    print(f"{a.threads} threads each; benches {', '.join(a.benches)}; goinfer serve extra flags: "
          f"{a.goinfer_args or '(none)'}")  # fmt: skip
    for name in a.model_names:
        bench_model(a, name, report)
    if a.json:
        _log(f"results in {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
