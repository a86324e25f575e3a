"""Response bodies held to the `openai` and `anthropic` SDKs' own typed models (pydantic, strict).

The SDKs build their objects without validating what a server sent, so a round trip through them
passes even when a field has the wrong type or a required one is missing; these checks do not.
Each returns the body, so a test can write `body = sdk_models.chat(await resp.json())`.
"""

from __future__ import annotations

from typing import Any, Literal

import anthropic.types as anthropic_types
import openai.types as openai_types
from openai.types import chat as openai_chat
from openai.types import responses as openai_responses
from pydantic import BaseModel, TypeAdapter

Body = dict[str, Any]


class _StreamedChoice(openai_types.CompletionChoice):
    # OpenAI streams completions as Completion objects whose finish_reason is null until the last;
    # the SDK's type, written for the whole reply, does not allow that.
    finish_reason: Literal["stop", "length", "content_filter"] | None = None


class _StreamedCompletion(openai_types.Completion):
    choices: list[_StreamedChoice]


_RESPONSE_EVENT: TypeAdapter[Any] = TypeAdapter(openai_responses.ResponseStreamEvent)
_MESSAGE_EVENT: TypeAdapter[Any] = TypeAdapter(anthropic_types.RawMessageStreamEvent)


def _valid(model: type[BaseModel], body: Body) -> Body:
    model.model_validate(body, strict=True)
    return body


def chat(body: Body) -> Body:
    return _valid(openai_chat.ChatCompletion, body)


def completion(body: Body) -> Body:
    return _valid(openai_types.Completion, body)


def chunk(c: Body) -> Body:
    """One `data:` event of a chat or completions stream; goinfer's own confidence event is not
    an OpenAI type and is left to the tests that read it."""
    if "goinfer_confidence" in c and "object" not in c:
        return c
    if c["object"] == "text_completion":
        return _valid(_StreamedCompletion, c)
    return _valid(openai_chat.ChatCompletionChunk, c)


def openai_reply(body: Body) -> Body:
    """A chat or completions route's JSON body: the reply, or the error envelope."""
    if "error" in body:
        return openai_error(body)
    return {"chat.completion": chat, "text_completion": completion}[body["object"]](body)


def openai_error(body: Body) -> Body:
    _valid(openai_types.ErrorObject, body["error"])
    return body


def model(entry: Body) -> Body:
    return _valid(openai_types.Model, entry)


def models(body: Body) -> Body:
    for entry in body["data"]:
        model(entry)
    return body


def response(body: Body) -> Body:
    return _valid(openai_responses.Response, body)


def response_event(e: Body) -> Body:
    _RESPONSE_EVENT.validate_python(e, strict=True)
    return e


def message(body: Body) -> Body:
    return _valid(anthropic_types.Message, body)


def message_event(e: Body) -> Body:
    if e["type"] != "ping":  # Anthropic sends pings; the SDK's event union does not model them
        _MESSAGE_EVENT.validate_python(e, strict=True)
    return e


def token_count(body: Body) -> Body:
    return _valid(anthropic_types.MessageTokensCount, body)


def anthropic_error(body: Body) -> Body:
    return _valid(anthropic_types.ErrorResponse, body)
