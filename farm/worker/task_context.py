"""What a generation task's thread knows about its request while the task runs: the request's id and model in
its log lines (farm.infra.logcontext) and, with tracing on, the task's consumer span, a child of the trace context
the message carries in its headers (W3C `traceparent`, put there by farm.infra.broker.send_generation).

Celery's `task_prerun` and `task_postrun` run on the task's own thread around its body (and around Celery's own
"succeeded"/"failed" lines), as opentelemetry-instrumentation-celery uses them, so the span is current for
everything the runtime does for the task (admission, KV pull, engine submission) and nothing outlives the task.
The runtime's own spans (the request in the engine, the KV pull) are built here too, so the runtime only calls them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from celery.signals import task_postrun, task_prerun

from farm.engine.contract import RequestOutput
from farm.infra import logcontext, tracing
from farm.protocol import TASK_DECODE, TASK_GENERATE, TASK_PREFILL, GenerationRequest

_TASKS = frozenset({TASK_PREFILL, TASK_DECODE, TASK_GENERATE})
_OFF: AbstractContextManager[None] = nullcontext()
_active: dict[str, tuple[Any, object | None]] = {}  # task id -> (its span, the context token to detach)


def _prerun(task_id: str | None = None, task: Any = None, args: Any = None, **_: Any) -> None:
    name = getattr(task, "name", None)
    if name not in _TASKS:
        return
    msg = args[0] if args and isinstance(args[0], dict) else {}
    rid, model = msg.get("request_id"), msg.get("model")
    logcontext.clear()
    logcontext.bind(request_id=rid[:256] if isinstance(rid, str) else None,
                    model=model[:256] if isinstance(model, str) else None)
    if not tracing.ENABLED or task_id is None:
        return
    req = getattr(task, "request", None)
    parent = tracing.extract({k: getattr(req, k, None) for k in ("traceparent", "tracestate")})
    span = tracing.start_span(name, tracing.CONSUMER, {
        "messaging.system": "celery", "messaging.operation.type": "process", "celery.task_id": task_id,
        "farm.request_id": rid if isinstance(rid, str) else "", "farm.model": model if isinstance(model, str) else "",
    }, context=parent)
    if span is None:
        return
    _active[task_id] = (span, tracing.attach(tracing.context_of(span)))
    logcontext.bind(trace_id=tracing.trace_id(span))


def _postrun(task_id: str | None = None, task: Any = None, state: str | None = None, **_: Any) -> None:
    if getattr(task, "name", None) not in _TASKS:
        return
    entry = _active.pop(task_id, None) if task_id is not None else None
    if entry is not None:
        span, token = entry
        tracing.detach(token)
        if state:
            span.set_attribute("celery.state", state)
        span.end()
    logcontext.clear()  # this thread's next lines (its next task's "received", a ping) are not this request's


def install() -> None:
    """Connect the hooks (a worker process, once; idempotent)."""
    task_prerun.connect(_prerun, weak=False, dispatch_uid="farm.task_context.prerun")
    task_postrun.connect(_postrun, weak=False, dispatch_uid="farm.task_context.postrun")


# -- the runtime's spans (called only with tracing on) ------------------------------------------------------------
def engine_span(req: GenerationRequest, role: str, worker_id: str) -> Any:
    """The request's time in the engine, a child of the task's span: started at admission, its first token an
    event, ended with its last output (`end_engine_span`, on the engine's thread: the task returned long before)."""
    return tracing.start_span("farm.engine", attributes={
        "farm.request_id": req.request_id, "farm.role": role, "farm.worker": worker_id,
        "farm.prompt_tokens": len(req.prompt_token_ids)})


def end_engine_span(span: Any, out: RequestOutput) -> None:
    """End a request's engine span with what the engine says of it."""
    span.set_attributes({"farm.finish_reason": out.finish_reason or "", "farm.completion_tokens": out.completion_tokens,
                         "farm.cached_tokens": out.cached_tokens})
    if (out.finish_reason or "").startswith("error:"):
        tracing.mark_error(span, (out.finish_reason or "")[6:])
    span.end()


def pull_span(handle: dict[str, Any], info: dict[str, Any]) -> AbstractContextManager[None]:
    """A span around a KV pull (a failure recorded on it by the SDK); `info`, as the transport filled it, becomes
    its attributes (transport, bytes, seconds). Nothing with tracing off."""
    return _pull_span(handle, info) if tracing.ENABLED else _OFF


@contextmanager
def _pull_span(handle: dict[str, Any], info: dict[str, Any]) -> Iterator[None]:
    with tracing.span("farm.kv.pull", tracing.CLIENT, {
            "farm.request_id": str(handle.get("request_id", "")), "farm.prefill_worker": str(handle.get("worker_id")),
            "farm.kv.blocks": len(handle.get("block_ids") or []), "server.address": str(handle.get("endpoint"))},
    ) as span:
        yield
        span.set_attributes({f"farm.kv.{k}": v for k, v in info.items() if isinstance(v, (str, int, float))})
