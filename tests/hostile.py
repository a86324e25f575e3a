"""The hostile-input corpus (tests/fixtures/hostile/*.json) and its replay, shared by the fast tier
(tests/serve/test_hostile.py, fake engines) and the slow tier (tests/e2e/test_hostile_real.py).

A case is a JSON object:

    name            unique, says what is sent
    kind            the mutation kind (wrong_type, truncated_json, recursive_schema, ...)
    route, method   "/v1/chat/completions", "POST" (the default)
    headers         sent as given; a value is encoded UTF-8 with lone surrogates kept as the bytes
                    they stand for ("\\udcff" is the byte 0xFF), so non-UTF-8 headers are data too.
                    "$SELF" in a value is the server's own origin (http://HOST:PORT); the API key
                    header is added unless the case sends Authorization or x-api-key itself
    body            a JSON value, serialized with NaN/Infinity kept as literals; or
    body_text       the body's text (UTF-8, lone surrogates as bytes, so broken UTF-8 is data), or
    body_b64        the body's bytes
    fill            {"path": [...], "text": "...", "bytes": N}: before sending, the value at `path`
                    in `body` becomes `text` repeated to about N bytes (multi-megabyte prompts); or
                    {"path": [...], "item": X, "count": N}: a list of N copies of X, "{i}" in its
                    strings replaced by the copy's index (5000 tools, a 5000-value enum)
    expect_status   an int, or a list of the statuses that are each right
    expect_code, expect_error_type, expect_param   checked in the error envelope where given
    forbid          strings the response body must not contain (a file's bytes, a path)
    long            true: the reply may run to the model's whole window (a budget of 2**70), so
                    the slow tier sends it streamed and hangs up after the first events
    http_layer      true: not valid HTTP (a control byte in a header, an 8 KiB line), so aiohttp's
                    parser answers it (a plain-text 400) before any route or middleware runs

"model": "m" in a body names the one model both tiers serve. Every error must be the envelope of
the API called (Anthropic's under /v1/messages, OpenAI's elsewhere) with a JSON content type, a
streaming request refused is refused before any SSE byte, and no status is ever a 500.
"""

from __future__ import annotations

import base64
import http.client
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORPUS_DIR = Path(__file__).parent / "fixtures" / "hostile"
KEY = "test-key"
MODEL = "m"
_FIELDS = {
    "name", "kind", "route", "method", "headers", "body", "body_text", "body_b64", "fill", "expect_status",
    "expect_code", "expect_error_type", "expect_param", "forbid", "note", "http_layer", "long",
}  # fmt: skip


def load_corpus() -> list[dict[str, Any]]:
    """Every case of every corpus file, checked for shape; names are unique."""
    cases: list[dict[str, Any]] = []
    for path in sorted(CORPUS_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        for case in data if isinstance(data, list) else [data]:
            unknown = set(case) - _FIELDS
            assert not unknown, (path.name, case.get("name"), unknown)
            assert {"name", "kind", "route", "expect_status"} <= set(case), (path.name, case)
            assert sum(k in case for k in ("body", "body_text", "body_b64")) <= 1, case["name"]
            cases.append({**case, "file": path.name})
    names = [c["name"] for c in cases]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)
    return cases


