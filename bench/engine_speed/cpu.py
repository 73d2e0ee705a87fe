"""CPU seconds by kind of process over a measured window, for the processes this bench started only.

Like bench/peers/cpu.py (two snapshots around the window, no sampling thread), with two differences that
this bench needs: only this process and its descendants count (the machine is shared: another farm, test
suite or Redis running beside the bench must not land in the contender's column), and vLLM's engine core
(`VLLM::EngineCore`, the scheduler) and its model executor (`VLLM::Worker`) are separate kinds. Children
this process reaps inside the window (py-spy under --profile) are their own kind, never the client's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil

ENGINE_CORE = "vLLM engine core"
EXECUTOR = "vLLM model executor"
VLLM_API = "vllm serve API"
FARM_API = "farm API"
FARM_WORKER = "farm worker process"
FARM_BATCH = "farm batch driver"
REDIS = "Redis"
CLIENT = "client (this process)"
REAPED = "reaped children (py-spy)"
OTHER = "other descendants"
MACHINE_OTHERS = "not this bench (whole machine)"  # busy CPU of every process on the machine minus this bench's

# (substring of the process name or command line, kind): first match wins
KINDS: tuple[tuple[str, str], ...] = (
    ("EngineCore", ENGINE_CORE),
    ("VLLM::Worker", EXECUTOR),
    ("vllm.entrypoints.openai.api_server", VLLM_API),
    ("celeryd: batch-", FARM_BATCH),  # Celery's process title of a batch driver, if it has one
    ("tasks.batch", FARM_BATCH),
    ("tasks.worker", FARM_WORKER),
    ("[celeryd:", FARM_WORKER),  # a worker once Celery has set its process title
    ("gunicorn", FARM_API),
    ("redis-server", REDIS),
    ("py-spy", "py-spy (running)"),
)
# kinds that are a server's own work (what "CPU per output token" of a contender adds up)
SERVER_KINDS = (FARM_API, FARM_WORKER, FARM_BATCH, ENGINE_CORE, EXECUTOR, VLLM_API, REDIS)


def kind_of(p: psutil.Process) -> str:
    try:
        text = p.name() + " " + " ".join(p.cmdline())
    except (psutil.Error, OSError):
        return OTHER
    return next((kind for needle, kind in KINDS if needle in text), OTHER)


def descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _snapshot() -> dict[tuple[int, float], tuple[str, float]]:
    me = psutil.Process()
    t = me.cpu_times()
    out = {(me.pid, -1.0): (CLIENT, t.user + t.system),
           (me.pid, -2.0): (REAPED, t.children_user + t.children_system)}
    for p in descendants():
        try:
            kind = kind_of(p)
            t = p.cpu_times()
            out[(p.pid, p.create_time())] = (kind, t.user + t.system)
        except (psutil.Error, OSError):
            continue
    return out


def _machine_busy() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


@contextmanager
def cpu_by_kind() -> Iterator[dict[str, float]]:
    """Yields a dict that holds {kind: CPU seconds} once the block ends, and under MACHINE_OTHERS the busy CPU
    seconds of everything else on the machine meanwhile (other users' work: the noise in this window)."""
    result: dict[str, float] = {}
    before, busy0 = _snapshot(), _machine_busy()
    yield result
    after, busy1 = _snapshot(), _machine_busy()
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


def summary(cpu: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in cpu.items() if v)
