"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models, and /health
(/v1/embeddings is embeddings.py's).

A generation route reads its body (capped, middleware.read_request), validates it against its
schema below (ranges from OpenAI's API reference), turns it into a Job and hands that to the
pipeline (pipeline.py), which every API shares. messages.py and responses.py hold the other APIs'
schemas and routes the same way.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from aiohttp import web
from goinfer.runtime import selftest
from goinfer.runtime.thinking import FORMATS as REASONING_FORMATS
from pydantic import BaseModel, ConfigDict, Field

from . import embeddings, pipeline
from .errors import bad_request, unsupported
from .events import ChatChunks, CompletionChunks
from .guards import HALT
from .keys import REGISTRY, STARTED
from .middleware import Body, read_request, text_body
from .pipeline import Job, Sampling, ThinkingAsk, text_of
from .registry import ModelSlot

MAX_STOPS = 4
MAX_CHOICES = 16  # n: each choice holds a copy of the prompt's KV and a worker thread while it runs
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
Role = Literal["system", "developer", "user", "assistant", "tool"]


# -- request bodies ----------------------------------------------------------------------------------
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
    logit_bias: dict[str, float] | None = None  # token id -> [-100, 100]; ids checked against the vocabulary
    repetition_penalty: float | None = None  # vLLM's / llama.cpp's: > 0, 1.0 off
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
    # thinking models (serve/thinking.py): template variables (enable_thinking is read), effort
    # "none" turns thinking off, the split's format, a block's budget (llama.cpp's name too)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    reasoning_format: str | None = None
    thinking_token_budget: Annotated[int, Field(ge=0)] | None = None
    thinking_budget_tokens: Annotated[int, Field(ge=-1)] | None = None  # llama.cpp's; -1: the server's

    @property
    def thinking(self) -> ThinkingAsk:
        """What the request asks of a thinking model (serve/thinking.py); a bad value is a 400."""
        enable = False if self.reasoning_effort == "none" else None
        flag = (self.chat_template_kwargs or {}).get("enable_thinking")
        if flag is not None:
            if not isinstance(flag, bool):
                where = "chat_template_kwargs.enable_thinking"
                raise bad_request(f"{where} must be true or false, not {flag!r}", param=where)
            enable = flag
        fmt = self.reasoning_format
        if fmt is not None and fmt not in REASONING_FORMATS:
            formats = ", ".join(map(repr, REASONING_FORMATS))
            raise bad_request(f"reasoning_format {fmt!r} is not one of {formats}", param="reasoning_format")
        budget = self.thinking_token_budget
        if budget is None and self.thinking_budget_tokens is not None and self.thinking_budget_tokens >= 0:
            budget = self.thinking_budget_tokens
        return ThinkingAsk(enable, budget, fmt != "none")


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None


# -- routes --------------------------------------------------------------------------------------------
routes = web.RouteTableDef()
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default on /v1/completions; chat gets the rest of the window


@routes.post("/v1/chat/completions")
@text_body
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await pipeline.run(request, chat_job(await read_request(request, ChatRequest)))


@routes.post("/v1/completions")
@text_body
async def completions(request: web.Request) -> web.StreamResponse:
    return await pipeline.run(request, completion_job(await read_request(request, CompletionRequest)))


def chat_job(req: ChatRequest) -> Job:
    refuse_unsupported(req)
    usage = req.include_usage or not req.stream
    return Job(
        model=req.model,
        sampling=openai_sampling(req),
        reply=lambda r: ChatChunks(r.model, usage, r.logprobs, r.n),
        messages=chat_messages(list(req.messages)),
        stream=req.stream,
        thinking=req.thinking,
        response_format=req.response_format,
        confidence=req.goinfer_confidence,
        tools=req.tools,
        tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
    )


def completion_job(req: CompletionRequest) -> Job:
    refuse_unsupported(req)
    prompt = completion_prompt(req)
    usage = req.include_usage or not req.stream
    return Job(
        model=req.model,
        sampling=openai_sampling(req),
        reply=lambda r: CompletionChunks(r.model, usage, r.logprobs, r.echo, r.n),
        prompt=prompt if isinstance(prompt, str) else tuple(prompt),
        prompt_field="prompt",
        echo=req.echo,
        stream=req.stream,
        response_format=req.response_format,
        confidence=req.goinfer_confidence,
    )


def refuse_unsupported(req: SamplingRequest) -> None:
    if req.n is not None and req.n > MAX_CHOICES:
        raise bad_request(f"n={req.n}: at most {MAX_CHOICES} choices a request", param="n")
    if (req.n or 1) > 1 and req.goinfer_confidence:
        raise bad_request("goinfer_confidence is offered with n=1 only", param="goinfer_confidence")
    if isinstance(req, CompletionRequest):
        if req.echo and req.logprobs is not None:  # OpenAI would score the prompt's tokens too
            raise unsupported("echo with logprobs is not supported (no prompt log-probabilities)", "echo")
        if req.suffix:
            raise unsupported("suffix is not supported", "suffix")
        if req.best_of not in (None, 1):
            raise bad_request(f"best_of={req.best_of}: only 1 is supported", param="best_of")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Request messages -> the dicts a chat template reads.

    `developer` is OpenAI's newer name for `system`: renamed in place. When several system
    messages are sent, the last one wins (earlier ones are dropped), wherever it stands.
    """
    out: list[dict[str, Any]] = []
    last_system = max((i for i, m in enumerate(messages) if m.role in ("system", "developer")), default=-1)
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role == "system" and i != last_system:
            continue
        if m.content is None and m.role != "assistant":  # an assistant turn may only call tools
            where = f"messages.{i}.content"
            raise bad_request(f"{where} is required for role {m.role!r}", param=where)
        d = m.model_dump(exclude_none=True)
        d["role"], d["content"] = role, text_of(d.get("content"), f"messages.{i}.content")
        if role == "assistant" and "reasoning" in d:  # vLLM's newer name for replayed reasoning
            reasoning = d.pop("reasoning")
            d.setdefault("reasoning_content", reasoning)
        out.append(d)
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completions request: text, or token ids."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request(f"prompt: {len(p)} prompts given; only one per request is supported", "prompt")
        p = p[0]
    if not p:
        raise bad_request("prompt is empty", param="prompt")
    return p  # type: ignore[return-value]


def openai_sampling(req: SamplingRequest) -> Sampling:
    """The knobs of /v1/chat/completions or /v1/completions."""
    if isinstance(req, ChatRequest):
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs, top, default = req.logprobs, req.top_logprobs or 0, None
        if top and not logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        assert isinstance(req, CompletionRequest)
        asked, default = req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS
        logprobs, top = req.logprobs is not None, req.logprobs or 0
    return Sampling(
        req.temperature,
        req.top_p,
        req.top_k,
        req.min_p,
        req.seed,
        req.frequency_penalty,
        req.presence_penalty,
        asked,
        default,
        req.stops,
        logprobs,
        top,
        logit_bias=logit_bias(req.logit_bias),
        repetition_penalty=repetition_penalty(req.repetition_penalty),
        n=req.n or 1,
    )


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a string) to a bias in [-100, 100], at most 300 entries; the ids
    are checked against the model's vocabulary in the pipeline (pipeline.make_plan)."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias: {len(bias)} entries, at most {MAX_LOGIT_BIAS}", param="logit_bias")
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias: key {key!r} is not a token id", param=f"logit_bias.{key}")
        if not -100 <= value <= 100:
            where = f"logit_bias.{key}"
            raise bad_request(f"logit_bias: {key!r} has bias {value}, outside [-100, 100]", param=where)
        out.append((int(key), float(value)))
    return tuple(out)


def repetition_penalty(value: float | None) -> float | None:
    if value is not None and not (0 < value < float("inf")):
        raise bad_request(f"repetition_penalty={value}: must be > 0 (1.0 is off)", param="repetition_penalty")
    return value


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    created, reg = request.config_dict[STARTED], request.config_dict[REGISTRY]
    data = [model_entry(slot, created) for slot in reg.slots.values()]
    data += [embeddings.model_entry(slot, created) for slot in reg.encoders.values()]
    return web.json_response({"object": "list", "data": data})


def model_entry(slot: ModelSlot, created: int) -> dict[str, Any]:
    info = slot.engine.info
    return {
        "id": slot.name,
        "object": "model",
        "created": created,
        "owned_by": "goinfer",
        "kind": "chat",  # an encoder's entry says "embedding" (embeddings.model_entry)
        "context_window": info.context_window,
        "decode_path": info.decode_path,
        "prefill_path": info.prefill_path,
        "quant": info.quant,
        "vision": info.vision,
        "decisions": info.decisions,  # POST /v1/systemone (serve/decisions.py)
    }


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    reg = request.config_dict[REGISTRY]
    models: dict[str, Any] = {
        name: {
            "kind": "chat",
            "running_or_queued": s.admitted,
            "target": s.engine.info.target,  # "cuda/sm_90", "llvm/avx512-vnni": where it runs
            "selftest": s.engine.info.selftest,
            **s.engine.stats(),
        }
        for name, s in reg.slots.items()
    }
    models.update({name: embeddings.health(s) for name, s in reg.encoders.items()})
    for entry in models.values():  # each model's checks, always an array (the seed's shape)
        entry["selftest"] = _as_array(entry.get("selftest"))
    halted = request.config_dict[HALT].health()
    return web.json_response(
        {
            "status": "halted" if halted else "ok",
            **({"halted": halted} if halted else {}),  # {"by": "admin" | "swap guard", "reason"}
            "models": models,
            "loading": sorted(reg.loading),
            # every backend/tier check this process ran: backend, status, elapsed_ms, and
            # mismatches and stepped_down when there are any
            "selftest": [r.to_json() for r in selftest.RESULTS],
        }
    )


def _as_array(result: dict[str, Any] | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return result if isinstance(result, list) else [] if result is None else [result]
