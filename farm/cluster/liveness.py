"""Whether a worker is gone: the gateway asks it of the workers serving its requests, to migrate them.

A worker is gone when its heartbeat lapsed (farm.cluster.registry) or, on this host, its process no longer runs
(seconds earlier than the heartbeat TTL).
"""

from __future__ import annotations

import socket

import psutil
import redis

from farm.cluster import registry
from farm.protocol.keys import WORKERS_KEY, alive_key

_HOST = socket.gethostname()


def worker_gone(r: redis.Redis, worker_id: str, info: registry.WorkerInfo | None = None) -> bool:
    """Whether `worker_id` is dead: heartbeat lapsed, or (same host) its process is gone or is another one."""
    if not r.exists(alive_key(worker_id)):
        return True
    if info is None:
        raw = r.hget(WORKERS_KEY, worker_id)
        info = registry.WorkerInfo.from_json(raw) if raw else None
    return _process_gone(info)


def workers_gone(r: redis.Redis, workers: dict[str, registry.WorkerInfo | None]) -> set[str]:
    """`worker_gone` for many workers in one round trip (their records as the caller knows them)."""
    ids = list(workers)
    beats = r.mget([alive_key(w) for w in ids])
    return {w for w, beat in zip(ids, beats, strict=True) if beat is None or _process_gone(workers[w])}


def _process_gone(info: registry.WorkerInfo | None) -> bool:
    """On this host, whether the worker's process no longer runs (or its pid now belongs to another process)."""
    if info is None or info.hostname != _HOST or info.pid <= 0:
        return False
    try:
        return psutil.Process(info.pid).create_time() > info.started_at + 1.0  # a reused pid
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
