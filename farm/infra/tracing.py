"""OpenTelemetry traces of the farm's requests: one trace per request across the API, Celery, the workers and the
KV transfer, exported by OTLP over HTTP (protobuf).

Off unless the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; then
`setup` installs the SDK's tracer provider with a batch processor and the OTLP/HTTP exporter, which read the other
standard `OTEL_*` variables themselves (headers, timeouts, `OTEL_BSP_*`, `OTEL_TRACES_SAMPLER`). Off, no provider
is installed (the API's no-op tracer stays), and every caller on the request path checks `ENABLED` first, so a
request pays for nothing. `OTEL_SERVICE_NAME` names the process when set, else its kind does (farm-api,
farm-worker, farm-batch). `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep it off.

Trace context crosses processes as W3C `traceparent` in the Celery task's message headers (`inject` into the
headers `farm.infra.broker.send_generation` publishes, `extract` from the task's request on the worker), as
opentelemetry-instrumentation-celery carries it. It lives in contextvars, which gevent keeps per greenlet.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind

log = logging.getLogger(__name__)

ENABLED = False  # set once by `setup`; read by every caller before it does any tracing work
_tracer: trace.Tracer = trace.NoOpTracer()
_provider: Any = None  # the SDK's TracerProvider when ENABLED
_OFF: AbstractContextManager[None] = nullcontext()

INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER = (SpanKind.INTERNAL, SpanKind.SERVER, SpanKind.CLIENT,
                                                 SpanKind.PRODUCER, SpanKind.CONSUMER)


def configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the standard environment asks for OTLP traces."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup(service: str, **attributes: str) -> bool:
    """Install the tracer provider of this process (named `service` unless OTEL_SERVICE_NAME says otherwise;
    `attributes` go on its resource, e.g. the worker's id) when the environment asks for traces; True when on.
    Idempotent; a no-op (False) when the environment does not ask."""
    global ENABLED, _tracer, _provider
    if ENABLED:
        return True
    if not configured():
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs: dict[str, str] = {f"farm.{k}": v for k, v in attributes.items() if v}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attrs["service.name"] = service
    provider = TracerProvider(resource=Resource.create(attrs))  # its atexit hook flushes what is left
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer("farm")
    ENABLED = True
    log.info("tracing on: OTLP/HTTP traces of %s", provider.resource.attributes.get("service.name"))
    return True


def flush(timeout_ms: int = 5000) -> None:
    """Export the spans ended so far (a process about to stop)."""
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def tracer() -> trace.Tracer:
    return _tracer


def span(name: str, kind: SpanKind = INTERNAL, attributes: Mapping[str, Any] | None = None,
         context: otel_context.Context | None = None) -> AbstractContextManager[Any]:
    """`with tracing.span(...) as s:` a span made current for the block (s is None when tracing is off)."""
    if not ENABLED:
        return _OFF
    return _tracer.start_as_current_span(name, context=context, kind=kind, attributes=attributes)


def start_span(name: str, kind: SpanKind = INTERNAL, attributes: Mapping[str, Any] | None = None,
               context: otel_context.Context | None = None) -> Span | None:
    """A span the caller ends (one that outlives the block that starts it: an engine run, a response); None
    when tracing is off. Its parent is `context`'s span, else the current one."""
    if not ENABLED:
        return None
    return _tracer.start_span(name, context=context, kind=kind, attributes=attributes)


def current_span() -> Span:
    """The current span (a non-recording one when none is, or tracing is off)."""
    return trace.get_current_span()


def current_context() -> otel_context.Context | None:
    """The current context, to hand to another thread (None when tracing is off)."""
    return otel_context.get_current() if ENABLED else None


def context_of(s: Span) -> otel_context.Context:
    return trace.set_span_in_context(s)


def attach(ctx: otel_context.Context | None) -> object | None:
    """Make `ctx` current on this thread (a token for `detach`); None for None."""
    return otel_context.attach(ctx) if ctx is not None else None


def detach(token: object | None) -> None:
    if token is not None:
        otel_context.detach(token)  # type: ignore[arg-type]


def inject() -> dict[str, str] | None:
    """The current trace context as W3C headers (`traceparent`, `tracestate`), for a message; None when off."""
    if not ENABLED:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None


def extract(carrier: Mapping[str, Any]) -> otel_context.Context:
    """The trace context a message or request carries (an empty one when it carries none)."""
    return propagate.extract({k: v for k, v in carrier.items() if isinstance(v, str)})


def trace_id(s: Span | None = None) -> str:
    """The trace id (32 hex digits) of `s`, else of the current span; "" when tracing is off or none is current."""
    if not ENABLED:
        return ""
    sc = (s or trace.get_current_span()).get_span_context()
    return format(sc.trace_id, "032x") if sc.is_valid else ""


def record_error(s: Span, exc: BaseException) -> None:
    """Mark `s` failed by `exc` (with the exception as an event)."""
    s.record_exception(exc)
    mark_error(s, str(exc))


def mark_error(s: Span, message: str) -> None:
    """Mark `s` failed."""
    s.set_status(trace.Status(trace.StatusCode.ERROR, message[:200]))
