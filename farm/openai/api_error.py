"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, as an exception any layer may raise:
the HTTP layer (api/error_handlers.py) answers it with its status, the batch driver writes it into the error file."""

from __future__ import annotations

from typing import Any

# OpenAI's error types by status; anything 5xx (or unlisted) is a server_error.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")


class APIError(Exception):
    """An error the API answers with: status, OpenAI error body, optional extra headers."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type(status)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error naming the offending parameter."""
    return APIError(400, message, param=param, code=code)
