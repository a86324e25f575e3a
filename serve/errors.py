"""The exception handlers raise, and OpenAI's error envelope.

Every failure a client sees is an envelope with a status that says whose fault it was; nothing
else (no traceback, no aiohttp HTML page) ever goes out. Which envelope is the app's choice: the
root app answers in OpenAI's `{"error": {"message", "type", "param", "code"}}`, the Anthropic
sub-app in Anthropic's (messages.py), each through its own error middleware (middleware.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self, envelope: Envelope) -> web.Response:
        return web.json_response(envelope(self), status=self.status, headers=self.headers)


Envelope = Callable[[APIError], dict[str, Any]]  # an API's error body


def openai_envelope(err: APIError) -> dict[str, Any]:
    kind = _TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def queue_full(message: str, retry_after_s: int) -> APIError:
    """A model's queue is at its bound: a 429 the client may retry (generation's and embeddings')."""
    return APIError(429, message, code="queue_full", headers={"Retry-After": str(retry_after_s)})


def unsupported(message: str, param: str) -> APIError:
    # Well-formed, but asks for something this server does not do: say so rather than ignore it.
    return APIError(422, message, param=param, code="unsupported_parameter")
