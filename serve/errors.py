"""The error envelopes, and the one exception type handlers raise to produce them.

Every failure a client sees is OpenAI's `{"error": {"message", "type", "param", "code"}}`, or on the
Anthropic routes (/v1/messages...) Anthropic's `{"type": "error", "error": {"type", "message"}}`,
with a status that says whose fault it was; nothing else (no traceback, no aiohttp HTML page) ever
goes out.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


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

    def body(self, anthropic: bool = False) -> dict[str, Any]:
        if anthropic:
            kind = _ANTHROPIC_TYPES.get(
                self.status, "invalid_request_error" if self.status < 500 else "api_error"
            )
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return envelope(self.status, self.message, param=self.param, code=self.code)

    def response(self, anthropic: bool = False) -> web.Response:
        return web.json_response(self.body(anthropic), status=self.status, headers=self.headers)


def envelope(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(message: str, param: str) -> APIError:
    # Well-formed, but asks for something this server does not do: say so rather than ignore it.
    return APIError(422, message, param=param, code="unsupported_parameter")
