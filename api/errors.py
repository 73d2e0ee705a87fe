"""OpenAI-shaped errors: every failure is `{"error": {"message", "type", "param", "code"}}` JSON with the
right status, never an HTML page or a traceback."""

from __future__ import annotations

import logging

from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_response(err: APIError):
    resp = jsonify(err.body())
    resp.status_code = err.status
    for k, v in err.headers.items():
        resp.headers[k] = v
    return resp


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(err: APIError):
        return error_response(err)

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException):
        status = err.code or 500
        messages = {
            404: "Not found: no such route. See /v1/models, /v1/chat/completions, /v1/completions.",
            405: f"Method not allowed: {err.description}",
            413: "Request body too large.",
        }
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
        return error_response(APIError(status, messages.get(status, err.description or err.name), code=code))

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        log.exception("unhandled error")
        return error_response(APIError(500, "Internal server error.", code="internal_error"))
