"""The consumer watchdog during a warm shutdown: Celery stops consuming on purpose, so the worker's unanswered
pings must not make it exit while the requests it drains are still running (they would migrate, and the
worker would exit 75 instead of cleanly; seen in tests/test_planner_local.py's ramp-down)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from farm.config import FarmConfig, load_config
from farm.worker.watchdog import EXIT_STALLED, WorkerGuard


@dataclass
class _Worker:
    """A worker whose consumer never answers its pings (the `Guarded` side the guard reads)."""

    r: redis.Redis
    cfg: FarmConfig
    worker_id: str = "guard-test@host"
    pings: list[str] = field(default_factory=list)

    def busy(self) -> bool:
        return False

    def send_ping(self, token: str) -> None:
        self.pings.append(token)


def _exits_after_probing(guard: WorkerGuard, rounds: int) -> list[int]:
    exits: list[int] = []
    guard.exit = exits.append
    for _ in range(rounds):
        guard._probe(time.monotonic() + 3600)  # every ping long past its timeout
    return exits


def test_unanswered_pings_exit_a_serving_worker_but_not_a_draining_one(redis_client):
    cfg = load_config(environ={})
    cfg.reliability.probe_failures = 2

    serving = WorkerGuard(_Worker(redis_client, cfg))
    assert EXIT_STALLED in _exits_after_probing(serving, 6)  # the stall is still caught

    worker = _Worker(redis_client, cfg)
    draining = WorkerGuard(worker)
    draining._probe(time.monotonic())  # a ping went out before the shutdown began
    draining.draining.set()
    assert _exits_after_probing(draining, 6) == []
    assert len(worker.pings) == 1  # and no new ping is sent to a consumer that stopped on purpose
