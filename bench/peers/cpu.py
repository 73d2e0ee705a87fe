"""Where the CPU goes while a contender serves: CPU seconds of every process on the machine, by kind, between
two snapshots taken around the measured window (no sampling thread, so nothing is added to the run).

A process that exists at both snapshots counts its difference; one that started inside the window counts all
of its time; one that ended inside it is missed, except this process's own children (aiperf), whose time the
kernel adds to this process's `children_*` times when they are reaped: the client is this process and those.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil

# (substring of the process name or command line, kind), first match wins
KINDS: tuple[tuple[str, str], ...] = (
    ("EngineCore", "vLLM engine"),  # vLLM's engine core process, and its model executor below
    ("VLLM::Worker", "vLLM engine"),
    ("vllm.entrypoints.openai.api_server", "vllm serve (API process)"),
    ("vllm-router", "vllm-router"),
    ("vllm::router", "vllm-router"),  # the same process once it has set its own title
    ("dynamo.frontend", "Dynamo frontend"),
    ("dynamo.vllm", "Dynamo worker (Python side)"),
    ("tasks.worker", "farm worker (Python side)"),
    ("[celeryd:", "farm worker (Python side)"),  # the same process once Celery has set its process title
    ("gunicorn", "farm API"),
    ("redis-server", "Redis"),
)
CLIENT = "client (this process, and aiperf's processes once they exit)"


def _kind(p: psutil.Process) -> str | None:
    try:
        text = p.name() + " " + " ".join(p.cmdline())
    except (psutil.Error, OSError):
        return None
    return next((kind for needle, kind in KINDS if needle in text), None)


def _snapshot() -> dict[tuple[int, float], tuple[str, float]]:
    me = psutil.Process()
    t = me.cpu_times()
    out = {(me.pid, me.create_time()): (CLIENT, t.user + t.system + t.children_user + t.children_system)}
    for p in psutil.process_iter():
        if p.pid == me.pid:
            continue
        try:
            kind = _kind(p)
            if kind is None:
                continue
            t = p.cpu_times()
            out[(p.pid, p.create_time())] = (kind, t.user + t.system)
        except (psutil.Error, OSError):
            continue
    return out


@contextmanager
def cpu_by_kind() -> Iterator[dict[str, Any]]:
    """Yields a dict that holds {kind: CPU seconds} once the block ends."""
    result: dict[str, Any] = {}
    before = _snapshot()
    yield result
    after = _snapshot()
    totals: dict[str, float] = defaultdict(float)
    for key, (kind, cpu) in after.items():
        totals[kind] += cpu - before[key][1] if key in before else cpu
    result.update({k: round(v, 2) for k, v in sorted(totals.items())})
