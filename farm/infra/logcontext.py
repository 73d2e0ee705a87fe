"""Per-request fields of a process's log lines (request id, model, worker, trace id), kept in contextvars.

Why contextvars: the API serves each connection on a greenlet of its own (gevent gives every greenlet its own
context), workers run each task on a thread of their own, so a field bound while serving one request never shows
in another request's lines. `farm.infra.logfiles.JsonFormatter` puts the non-empty ones into every JSON line.
A process that serves one model as one worker (a farm worker) sets those once, as process fields.
"""

from __future__ import annotations

from contextvars import ContextVar

FIELDS = ("request_id", "model", "worker", "trace_id")
_VARS: dict[str, ContextVar[str]] = {name: ContextVar(f"farm_log_{name}", default="") for name in FIELDS}
_process: dict[str, str] = {}  # fields of the whole process (a worker's id and model), overridden per context


def set_process_fields(**fields: str) -> None:
    """Fields every line of this process carries unless its context binds another value (a worker's id, model)."""
    _process.update({k: v for k, v in fields.items() if k in _VARS and v})


def bind(**fields: str | None) -> None:
    """Bind the given fields (request_id, model, worker, trace_id) in the current context; None leaves one as is."""
    for name, value in fields.items():
        if value is not None:
            _VARS[name].set(value)


def clear() -> None:
    """Forget the fields of the request served before in this context (a keep-alive connection's next request,
    a task thread's next task)."""
    for var in _VARS.values():
        var.set("")


def fields() -> dict[str, str]:
    """The non-empty fields of the current context, over the process's own."""
    out = dict(_process)
    for name, var in _VARS.items():
        value = var.get()
        if value:
            out[name] = value
    return out
