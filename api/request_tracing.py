"""The request's span and log fields, as a WSGI wrapper around the whole app (outermost, so it sees every answer).

Every request starts with fresh log fields and leaves none behind once the server closes its body
(farm.infra.logcontext: a keep-alive connection's greenlet serves many requests and logs between them); the
routes' gateway binds the request id, model and workers as it places the request. With tracing on
(farm.infra.tracing) the request gets a SERVER span, a child of the client's `traceparent` when it sends one, that
is current while the app runs and while the server iterates the body, and ends when the server closes the response:
a stream's span covers the whole stream. Off, the wrapper only clears the log fields, before and after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from flask import Flask, request
from werkzeug.wsgi import ClosingIterator

from farm.infra import logcontext, tracing

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class RequestTracing:
    def __init__(self, wsgi_app: WSGIApp):
        self.wsgi_app = wsgi_app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        logcontext.clear()
        if not tracing.ENABLED:
            try:
                return ClosingIterator(self.wsgi_app(environ, start_response), logcontext.clear)
            except BaseException:
                logcontext.clear()
                raise
        method = environ.get("REQUEST_METHOD", "GET")
        parent = tracing.extract({"traceparent": environ.get("HTTP_TRACEPARENT"),
                                  "tracestate": environ.get("HTTP_TRACESTATE")})
        span = tracing.start_span(method, tracing.SERVER, {
            "http.request.method": method, "url.path": environ.get("PATH_INFO", ""),
            "url.scheme": environ.get("wsgi.url_scheme", "http"),
            "user_agent.original": environ.get("HTTP_USER_AGENT", "")[:256]}, context=parent)
        assert span is not None
        ctx = tracing.context_of(span)
        logcontext.bind(trace_id=tracing.trace_id(span))

        def traced_start_response(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            code = int(status.split(" ", 1)[0]) if status[:3].isdigit() else 0
            span.set_attribute("http.response.status_code", code)
            if code >= 500:
                tracing.mark_error(span, status)
            return start_response(status, headers, *exc)

        token = tracing.attach(ctx)
        try:
            body = self.wsgi_app(environ, traced_start_response)
        except BaseException as e:
            tracing.record_error(span, e)
            _end(span)
            raise
        finally:
            tracing.detach(token)
        return _TracedBody(body, span, ctx)


def _end(span: Any) -> None:
    """End the request's span with the request's fields as the gateway bound them, then forget the fields."""
    fields = logcontext.fields()
    span.set_attributes({f"farm.{k}": v for k, v in fields.items() if k != "trace_id"})
    span.end()
    logcontext.clear()


class _TracedBody:
    """The app's body with the request's span current while the server reads it; closing it ends the span."""

    def __init__(self, body: Iterable[bytes], span: Any, ctx: Any):
        self.body, self.span, self.ctx = body, span, ctx
        self._it: Iterator[bytes] | None = None
        self._ended = False

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        token = tracing.attach(self.ctx)
        try:
            if self._it is None:
                self._it = iter(self.body)
            return next(self._it)
        finally:
            tracing.detach(token)

    def close(self) -> None:
        token = tracing.attach(self.ctx)
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            tracing.detach(token)
            if not self._ended:
                self._ended = True
                _end(self.span)


def _name_span() -> None:
    """The span's name once the route is known: "POST /v1/chat/completions" (low cardinality: the rule, not the
    path)."""
    rule = request.url_rule
    if rule is not None:
        span = tracing.current_span()
        span.update_name(f"{request.method} {rule.rule}")
        span.set_attribute("http.route", rule.rule)


def install(app: Flask) -> None:
    """Wrap the app (install it last: the outermost wrapper) and, with tracing on, name spans by route."""
    if tracing.ENABLED:
        app.before_request_funcs.setdefault(None, []).insert(0, _name_span)  # before the key check may refuse
    app.wsgi_app = RequestTracing(app.wsgi_app)  # type: ignore[method-assign]
