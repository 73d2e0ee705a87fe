"""Generation tasks. Each is a few lines: check the JSON message (untrusted: anything that can write to
Redis can send one) and hand it to the worker runtime, which puts it in the engine and returns (the task thread
does not wait for the generation: farm.worker.runtime)."""

from __future__ import annotations

from typing import Any

from farm.protocol import TASK_DECODE, TASK_GENERATE, TASK_PING, TASK_PREFILL, TASK_RELEASE_KV
from farm.worker.runtime import get_runtime
from tasks.celery_app import app


@app.task(name=TASK_PREFILL, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def prefill(request: dict[str, Any]) -> None:
    rt = get_runtime()
    with rt.task():
        if (req := rt.accept(request)) is not None:
            rt.run(req, lambda: rt.prefill(req))


@app.task(name=TASK_DECODE, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def decode(request: dict[str, Any], handle: dict[str, Any] | None) -> None:
    rt = get_runtime()
    with rt.task():
        if (req := rt.accept(request, handle)) is not None:
            rt.run(req, lambda: rt.decode(req, handle))


@app.task(name=TASK_GENERATE, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def generate(request: dict[str, Any]) -> None:
    rt = get_runtime()
    with rt.task():
        if (req := rt.accept(request)) is not None:
            rt.run(req, lambda: rt.generate(req))


@app.task(name=TASK_PING, ignore_result=True)
def ping(worker_id: str, token: str) -> None:
    """The consumer watchdog's probe (farm.worker.watchdog): answering proves this worker still consumes."""
    rt = get_runtime()
    if rt.worker_id == worker_id:
        rt.pong(token)


@app.task(name=TASK_RELEASE_KV, ignore_result=True)
def release_kv(handle: Any) -> None:
    """A decode worker will not pull this handle's blocks (farm.worker.runtime: its request was cancelled, or the
    pull failed): this prefill worker frees them now rather than when the handle expires."""
    get_runtime().release_unpulled(handle)
