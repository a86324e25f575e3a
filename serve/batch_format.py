"""The batch JSONL formats, one place for both runners (the server's /v1/batches and
/v1/messages/batches, and `goinfer chat --batch`'s cli/batch_run.py).

    input   {"custom_id": "a1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
    output  {"id": "batch_req_...", "custom_id": "a1",
             "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}
    error   {"id": "batch_req_...", "custom_id": "a1", "response": null, "error": {"code", "message"}}

OpenAI's batch output shape (its `id` and `request_id` included). A line is checked here and
nowhere else: its shape, a unique custom_id, and what a batch cannot do (tools, images, logprobs,
n > 1, goinfer_confidence, streaming), which earns an error line naming it rather than an answer
without it. A line that sets no sampling gets the API's defaults (temperature 1, 512 tokens, a
seed drawn for it), not goinfer generate's; `overrides` (the local runner's flags) win over both.

`ResultLog` is the durable half: an append-only JSONL whose every line is fsynced before the next,
whose torn last line (a crash mid-write) is cut on open.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
ENDPOINTS = (CHAT, COMPLETIONS)  # what /v1/batches and the local runner take (OpenAI's text routes)
DEFAULT_MAX_TOKENS = 512  # a line with no max_tokens (the seed's API default for batch lines)
DEFAULT_TEMPERATURE = 1.0
OVERRIDABLE = ("temperature", "top_p", "top_k", "seed", "max_tokens", "system")


class FormatError(ValueError):
    """The file is not a batch file: the message names the first line at fault (1-based)."""

    def __init__(self, message: str, line: int | None = None, code: str = "invalid_batch_file"):
        super().__init__(message)
        self.line, self.code = line, code


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, counting blank lines, as an editor shows it
    custom_id: str
    url: str
    body: dict[str, Any]


# -- reading ---------------------------------------------------------------------------------------
def json_lines(data: bytes | Iterable[bytes]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; a FormatError at the first that is not a JSON
    object (the upload's 400 names it)."""
    lines = data.splitlines() if isinstance(data, bytes) else data
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as e:
            raise FormatError(f"line {n} is not valid JSON: {e}", n, "invalid_jsonl") from None
        if not isinstance(obj, dict):
            raise FormatError(f"line {n} is not a JSON object", n, "invalid_jsonl")
        yield n, obj


def parse_lines(
    data: bytes | Iterable[bytes], endpoint: str | None = None, max_lines: int | None = None
) -> list[Line]:
    """The requests of a batch file. `endpoint` (a batch's): every line's url must be it; None:
    any of ENDPOINTS (the local runner). A duplicate custom_id names both lines."""
    out: list[Line] = []
    seen: dict[str, int] = {}
    for n, obj in json_lines(data):
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise FormatError(f"line {n}: custom_id is required (a non-empty string)", n, "missing_custom_id")
        if cid in seen:
            raise FormatError(
                f"line {n}: custom_id {cid!r} is already used on line {seen[cid]}; each must be unique",
                n,
                "duplicate_custom_id",
            )
        seen[cid] = n
        method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
        if method != "POST":
            raise FormatError(f"line {n}: method {method!r}: only POST is supported", n, "invalid_method")
        allowed = (endpoint,) if endpoint else ENDPOINTS
        if url not in allowed:
            raise FormatError(
                f"line {n}: url {url!r} is not {' or '.join(allowed)}"
                + (" (the batch's endpoint)" if endpoint else ""),
                n,
                "invalid_url",
            )
        if not isinstance(body, dict):
            raise FormatError(f"line {n}: body must be a JSON object (the request)", n, "invalid_body")
        out.append(Line(n, cid, url, body))
        if max_lines is not None and len(out) > max_lines:
            raise FormatError(f"line {n}: a batch holds at most {max_lines} requests", n, "too_many_lines")
    if not out:
        raise FormatError("the file holds no requests", None, "empty_file")
    return out


# -- what a batch line cannot ask for -------------------------------------------------------------
def cannot_do(url: str, body: Mapping[str, Any]) -> str | None:
    """Why this line cannot run in a batch, naming the field; None when it can."""
    if body.get("tools"):
        return "tools: batch lines are text chat only; this line declares tools"
    if body.get("goinfer_confidence"):
        return "goinfer_confidence: per-field confidence is not offered in batches"
    if body.get("stream"):
        return "stream: a batch line's reply is written whole; stream must be false"
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        return f"n: {n} choices asked for; a batch line gives one (n = 1)"
    if url == COMPLETIONS:
        if body.get("logprobs") not in (None, 0, False):
            return "logprobs: not offered in batches"
    elif body.get("logprobs") or body.get("top_logprobs"):
        return "logprobs: not offered in batches"
    messages = body.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "tool" or m.get("tool_calls"):
            return f"messages.{i}: tool messages are not offered in batches (text chat only)"
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and ("image" in kind or kind in ("document", "input_file", "file")):
                return f"messages.{i}.content.{j}: {kind} parts (images) are not offered in batches"
            if kind in ("tool_use", "tool_result"):
                return f"messages.{i}.content.{j}: {kind} blocks are not offered in batches (text chat only)"
    return None


