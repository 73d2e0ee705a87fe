"""OpenAI-shaped errors: every failure is `{"error": {"message", "type", "param", "code"}}` JSON with the
right status, never an HTML page or a traceback; under Anthropic's `/v1/messages` routes, Anthropic's shape
(`{"type": "error", "error": {...}}`), routing errors such as a 405 included.

`to_api_error` is the one mapping from exceptions (ours, the gateway's, werkzeug's, Redis's) to that shape,
used both by the Flask error handlers and by SSE streams that fail after their headers were sent.
"""

from __future__ import annotations

import logging

import redis
from flask import Flask, Response, g, has_request_context, jsonify, request
from gunicorn.http.errors import NoMoreData, ParseException
from werkzeug.exceptions import HTTPException

from api.request_ids import error_request_id
from farm.gateway import BusyError, ClientGone, GatewayTimeout, NoWorkersError, WorkerError
from farm.models.directories import ModelNotFoundError
from farm.openai import anthropic
from farm.openai.api_error import APIError

log = logging.getLogger(__name__)

NO_WORKERS_RETRY_AFTER_S = 5  # workers take seconds to start and register
REDIS_DOWN_RETRY_AFTER_S = 2


_HTTP_MESSAGES = {
    400: "Bad request.",
    404: "Not found: no such route. See /v1/models, /v1/chat/completions, /v1/completions and /health.",
    413: "Request body too large.",
}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def to_api_error(err: BaseException) -> APIError:
    """Map any exception to the APIError the client should see (unexpected ones: a bare 500)."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, HTTPException):
        status = err.code or 500
        if status == 405:
            message = "Method not allowed for this route."
            if getattr(err, "valid_methods", None):
                message = f"Method not allowed; this route accepts {', '.join(sorted(err.valid_methods))}."
        else:
            message = _HTTP_MESSAGES.get(status) or (err.description if status < 500 else None) or err.name
        # keep headers such as Allow (405) or Retry-After, never werkzeug's Content-Type
        headers = {k: v for k, v in err.get_headers() if k.lower() not in ("content-type", "content-length")}
        return APIError(status, message, code=_HTTP_CODES.get(status), headers=headers)
    if isinstance(err, (ParseException, NoMoreData)):  # gunicorn reading the body: a malformed chunk, a cut body
        return APIError(400, f"The request body could not be read: {type(err).__name__}.", code="bad_request")
    if isinstance(err, NoWorkersError):
        return APIError(503, str(err), code="no_workers", headers={"Retry-After": str(NO_WORKERS_RETRY_AFTER_S)})
    if isinstance(err, BusyError):
        return APIError(503, f"The farm is at capacity: {err}", code="overloaded",
                        headers={"Retry-After": str(err.retry_after_s)})
    if isinstance(err, GatewayTimeout):
        return APIError(504, str(err), code="timeout")
    if isinstance(err, WorkerError):  # a lost worker no other could replace: retry later; else the engine failed
        return APIError(err.status, f"generation failed: {err}", code=err.code,
                        headers={"Retry-After": str(NO_WORKERS_RETRY_AFTER_S)} if err.retryable else None)
    if isinstance(err, ClientGone):  # nobody reads the answer; 499 as nginx logs it, for logs and metrics
        return APIError(499, str(err), code="client_disconnected")
    if isinstance(err, ModelNotFoundError):  # configured but not on disk: the operator's problem, not the client's
        return APIError(503, str(err), code="model_unavailable")
    if isinstance(err, redis.RedisError):
        return APIError(503, "The farm's Redis is unreachable.", code="redis_unavailable",
                        headers={"Retry-After": str(REDIS_DOWN_RETRY_AFTER_S)})
    return APIError(500, "Internal server error.", code="internal_error")


ANTHROPIC_PATH = "/v1/messages"  # its routes answer every error in Anthropic's shape


def request_id_of_error() -> str:
    """The failed request's id: the one its answer would have carried once a generation route gave it one (in its
    logs too), else the client's own, else a fresh `req_...` (made once per request, so the log names it too)."""
    if "request_header_id" not in g:
        g.request_header_id = error_request_id(request.headers.get("X-Request-Id"))
    return str(g.request_header_id)


def error_response(err: APIError) -> Response:
    """The error's JSON with its headers, its request id (`x-request-id`, and Anthropic's `request-id` under its
    routes: an SDK's error object names the request), and `x-should-retry: false` on a 409: the openai SDK
    retries a conflict, and the farm's (a file a batch still reads, a batch no longer cancellable) do not end
    by waiting."""
    anthropic_route = has_request_context() and request.path.startswith(ANTHROPIC_PATH)
    if anthropic_route:
        status, body = anthropic.from_api_error(err)
    else:
        status, body = err.status, err.body()
    rid = request_id_of_error() if has_request_context() else None
    if anthropic_route and rid is not None:  # Anthropic's error body names its request too
        body = {**body, "request_id": anthropic.request_id(rid)}
    resp = jsonify(body)
    resp.status_code = status
    if rid is not None:
        resp.headers["x-request-id"] = rid
        if anthropic_route:
            resp.headers["request-id"] = anthropic.request_id(rid)
    if status == 409:
        resp.headers["x-should-retry"] = "false"
    for k, v in err.headers.items():
        resp.headers[k] = v
    return resp


def register_error_handlers(app: Flask) -> None:
    """Route every error, including werkzeug's and unexpected exceptions, through `to_api_error`."""

    @app.errorhandler(APIError)
    def _api_error(err: APIError):
        return error_response(err)

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException):
        if err.code is not None and err.code < 400:  # redirects (e.g. RequestRedirect) are not errors
            return err
        return error_response(to_api_error(err))

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        api_err = to_api_error(err)
        rid = request_id_of_error() if has_request_context() else "-"
        if api_err.status == 500:
            log.exception("unhandled error (request %s)", rid)
        else:
            log.warning("request failed (request %s): %s: %s", rid, type(err).__name__, err)
        return error_response(api_err)
