"""One request, every API: a Job in, SSE or one folded JSON reply out.

    Job -> rules -> prompt ids -> constraint -> plan -> run

Each API's route parses its body into a Job (how the request is spelled) with a `reply` that
makes its event builder (how the answer is shaped, events.py); everything between is here, read
top to bottom. Every check comes before the run is queued, so a bad request is an error response
and never half a stream. The run crosses into the runtime once: a GenerationRequest to
`Engine.generate`; token events come back and become the reply (stop strings, logprobs, tool calls,
confidence) on the model's worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web
from goinfer.runtime import grammar as g
from goinfer.runtime.decode import GenerationRequest, StepEvent
from goinfer.runtime.prompt import PromptTooLong
from goinfer.runtime.sampler import SamplingParams
from goinfer.runtime.thinking import ThinkingConfig

from . import thinking as think
from .confidence import recorded, with_confidence
from .config import SamplingDefaults
from .engine import Engine
from .errors import APIError, bad_request, unsupported
from .events import Delta, EventBuilder, respond, text_deltas
from .keys import CONFIG, REGISTRY
from .metrics import METRICS, Watch
from .registry import ModelSlot
from .tools import ToolPlan, plan_tools, prepare_messages
from .tools.stream import ToolDeltas

log = logging.getLogger("goinfer.serve")


# -- 1. the Job: one request, whichever API spelled it ------------------------------------------
@dataclass(frozen=True)
class Sampling:
    """Every API's sampling knobs in one shape (None: the default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    max_tokens: int | None = None
    default_max_tokens: int | None = None  # None: the rest of the context window
    stops: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); ids checked in make_plan
    repetition_penalty: float | None = None
    n: int = 1  # choices (OpenAI's n): choice i draws with seed + i


@dataclass(frozen=True)
class ThinkingAsk:
    """What a request asked of a thinking model (None: nothing; each API reads its own fields,
    serve/thinking.py says which): thinking on or off, the most tokens a block may hold, and
    whether the reply is split (reasoning_format none: not)."""

    enable: bool | None = None
    budget: int | None = None
    split: bool = True


@dataclass(frozen=True)
class Reply:
    """What an API's event builder needs to know of the run it shapes."""

    model: str
    prompt_tokens: int
    logprobs: bool
    tools: ToolPlan | None
    params: SamplingParams  # the sampling the run got, defaults filled in (Responses echoes it)
    echo: str = ""  # /v1/completions' echo: the prompt's text, sent before the completion
    n: int = 1  # choices, each ending with its own finish; the usage comes after the last


@dataclass(frozen=True)
class Job:
    """The prompt is `messages` (the chat APIs: OpenAI-shaped dicts, content already plain text) or
    `prompt` (/v1/completions: raw text or token ids). `reply` makes the API's event builder."""

    model: str | None
    sampling: Sampling
    reply: Callable[[Reply], EventBuilder]
    messages: list[dict[str, Any]] | None = None
    prompt: str | tuple[int, ...] | None = None
    prompt_field: str = "messages"  # the request field the prompt came from, for errors
    stream: bool = False
    response_format: dict[str, Any] | None = None  # OpenAI's chat form, whatever the API spelled
    confidence: bool = False  # goinfer_confidence
    tools: list[dict[str, Any]] | None = None  # OpenAI's chat form, whatever the API spelled
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    echo: bool = False  # /v1/completions: the prompt's text comes first in the reply
    # Where the API's request spelled the schemas, for errors that name them.
    schema_param: str = "response_format.json_schema.schema"
    tool_schema_param: str = "tools.{i}.function.parameters"
    thinking: ThinkingAsk = ThinkingAsk()  # what the request asked of a thinking model


# -- message content, the same way for every API ------------------------------------------------
TEXT = frozenset({"text"})  # chat completions and Anthropic
RESPONSES_TEXT = frozenset({"text", "input_text", "output_text"})


