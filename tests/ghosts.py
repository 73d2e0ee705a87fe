"""Workers that exist only in the registry: the test plays their part (takes their tasks, or never does).

A registration's heartbeat lapses after `registry.HEARTBEAT_TTL_S`; a test that runs past it on a slow machine
would see its worker declared lost (503 no workers, or its request migrated). `ghost_alive` keeps the heartbeat
up every second, as a worker's own thread does, and takes the worker and its queue away at the end, so later
tests on the session's Redis never see it.

A ghost is one process for the whole session: each registration gives it the start time of its first. Registered
again with a later start, it would look restarted (farm.cluster.liveness) to a request placed from a router's view
of the workers taken before (refreshed about every second): one test right after another saw its worker "lost" at
the first check, and its request re-placed on a ghost that answers nothing more.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import redis

from farm.cluster import registry
from farm.protocol.queues import direct_queue

_STARTED: dict[str, float] = {}  # each ghost's one start time


@contextlib.contextmanager
def ghost_alive(redis_client: redis.Redis, worker_id: str, model: str, block_size: int) -> Iterator[None]:
    """`worker_id` registered as a live worker of `model` (1,000 KV blocks) until the block ends."""
    registry.register(redis_client, registry.WorkerInfo(worker_id, "both", model, "h", 1, block_size, num_blocks=1000,
                                                        started_at=_STARTED.setdefault(worker_id, time.time())))
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(1.0):
            registry.heartbeat(redis_client, worker_id)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        yield
    finally:
        stop.set()
        beating.join(5)
        registry.deregister(redis_client, worker_id)
        redis_client.delete(direct_queue(worker_id))
