"""Where the CPU goes while a contender serves: CPU seconds by kind of process between two snapshots taken
around the measured window (no sampling thread, so nothing is added to the run).

Two scopes:
- `descendants` (bench.engine_speed): only this process and its descendants count, so another farm, test
  suite or Redis running beside the bench stays out of the contender's column; anything else on the machine
  is reported as MACHINE_OTHERS, the noise of the window.
- `machine` (bench.peers, bench.goodput): every process of a known kind on the machine, because the
  contenders there (a detached farm, vllm-router, Dynamo) are not all this process's children.

A process that exists at both snapshots counts its difference; one that started inside the window counts all
of its time; one that ended inside it is missed, except this process's own children (aiperf, py-spy), whose
time the kernel adds to this process's `children_*` times when they are reaped: REAPED, never the client's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import psutil

ENGINE_CORE = "vLLM engine core"
EXECUTOR = "vLLM model executor"
VLLM_API = "vllm serve API"
VLLM_ROUTER = "vllm-router"
DYNAMO_FRONTEND = "Dynamo frontend"
DYNAMO_WORKER = "Dynamo worker (Python side)"
FARM_API = "farm API"
FARM_WORKER = "farm worker process"
FARM_BATCH = "farm batch driver"
REDIS = "Redis"
CLIENT = "client (this process)"
REAPED = "reaped children (aiperf, py-spy)"
OTHER = "other descendants"
MACHINE_OTHERS = "not this bench (whole machine)"  # busy CPU of every process on the machine minus this bench's

# (substring of the process name or command line, kind): first match wins
KINDS: tuple[tuple[str, str], ...] = (
    ("EngineCore", ENGINE_CORE),  # vLLM's scheduler process
    ("VLLM::Worker", EXECUTOR),  # and its model executor
    ("vllm.entrypoints.openai.api_server", VLLM_API),
    ("vllm-router", VLLM_ROUTER),
    ("vllm::router", VLLM_ROUTER),  # the same process once it has set its own title
    ("dynamo.frontend", DYNAMO_FRONTEND),
    ("dynamo.vllm", DYNAMO_WORKER),
    ("celeryd: batch-", FARM_BATCH),  # Celery's process title of a batch driver, if it has one
    ("tasks.batch", FARM_BATCH),
    ("tasks.worker", FARM_WORKER),
    ("[celeryd:", FARM_WORKER),  # a worker once Celery has set its process title
    ("gunicorn", FARM_API),
    ("redis-server", REDIS),
    ("py-spy", "py-spy (running)"),
)
# kinds that are a server's own work (what "CPU per output token" of a contender adds up)
SERVER_KINDS = (FARM_API, FARM_WORKER, FARM_BATCH, ENGINE_CORE, EXECUTOR, VLLM_API, VLLM_ROUTER, DYNAMO_FRONTEND,
                DYNAMO_WORKER, REDIS)
Scope = Literal["descendants", "machine"]


def kind_of(p: psutil.Process) -> str | None:
    """The process's kind, None when it is of no kind in KINDS (or gone)."""
    try:
        text = p.name() + " " + " ".join(p.cmdline())
    except (psutil.Error, OSError):
        return None
    return next((kind for needle, kind in KINDS if needle in text), None)


def descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _snapshot(scope: Scope) -> dict[tuple[int, float], tuple[str, float]]:
    me = psutil.Process()
    t = me.cpu_times()
    out = {(me.pid, -1.0): (CLIENT, t.user + t.system),
           (me.pid, -2.0): (REAPED, t.children_user + t.children_system)}
    procs = descendants() if scope == "descendants" else [p for p in psutil.process_iter() if p.pid != me.pid]
    for p in procs:
        kind = kind_of(p)
        if kind is None:
            if scope == "machine":
                continue
            kind = OTHER
        try:
            t = p.cpu_times()
            out[(p.pid, p.create_time())] = (kind, t.user + t.system)
        except (psutil.Error, OSError):
            continue
    return out


def _machine_busy() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


@contextmanager
def cpu_by_kind(scope: Scope = "descendants") -> Iterator[dict[str, float]]:
    """Yields a dict that holds {kind: CPU seconds} once the block ends, and under MACHINE_OTHERS the busy CPU
    seconds of every other process on the machine meanwhile (with scope `machine`: those of no known kind)."""
    result: dict[str, float] = {}
    before, busy0 = _snapshot(scope), _machine_busy()
    yield result
    after, busy1 = _snapshot(scope), _machine_busy()
    totals: dict[str, float] = defaultdict(float)
    for key, (kind, cpu) in after.items():
        totals[kind] += cpu - before[key][1] if key in before else cpu
    result.update({k: round(v, 3) for k, v in sorted(totals.items()) if v > 0 or k in SERVER_KINDS})
    result[MACHINE_OTHERS] = round(max(0.0, busy1 - busy0 - sum(totals.values())), 3)


def server_cpu(cpu: dict[str, float]) -> float:
    """CPU seconds of the server's processes (everything but the client, py-spy and strays)."""
    return sum(v for k, v in cpu.items() if k in SERVER_KINDS)


def processes_of(kind: str) -> list[psutil.Process]:
    """This bench's live processes of one kind."""
    return [p for p in descendants() if kind_of(p) == kind]


def cpu_seconds(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except (psutil.Error, OSError):
        return 0.0


def summary(cpu: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in cpu.items() if v)
