"""OpenAI's error envelope, and the one exception type handlers raise to produce it.

Every failure a client sees is `{"error": {"message", "type", "param", "code"}}` with a status that
says whose fault it was; nothing else (no traceback, no aiohttp HTML page) ever goes out.
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

    def body(self) -> dict[str, Any]:
        return envelope(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def envelope(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(message: str, param: str) -> APIError:
    # Well-formed, but asks for something this server does not do: say so rather than ignore it.
    return APIError(422, message, param=param, code="unsupported_parameter")