def _wire(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


def _fill(body: Any, spec: dict[str, Any]) -> Any:
    body = json.loads(json.dumps(body))
    *parents, last = spec["path"]
    node = body
    for p in parents:
        node = node[p]
    if "item" in spec:
        item = json.dumps(spec["item"])
        node[last] = [json.loads(item.replace("{i}", str(i))) for i in range(spec["count"])]
    else:
        text = spec["text"]
        node[last] = text * (spec["bytes"] // len(text.encode()))
    return body


def body_bytes(case: dict[str, Any]) -> bytes | None:
    if "body_b64" in case:
        return base64.b64decode(case["body_b64"])
    if "body_text" in case:
        return _wire(case["body_text"])
    if "body" not in case:
        return None
    body = _fill(case["body"], case["fill"]) if "fill" in case else case["body"]
    # ensure_ascii keeps a lone surrogate as the JSON escape "\ud800" (as a client that sends one does)
    return json.dumps(body).encode()


def request_headers(case: dict[str, Any], own_origin: str) -> dict[str, bytes]:
    headers = {k: _wire(v.replace("$SELF", own_origin)) for k, v in case.get("headers", {}).items()}
    if not {"authorization", "x-api-key"} & {k.lower() for k in headers}:
        headers["Authorization"] = f"Bearer {KEY}".encode()
    if "body" in case and not any(k.lower() == "content-type" for k in headers):
        headers["Content-Type"] = b"application/json"
    return headers


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    sent: dict[str, Any] = field(default_factory=dict)

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip()


def send(
    host: str, port: int, case: dict[str, Any], timeout: float = 120.0, events: int | None = None
) -> Reply:
    """One case over a fresh HTTP/1.1 connection (http.client takes header values as raw bytes).
    `events`: read only that many SSE events of a 200 stream, then hang up."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        body = body_bytes(case)
        headers = request_headers(case, f"http://{host}:{port}")
        conn.request(case.get("method", "POST"), case["route"], body=body, headers=headers)
        resp = conn.getresponse()
        if events is not None and resp.status == 200:
            lines = []
            while sum(x.startswith(b"data: ") for x in lines) < events and (line := resp.readline()):
                lines.append(line)
            data = b"".join(lines)
        else:
            data = resp.read()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
    finally:
        conn.close()


def streamed(case: dict[str, Any]) -> dict[str, Any]:
    """A `long` case sent as a stream (see `send(events=...)`): its status and first events."""
    return {**case, "body": {**case["body"], "stream": True}}


def check(case: dict[str, Any], reply: Reply) -> None:
    """The case's expectations, and the rules every reply keeps."""
    where = f"{case['file']}: {case['name']}: {reply.status} {reply.body[:600]!r}"
    assert reply.status != 500, where
    assert b"Traceback" not in reply.body, where
    expected = case["expect_status"]
    assert reply.status in (expected if isinstance(expected, list) else [expected]), where
    for s in case.get("forbid", []):
        assert _wire(s) not in reply.body, (s, where)
    if case.get("http_layer"):
        assert reply.status == 400 and reply.content_type == "text/plain", where
    elif reply.status >= 400:
        assert reply.content_type == "application/json", where  # not SSE, not aiohttp's text page
        check_envelope(case, json.loads(reply.body), where)
    elif reply.status == 200 and reply.content_type == "text/event-stream":
        for event in sse_data(reply.body):
            assert not (isinstance(event, dict) and ("error" in event or event.get("type") == "error")), where
    elif reply.status == 200 and reply.content_type == "application/json":
        json.loads(reply.body)


def check_envelope(case: dict[str, Any], body: Any, where: str) -> None:
    if case["route"].startswith("/v1/messages"):
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", where
        err = body["error"]
        assert set(err) == {"type", "message"}, where
    else:
        assert isinstance(body, dict) and set(body) == {"error"}, where
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, where
        if "expect_code" in case:
            assert err["code"] == case["expect_code"], where
        if "expect_param" in case:
            assert err["param"] == case["expect_param"], where
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), where
    assert "Traceback" not in err["message"], where
    if "expect_error_type" in case:
        assert err["type"] == case["expect_error_type"], where


def sse_data(raw: bytes) -> list[Any]:
    """The data of each SSE event ([DONE] as the string)."""
    out = []
    for block in raw.decode().split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def final_text(case: dict[str, Any], reply: Reply) -> tuple[str, str]:
    """(the reply's text or tool arguments, its finish reason) for a 200 chat completion."""
    body = json.loads(reply.body)
    choice = body["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    text = calls[0]["function"]["arguments"] if calls else message.get("content") or ""
    return text, choice["finish_reason"]


# -- the schema fuzz -------------------------------------------------------------------------------
_LEAVES: list[dict[str, Any]] = [
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "string", "minLength": 5, "maxLength": 2},
    {"type": "integer", "minimum": 10, "maximum": 1},
    {"type": "number", "exclusiveMinimum": 3, "exclusiveMaximum": 3},
    {"type": "string", "pattern": "(["},
    {"type": "string", "pattern": "a{1000000}"},
    {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "not-a-format"},
    {"enum": []},
    {"const": None},
    {"type": "bogus"},
    {"type": ["string", "integer"]},
    {"not": {}},
    {"multipleOf": 0},
    {"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 6},
    {"$ref": "#"},
    {"$ref": "#/$defs/missing"},
    {"$ref": "http://example.com/schema.json"},
    True,
    False,
    {},
]


def fuzz_schema(rng: random.Random, depth: int = 0) -> Any:
    """One random JSON schema: nesting, $defs with $ref cycles and dangling refs, contradictory
    bounds, huge enums, allOf contradictions, patterns that are not regexes."""
    roll = rng.random()
    if depth >= 4 or roll < 0.25:
        leaf = rng.choice(_LEAVES)
        return json.loads(json.dumps(leaf))
    kind = rng.choice(["object", "array", "anyOf", "allOf", "defs", "enum", "oneOf"])
    if kind == "object":
        n = rng.randint(0, 4)
        props = {f"p{i}": fuzz_schema(rng, depth + 1) for i in range(n)}
        schema: dict[str, Any] = {"type": "object", "properties": props}
        if props and rng.random() < 0.7:
            schema["required"] = rng.sample(sorted(props), rng.randint(1, len(props)))
        if rng.random() < 0.3:
            schema["required"] = [*schema.get("required", []), "absent"]
        if rng.random() < 0.4:
            schema["additionalProperties"] = rng.choice([False, True, fuzz_schema(rng, depth + 1)])
        if rng.random() < 0.2:
            schema["minProperties"], schema["maxProperties"] = 5, 1
        return schema
    if kind == "array":
        schema = {"type": "array", "items": fuzz_schema(rng, depth + 1)}
        if rng.random() < 0.3:
            schema["minItems"], schema["maxItems"] = rng.choice([(3, 1), (0, 0), (1, 2), (100, 200)])
        if rng.random() < 0.2:
            schema["prefixItems"] = [fuzz_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.1:
            schema["uniqueItems"] = True
        return schema
    if kind in ("anyOf", "oneOf"):
        return {kind: [fuzz_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if kind == "allOf":
        if rng.random() < 0.5:
            return {"allOf": [{"type": "string"}, {"type": "integer"}]}  # nothing is both
        return {"allOf": [fuzz_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if kind == "enum":
        size = rng.choice([1, 3, 50, 5000])
        return {"enum": [rng.choice([f"v{i}", i, None, [i], {"k": i}]) for i in range(size)]}
    # $defs: a cycle (a -> b -> a), a self-reference under a property, or a dangling ref
    shape = rng.choice(["cycle", "self", "list", "dangling"])
    defs: dict[str, Any]
    if shape == "cycle":
        defs = {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}
        ref = "#/$defs/a"
    elif shape == "self":
        defs = {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                         "required": ["next"]}}  # fmt: skip
        ref = "#/$defs/node"
    elif shape == "list":  # a recursive type finite JSON satisfies: a linked list that may end
        nxt = {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}
        node = {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "next": nxt},
            "required": ["v", "next"],
        }
        defs = {"node": node}
        ref = "#/$defs/node"
    else:
        defs = {"x": fuzz_schema(rng, depth + 1)}
        ref = "#/$defs/nope"
    return {"$defs": defs, "type": "object", "properties": {"root": {"$ref": ref}}, "required": ["root"]}


def fuzz_cases(seed: int, n: int, max_tokens: int) -> list[dict[str, Any]]:
    """`n` chat requests, each a random schema as response_format (strict and not) or as a tool's
    parameters with tool_choice required. Each may be a 200 or a 400, never a 500."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        schema = fuzz_schema(rng)
        if not isinstance(schema, dict) or rng.random() < 0.15:
            schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Reply in JSON."}],
            "max_tokens": max_tokens,
            "temperature": rng.choice([0, 0.7]),
            "seed": i,
        }
        use = rng.choice(["strict", "lenient", "tool"])
        if use == "tool":
            fn = {"name": "f", "parameters": schema}
            body.update(tools=[{"type": "function", "function": fn}], tool_choice="required")
        else:
            spec = {"name": "fuzz", "schema": schema, "strict": use == "strict"}
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        out.append({
            "name": f"fuzz {seed}/{i} ({use})", "kind": "schema_fuzz", "route": "/v1/chat/completions",
            "body": body, "expect_status": [200, 400], "file": "(fuzz)",
        })  # fmt: skip
    return out


def check_fuzz(case: dict[str, Any], reply: Reply) -> None:
    """200 or 400; a 200 is JSON (the tool's arguments or the content) or was cut by max_tokens."""
    check(case, reply)
    if reply.status == 200:
        text, finish = final_text(case, reply)
        if finish != "length":
            assert text, (case["name"], reply.body[:400])
            json.loads(text)