def text_of(content: Any, where: str, kinds: frozenset[str] = TEXT) -> str:
    """`content` (a string, None, or a list of parts with `type` and `text`) as one string: its
    text parts joined by newlines. No model here reads images yet."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(text, str):
            raise refused(f"{where}.{j}", kind)
        texts.append(text)
    return "\n".join(texts)


def refused(at: str, kind: Any, why: str = "only text parts are accepted") -> APIError:
    """The 400 for a part (or block) of a kind that cannot be read here."""
    what = f"{at}: unsupported content part type {kind!r}"
    if isinstance(kind, str) and "image" in kind:
        return bad_request(f"{what}: image content needs a vision model (vision: false here)", f"{at}.type")
    return bad_request(f"{what}; {why}", param=f"{at}.type")


# -- 2. rules: response_format, tools and confidence, checked, nothing compiled ----------------
@dataclass(frozen=True)
class Structured:
    grammar: str  # validated, not compiled with the tokenizer yet
    schema: dict[str, Any] | None  # None for json_object


@dataclass(frozen=True)
class Rules:
    """A response format's grammar or tools (not both), and, when per-field confidence is asked
    for, the schema it reads field kinds from."""

    structured: Structured | None = None
    tools: ToolPlan | None = None
    confidence: dict[str, Any] | None = None
    schema_param: str = ""

    def template_vars(self) -> dict[str, Any]:
        out = self.tools.template_vars() if self.tools else {}
        if self.structured is not None or (self.tools is not None and self.tools.forced):
            out["enable_thinking"] = False  # constrained from token 1: no open <think> block
        return out

    @property
    def constrained(self) -> bool:
        return self.structured is not None or self.tools is not None


def rules_for(engine: Engine, job: Job) -> Rules:
    """The job's constraints, checked against what the model can do.

    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` constrains the reply to
    the schema: with `strict: true` every keyword must be enforceable (a 400 names one that is
    not); without it the schema compiles leniently, as tools' do (runtime/grammar.py
    `LENIENT_OPTIONS`). `{"type": "json_object"}` constrains the reply to any JSON object."""
    tools = plan_tools(
        job.tools, job.tool_choice, job.parallel_tool_calls, engine.info.chat_template, job.tool_schema_param
    )
    fmt = response_format(job.response_format, job.schema_param)
    schema = confidence_schema(job.confidence, fmt, bool(job.tools))
    if tools is not None and fmt is not None:
        raise unsupported(
            "tools with a JSON response_format in one request is not supported", "response_format"
        )
    if (tools is not None or fmt is not None) and engine.grammar is None:
        what = "tools" if tools is not None else "response_format"
        raise unsupported(f"{what}: this model cannot run grammar-constrained decoding", what)
    return Rules(fmt, tools, schema, job.schema_param)


def response_format(rf: dict[str, Any] | None, where: str) -> Structured | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured(g.json_schema_grammar({"type": "object"}), None)
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
            param="response_format.type",
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        where = "response_format.json_schema"
        raise bad_request(f"{where} must be an object", param=where)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object", param=where)
    try:
        return Structured(g.compile_json_schema(schema, lenient=spec.get("strict") is not True), schema)
    except g.GrammarError as e:
        raise schema_error(where, e) from None


def schema_error(where: str, e: Exception) -> APIError:
    return bad_request(f"{where} is not a usable JSON schema: {e}", param=where, code="invalid_schema")


def confidence_schema(asked: bool, fmt: Structured | None, with_tools: bool) -> dict[str, Any] | None:
    """The schema goinfer_confidence reads field kinds from; None when it was not asked for."""
    if not asked:
        return None
    if fmt is None or fmt.schema is None:
        raise bad_request(
            'goinfer_confidence needs response_format {"type": "json_schema", ...}: the schema says each '
            "field's kind",
            param="goinfer_confidence",
        )
    if with_tools:
        raise bad_request("goinfer_confidence cannot be combined with tools", param="goinfer_confidence")
    return fmt.schema


# -- 3. prompt ids ---------------------------------------------------------------------------------
async def prompt_ids(
    slot: ModelSlot, job: Job, rules: Rules, thinking: ThinkingConfig = think.SERVER_DEFAULT
) -> list[int]:
    """The prompt's ids, tokenized off the event loop; a prompt that cannot fit the window is
    refused before it is tokenized in full (runtime/prompt.py). A thinking model's prompt renders
    thinking on or off as the request (else `thinking`, the server's mode) asks, and off whatever
    was asked when the reply is constrained from its first token (serve/thinking.py)."""
    engine = slot.engine
    if job.messages is not None:
        control, messages, variables = engine.info.thinking, job.messages, rules.template_vars()
        if control is not None:  # a thinking model; any other renders as it always did
            messages = think.replayed(messages, thinking)
            variables = think.template_vars(control, job.thinking, thinking) | variables
        messages = prepare_messages(unmarked(messages), rules.tools, engine.info.chat_template)
        return await _tokenized(slot, job, partial(engine.chat_ids, messages, **variables))
    if isinstance(job.prompt, str):
        return await _tokenized(slot, job, partial(engine.text_ids, job.prompt))
    ids = list(job.prompt or ())
    vocab = engine.info.vocab_size
    if vocab and max(ids) >= vocab:
        raise bad_request(f"prompt: token id {max(ids)} is outside the vocabulary (size {vocab})", "prompt")
    return ids


def unmarked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages without the mark messages.py puts on text sent beside tool results, which only
    a thinking model's replay reads (serve/thinking.py): a template never sees it."""
    mark = think.AFTER_RESULTS
    return [m if mark not in m else {k: v for k, v in m.items() if k != mark} for m in messages]


async def _tokenized(slot: ModelSlot, job: Job, fn: Callable[[], list[int]]) -> list[int]:
    try:
        return await asyncio.to_thread(fn)
    except PromptTooLong as e:
        raise too_long(job, slot, str(e.tokens) if e.exact else f"at least {e.tokens}") from None
    except ValueError as e:  # the chat template refused these messages (e.g. roles must alternate)
        raise APIError(
            422, f"model {slot.name!r}: {e}", param="messages", code="chat_template_error"
        ) from None


def too_long(job: Job, slot: ModelSlot, tokens: str) -> APIError:
    window = slot.engine.info.context_window
    return bad_request(
        f"the prompt is {tokens} tokens, over the context window of {window} tokens for model "
        f"{slot.name!r} (prompt and completion must fit in {window})",
        param=job.prompt_field,
        code="context_length_exceeded",
    )


# -- 4. the constraint: the one grammar a request needs, compiled once -------------------------
def constraint(rules: Rules, engine: Engine) -> g.Constraint | None:
    """The grammar mask, compiled with the model's tokenizer and its first step tried, so a
    grammar that cannot run is a 400 before any token. Blocking: run it off the event loop."""
    tok = engine.grammar
    if not rules.constrained or tok is None:  # (an engine without grammar was refused in `rules_for`)
        return None
    what = "tools" if rules.tools is not None else "response_format"
    try:
        tok.get()
    except g.GrammarError as e:  # this tokenizer cannot drive llguidance
        raise unsupported(f"{what}: {e}", what) from None
    if rules.tools is not None:
        return rules.tools.constraint(tok)
    assert rules.structured is not None
    try:
        return tok.constraint(rules.structured.grammar)
    except g.GrammarError as e:
        raise schema_error(rules.schema_param, e) from None


async def choice_masks(rules: Rules, engine: Engine, n: int) -> list[g.Constraint]:
    """One compiled constraint a choice (each is stateful: one run's), or none when unconstrained."""
    if not rules.constrained:
        return []
    masks = [await asyncio.to_thread(constraint, rules, engine) for _ in range(n)]
    return [m for m in masks if m is not None]


# -- 5. the plan: checked against the window, defaults filled in ------------------------------------
@dataclass(frozen=True)
class Plan:
    """What the model's worker runs: one request a choice (OpenAI's n), the first the plain one."""

    model: str
    choices: tuple[GenerationRequest, ...]
    stops: tuple[str, ...]
    logprobs: bool
    rules: Rules
    thinking: think.Thinking | None = None  # a thinking model's: its budget and its split

    @property
    def request(self) -> GenerationRequest:
        return self.choices[0]

    def reply(self, echo: str = "") -> Reply:
        r = self.request
        return Reply(
            self.model,
            len(r.prompt_ids),
            self.logprobs,
            self.rules.tools,
            r.sampling,
            echo,
            len(self.choices),
        )

    def deltas(
        self, engine: Engine, cancel: threading.Event | None = None, watch: Watch | None = None
    ) -> Iterator[Delta]:
        """The one generation path: the engine's token events folded into client deltas; with
        several choices, each folded alike on a thread of its own and merged (`Delta.index`)."""
        if len(self.choices) == 1:
            return self.folded(engine.generate(self.request, cancel), engine, cancel, watch)
        cancel = cancel or threading.Event()
        streams = engine.generate_choices(list(self.choices), cancel)
        return merged([self.folded(ev, engine, cancel, watch) for ev in streams], cancel)

    def folded(
        self,
        events: Iterator[StepEvent],
        engine: Engine,
        cancel: threading.Event | None = None,
        watch: Watch | None = None,
    ) -> Iterator[Delta]:
        """One choice's token events as client deltas: stop strings, logprobs, tool calls, confidence."""
        confidence = self.rules.confidence
        events = logged(events, self.model)
        if watch is not None:  # /metrics: timed and counted on this worker thread
            events = watch(events, len(self.request.prompt_ids), cancel)
        if self.rules.constrained:
            events = grammar_checked(events, self.rules)
        steps: list[StepEvent] = []
        if confidence is not None:
            events = recorded(events, steps)
        tools = self.rules.tools
        end_at = tools.reply_end if tools is not None else None
        n = len(self.request.prompt_ids)
        split = self.thinking.splitter() if self.thinking is not None else None
        out = text_deltas(events, n, self.stops, engine.token_text, self.logprobs, end_at, split)
        if tools is not None:
            out = ToolDeltas(tools.fmt, tools.names)(out)
        if confidence is not None:
            out = with_confidence(out, steps, confidence, engine.token_text)
        return out


def make_plan(
    job: Job,
    slot: ModelSlot,
    rules: Rules,
    ids: list[int],
    masks: Sequence[g.Constraint],
    d: SamplingDefaults,
    thinking: ThinkingConfig = think.SERVER_DEFAULT,
) -> Plan:
    """Refuse a prompt the window cannot hold; the reply's budget is the runtime's to clamp.
    `masks`: one compiled constraint a choice (a constraint is one run's), or none. A chat
    prompt to a thinking model gets its reasoning budget and split (serve/thinking.py)."""
    s = job.sampling
    if len(ids) >= slot.engine.info.context_window:
        raise too_long(job, slot, str(len(ids)))
    vocab = slot.engine.info.vocab_size
    for tok, _ in s.logit_bias:
        if vocab and tok >= vocab:
            msg = f"logit_bias: key '{tok}' is outside the vocabulary (size {vocab})"
            raise bad_request(msg, param=f"logit_bias.{tok}")
    params = SamplingParams(
        temperature=d.temperature if s.temperature is None else s.temperature,
        top_k=d.top_k if s.top_k is None else s.top_k,
        top_p=d.top_p if s.top_p is None else s.top_p,
        min_p=d.min_p if s.min_p is None else s.min_p,
        seed=s.seed,
        frequency_penalty=s.frequency_penalty or 0.0,
        presence_penalty=s.presence_penalty or 0.0,
        max_tokens=s.max_tokens if s.max_tokens is not None else s.default_max_tokens,
        logit_bias=s.logit_bias,
        repetition_penalty=1.0 if s.repetition_penalty is None else s.repetition_penalty,
    )
    capture, top = rules.confidence is not None, s.top_logprobs if s.logprobs else None
    control = slot.engine.info.thinking if job.messages is not None else None  # raw prompts: never split
    reasoning = think.plan(control, job.thinking, thinking, ids) if control is not None else None
    budget = reasoning.budget if reasoning is not None else None
    choices = tuple(
        GenerationRequest(ids, choice_sampling(params, i), top, masks[i] if masks else None, capture, budget)
        for i in range(s.n)
    )
    return Plan(slot.name, choices, s.stops, s.logprobs, rules, reasoning)


def choice_sampling(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of a seeded request draws with seed + i: choice 0 is the request's reply with n=1,
    and choice i the reply to the same request with n=1 and seed + i."""
    return params if i == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + i)


def merged(choices: list[Iterator[Delta]], cancel: threading.Event) -> Iterator[Delta]:
    """Several choices' deltas as they come, each tagged with its index. Each choice runs on a
    thread of its own, since each blocks on the scheduler for its steps (which batches them); an
    error in one, or the consumer leaving, stops them all."""
    out: queue.Queue[tuple[int, Delta | BaseException | None]] = queue.Queue()

    def pump(i: int, deltas: Iterator[Delta]) -> None:
        try:
            for d in deltas:
                if cancel.is_set():
                    break
                out.put((i, dataclasses.replace(d, index=i)))
        except BaseException as e:  # handed to the consumer's thread, which raises it
            out.put((i, e))
        finally:
            close = getattr(deltas, "close", None)
            if close is not None:
                close()
            out.put((i, None))

    threads = [threading.Thread(target=pump, args=(i, c), daemon=True) for i, c in enumerate(choices)]
    for t in threads:
        t.start()
    try:
        running = len(threads)
        while running:
            _i, item = out.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        cancel.set()  # a no-op once every choice has ended; stops the others on an error or an exit
        for t in threads:
            t.join()


# -- 6. the run ----------------------------------------------------------------------------------
async def prepare(request: web.Request, job: Job) -> tuple[ModelSlot, Rules, list[int]]:
    """Route, rules and prompt ids: all a count of tokens needs."""
    slot = request.config_dict[REGISTRY].route(job.model)
    rules = rules_for(slot.engine, job)
    return slot, rules, await prompt_ids(slot, job, rules, request.config_dict[CONFIG].thinking)


async def run(request: web.Request, job: Job) -> web.StreamResponse:
    """The whole pipeline: queue the plan on the model's worker; its events as SSE, or their fold."""
    arrived = time.perf_counter()
    slot, rules, ids = await prepare(request, job)
    masks = await choice_masks(rules, slot.engine, job.sampling.n)
    cfg = request.config_dict[CONFIG]
    plan = make_plan(job, slot, rules, ids, masks, cfg.sampling, cfg.thinking)
    metrics = request.config_dict.get(METRICS)
    watch = metrics.watch(slot.name, arrived) if metrics is not None else None
    work = slot.submit(partial(plan.deltas, slot.engine, watch=watch), cfg.poll_s, cfg.retry_after_s)
    builder = job.reply(plan.reply(echo_text(job, slot.engine, ids)))
    return await respond(request, work, builder, stream=job.stream, keepalive_s=cfg.keepalive_s)


def echo_text(job: Job, engine: Engine, ids: list[int]) -> str:
    """The prompt as echo sends it: the text as given, or token ids' texts joined."""
    if not job.echo:
        return ""
    return job.prompt if isinstance(job.prompt, str) else "".join(engine.token_text(i) for i in ids)


def grammar_checked(events: Iterator[StepEvent], rules: Rules) -> Iterator[StepEvent]:
    """A grammar that fails past its first step (tried before the run) is still the schema's
    fault: a 400 naming it (llguidance gives up on some schemas only once it is inside them)."""
    try:
        yield from events
    except g.GrammarError as e:
        where = "tools" if rules.tools is not None else rules.schema_param
        raise bad_request(f"{where}: the reply's grammar cannot go on: {e}", where, "grammar_error") from None


def logged(events: Iterator[StepEvent], model: str) -> Iterator[StepEvent]:
    """The engine's events, and one log line per generation (as llama-server prints): the prompt,
    how much of it was reused, the time to the first token (queue and prefill), the decode rate."""
    start = time.perf_counter()
    first, n, counts, finish = start, 0, {}, "closed early"  # a stop string, a call's end, a client gone
    try:
        for ev in events:
            if ev.token_id is None:
                finish = ev.finish_reason or finish
            else:
                n += 1
                if n == 1:
                    first, counts = time.perf_counter(), ev.timings
            yield ev
    except Exception as e:  # Cancelled, KVCacheFull, a failed forward: the reply says more
        finish = type(e).__name__
        raise
    finally:
        end = time.perf_counter()
        rate = (n - 1) / (end - first) if n > 1 and end > first else 0.0
        log.info(
            "%s: prompt %s tokens (%s reused), first token after %.2f s; %d generated at %.1f tok/s (%s)",
            model, counts.get("prompt_tokens", "?"), counts.get("cached_tokens", "?"), first - start, n, rate,
            finish,
        )  # fmt: skip