# -- defaults and overrides -------------------------------------------------------------------------
def default_seed(salt: str, custom_id: str) -> int:
    """A line's seed when it sets none: random per batch (the salt), the same for a line rerun after
    a crash, so a resumed batch draws what it would have."""
    return int.from_bytes(hashlib.sha256(f"{salt}\0{custom_id}".encode()).digest()[:4], "big") >> 1


def new_salt() -> str:
    return secrets.token_hex(8)


def prepared(line: Line, salt: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The body as it runs: the API's defaults where the line sets nothing, then `overrides` (the
    local runner's flags: an instruction about this run) over the line's own."""
    body = dict(line.body)
    chat = line.url in (CHAT, MESSAGES)
    body.setdefault("temperature", DEFAULT_TEMPERATURE)
    if not any(body.get(k) is not None for k in ("max_tokens", "max_completion_tokens")):
        body["max_tokens"] = DEFAULT_MAX_TOKENS
    if line.url != MESSAGES:  # Anthropic's request has no seed
        body.setdefault("seed", default_seed(salt, line.custom_id))
    for key, value in (overrides or {}).items():
        if value is None or key not in OVERRIDABLE:
            continue
        if key == "system":
            if chat and isinstance(body.get("messages"), list):
                kept = [m for m in body["messages"] if not _is_system(m)]
                body["messages"] = [{"role": "system", "content": value}, *kept]
            continue
        if key == "max_tokens":
            body.pop("max_completion_tokens", None)
        body[key] = value
    return body


def _is_system(m: Any) -> bool:
    return isinstance(m, dict) and m.get("role") in ("system", "developer")


# -- writing ---------------------------------------------------------------------------------------
def request_id(salt: str, custom_id: str) -> str:
    return hashlib.sha256(f"req\0{salt}\0{custom_id}".encode()).hexdigest()[:32]


def output_line(custom_id: str, status: int, body: dict[str, Any], salt: str = "") -> dict[str, Any]:
    rid = request_id(salt, custom_id)
    response = {"status_code": status, "request_id": rid, "body": body}
    return {"id": f"batch_req_{rid[:24]}", "custom_id": custom_id, "response": response, "error": None}


def error_line(custom_id: str, code: str, message: str, salt: str = "") -> dict[str, Any]:
    rid = request_id(salt, custom_id)
    error = {"code": code, "message": message}
    return {"id": f"batch_req_{rid[:24]}", "custom_id": custom_id, "response": None, "error": error}


def succeeded(record: Mapping[str, Any]) -> bool:
    r = record.get("response")
    return isinstance(r, dict) and r.get("status_code") == 200 and record.get("error") is None


def dumps(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


class ResultLog:
    """An append-only JSONL of finished lines, each fsynced before `append` returns.

    Opening it reads the lines already there and cuts a torn last one (no newline, or not JSON: the
    process died writing it), so a rerun skips what was done and runs that line again."""

    def __init__(self, path: Path, truncate: bool = False):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict[str, Any]] = [] if truncate else self._recover()
        self.file: BinaryIO = open(path, "wb" if truncate else "ab")  # noqa: SIM115 - held open

    def _recover(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        records, good = [], 0
        for raw in data.splitlines(keepends=True):
            try:
                obj = json.loads(raw) if raw.endswith(b"\n") else None
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                break  # a torn line; anything after it is not trusted either
            records.append(obj)
            good += len(raw)
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
        return records

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        """The whole lines of a log, without opening it for writing (a torn last one left out)."""
        out = []
        for raw in path.read_bytes().splitlines(keepends=True):
            try:
                obj = json.loads(raw) if raw.endswith(b"\n") else None
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                break
            out.append(obj)
        return out

    def done_ids(self) -> set[str]:
        return {r["custom_id"] for r in self.records if isinstance(r.get("custom_id"), str)}

    def append(self, record: Mapping[str, Any]) -> None:
        self.file.write(dumps(record))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.records.append(dict(record))

    def close(self) -> None:
        self.file.close()


def write_atomic(path: Path, data: bytes) -> None:
    """Write by temp file, fsync and rename (and fsync the folder): a reader sees the old file or
    the new one, never half of either, even across a power cut."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
