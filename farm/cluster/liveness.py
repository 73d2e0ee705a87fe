"""Whether a worker is gone: the gateway asks it of the workers serving its requests, to migrate them.

A worker is gone when its heartbeat lapsed (farm.cluster.registry), when its id was registered again by a process
that started later (the supervisor restarted it, possibly before the heartbeat could lapse: the one the request
depends on is dead all the same, on any host), or, on this host, when its process no longer runs (seconds earlier
than the heartbeat TTL).
"""

from __future__ import annotations

import socket

import psutil
import redis

from farm.cluster import registry
from farm.infra.process_identity import same_process
from farm.protocol.keys import WORKERS_KEY, alive_key

_HOST = socket.gethostname()


# A worker's process: its id and the start time of the process (WorkerInfo.started_at); None: whichever process is
# registered under the id now. A restart keeps the id and changes the start time.
Process = tuple[str, float | None]


def process_of(worker_id: str, info: registry.WorkerInfo | None) -> Process:
    return worker_id, info.started_at if info is not None else None


def processes_gone(r: redis.Redis, processes: dict[Process, registry.WorkerInfo | None],
                   beats: bool = True) -> set[Process]:
    """The dead among `processes` (each with its record as the caller knows it, or None), in one round trip.
    `beats` False: a missing heartbeat alone does not make a worker dead (the caller could not reach Redis
    lately either, so every heartbeat may have lapsed for want of Redis, not of the worker)."""
    ids = sorted({wid for wid, _ in processes})
    pipe = r.pipeline(transaction=False)
    pipe.mget([alive_key(w) for w in ids])
    pipe.hmget(WORKERS_KEY, ids)
    found, records = pipe.execute()
    beat = dict(zip(ids, found, strict=True))
    now = {w: registry.WorkerInfo.from_json(raw) if raw else None for w, raw in zip(ids, records, strict=True)}
    gone = set()
    for proc, known in processes.items():
        wid = proc[0]
        known = known or now[wid]
        if (beats and beat[wid] is None) or _process_gone(known) or _replaced(known, now[wid]):
            gone.add(proc)
    return gone


def _replaced(known: registry.WorkerInfo | None, now: registry.WorkerInfo | None) -> bool:
    """Whether the id's registered process is a later one than the process the caller depends on."""
    return known is not None and now is not None and now.started_at > known.started_at


def _process_gone(info: registry.WorkerInfo | None) -> bool:
    """On this host, whether the worker's process no longer runs (or its pid now belongs to another process)."""
    if info is None or info.hostname != _HOST or info.pid <= 0:
        return False
    if info.since_boot:
        return not same_process(info.pid, info.since_boot)
    try:  # a record without its start since boot: a process started after the record was made is another one
        return psutil.Process(info.pid).create_time() > info.started_at + 1.0
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
