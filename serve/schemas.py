"""Request bodies, validated by pydantic (strict types, ranges from OpenAI's API reference).

Unknown fields are ignored, as OpenAI clients send fields an older server does not know; fields we
know but cannot honour are refused by the routes (422) rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import APIError, bad_request
from .middleware import body_cap_for

MAX_STOPS = 4
Role = Literal["system", "developer", "user", "assistant", "tool"]


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)  # templates may read more keys
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(Body):
    include_usage: bool = False


class SamplingRequest(Body):
    """The knobs both routes share."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    goinfer_confidence: bool = False  # per-field confidence of a json_schema reply

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None


class LoadRequest(Body):
    name: str | None = None
    path: str
    quant: str | None = None


class UnloadRequest(Body):
    name: str


async def read_request(request: web.Request, model: type[Body]) -> Any:
    """The body, read under the route's cap and validated as `model`."""
    return parse(model, await read_body(request, body_cap_for(request)))


async def read_body(request: web.Request, cap: int) -> bytes:
    """The body, refusing past `cap` bytes (Content-Length was checked before; this covers chunked)."""
    parts, size = [], 0
    while chunk := await _read(request):
        size += len(chunk)
        if size > cap:
            raise APIError(
                413, f"request body is over the {cap}-byte cap for {request.path}", code="body_too_large"
            )
        parts.append(chunk)
    return b"".join(parts)


async def _read(request: web.Request) -> bytes:
    try:
        return await request.content.read(64 * 1024)
    except web.RequestPayloadError as e:  # a body its Content-Encoding (gzip, deflate) does not decode
        why = (str(e.__cause__ or e).strip().splitlines() or ["it does not decode"])[-1].strip()
        raise bad_request(f"request body cannot be read: {why}", code="invalid_body") from None


def parse(model: type[Body], body: bytes) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming its field."""
    if not body.strip():
        raise bad_request("request body is empty: expected a JSON object", code="missing_body")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        # Under a union, the telling error is the deepest, and one where the type matched but a
        # constraint failed (five stop strings) over "should be a valid string".
        err = max(errs, key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
        if err["type"] == "json_invalid":
            raise bad_request(f"request body is not valid JSON: {err['msg']}", code="invalid_json") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise bad_request("request body must be a JSON object", code="invalid_json") from None
        # Union members repeat the path with their type names; keep the field's own path.
        path = [str(p) for p in err["loc"] if not _is_type_tag(p)]
        param = ".".join(path) or None
        msg = "Input should be an object" if err["type"] == "model_type" else err["msg"]
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from None


def _is_type_tag(p: object) -> bool:
    return isinstance(p, str) and (
        p in ("str", "int", "float", "bool")
        or p.startswith(("list[", "dict[", "constrained-"))
        or p[0].isupper()
    )
