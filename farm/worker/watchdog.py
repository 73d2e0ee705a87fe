"""A worker's guard thread: orphan-queue sweeps and the consumer watchdog.

- `sweep_orphan_queues`: work queued on the direct queue `farm.w.<id>` of a worker that vanished (or is
  draining) is moved to the model's shared queue, so nothing waits for a worker that will never come.
- `WorkerGuard`: each worker's thread that sweeps, and probes its own Celery consumer with a ping task
  through its direct queue. Celery's Redis transport can reconnect after a Redis restart and then never
  consume again (celery/celery#8030, #8091, #9054, #10205); a worker whose pings stay unanswered while it
  has free task threads exits, its requests migrate, and its supervisor (farm up, Kubernetes) restarts it.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
import uuid
from typing import Any, Protocol

import redis

from farm.config import FarmConfig
from farm.protocol import PRIORITY_SEP, TASK_DECODE, TASK_GENERATE, TASK_PREFILL, queue_name
from farm.protocol.keys import SWEEP_LOCK_KEY, WORKERS_KEY, alive_key, ping_key

log = logging.getLogger(__name__)

DIRECT_PREFIX = "farm.w."
EXIT_STALLED = 75  # the worker's exit status when its consumer stalled (EX_TEMPFAIL: restart me)
_STAGE_OF_TASK = {TASK_PREFILL: "prefill", TASK_DECODE: "decode", TASK_GENERATE: "generate"}


class Guarded(Protocol):
    """What the guard reads of its worker (farm.worker.runtime.WorkerRuntime)."""

    worker_id: str
    cfg: FarmConfig
    r: redis.Redis

    def busy(self) -> bool: ...

    def send_ping(self, token: str) -> None: ...


def _worker_of_queue(key: str) -> str:
    return key[len(DIRECT_PREFIX):].split(PRIORITY_SEP, 1)[0]


def _target_queue(message: dict[str, Any]) -> str | None:
    """The model's shared queue for a generation task message (kombu's Redis envelope); None: drop it."""
    stage = _STAGE_OF_TASK.get((message.get("headers") or {}).get("task", ""))
    if stage is None:
        return None  # pings and anything unknown: only meaningful to the vanished worker
    body = message.get("body", "")
    if (message.get("properties") or {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args = json.loads(body)[0]
    return queue_name(args[0]["model"], stage)


def sweep_orphan_queues(r: redis.Redis) -> int:
    """Move messages waiting on the direct queues of vanished or draining workers to the shared queues;
    returns how many were moved. Re-sent work runs once: workers claim each stage (farm:claim)."""
    if not r.set(SWEEP_LOCK_KEY, os.getpid(), nx=True, ex=5):
        return 0  # another worker sweeps now
    routed = set()
    for wid in r.hkeys(WORKERS_KEY):
        routed.add(wid.decode() if isinstance(wid, bytes) else wid)
    moved = 0
    for raw_key in r.scan_iter(match=f"{DIRECT_PREFIX}*", count=500, _type="list"):
        key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
        wid = _worker_of_queue(key)
        if wid in routed and r.exists(alive_key(wid)):
            continue
        suffix = key[len(DIRECT_PREFIX) + len(wid):]  # the priority list suffix, if any
        while True:
            raw = r.rpop(key)  # kombu pushes left and pops right: oldest first
            if raw is None:
                break
            try:
                msg = json.loads(raw)
                target = _target_queue(msg)
            except (ValueError, KeyError, IndexError, TypeError):
                log.warning("sweep: dropping an unreadable message from %s", key)
                continue
            if target is None:
                continue
            msg.setdefault("properties", {}).setdefault("delivery_info", {})["routing_key"] = target
            r.lpush(target + suffix, json.dumps(msg))
            moved += 1
        if moved:
            log.warning("sweep: moved work queued for vanished worker %s to the shared queues", wid)
    return moved


class WorkerGuard(threading.Thread):
    """Per worker: sweep orphaned direct queues; probe this worker's Celery consumer, exit when it stalled."""

    def __init__(self, runtime: Guarded):
        super().__init__(name=f"guard-{runtime.worker_id}", daemon=True)
        self.rt = runtime
        self.cfg = runtime.cfg.reliability
        self._stop_evt = threading.Event()
        # warm shutdown: Celery has stopped consuming on purpose, so unanswered pings say nothing of a stall
        # (probing on would exit mid-drain, with the requests it waits for still running)
        self.draining = threading.Event()
        self._token: str | None = None
        self._sent_at = 0.0
        self.failures = 0
        self.exit = os._exit  # replaced in tests

    def run(self) -> None:
        next_sweep = next_probe = time.monotonic() + self.cfg.sweep_interval_s
        while not self._stop_evt.wait(0.5):
            now = time.monotonic()
            try:
                if now >= next_sweep:
                    next_sweep = now + self.cfg.sweep_interval_s
                    sweep_orphan_queues(self.rt.r)
                if now >= next_probe:
                    next_probe = self._probe(now)
            except redis.RedisError:
                self._token = None  # Redis down: a probe now tells nothing about the consumer
            except Exception:  # noqa: BLE001 - the guard must outlive any surprise
                log.exception("worker guard")

    def _probe(self, now: float) -> float:
        """One step of the watchdog; returns when to look again."""
        if self.draining.is_set():
            self._token = None
            return now + self.cfg.probe_interval_s
        r, wid = self.rt.r, self.rt.worker_id
        if self._token is not None:
            answered = (r.get(ping_key(wid)) or b"").decode() == self._token
            if answered:
                self.failures, self._token = 0, None
                return now + self.cfg.probe_interval_s
            if now - self._sent_at < self.cfg.probe_timeout_s:
                return now + 0.5
            self._token = None
            if self.rt.busy():
                self.failures = 0  # every task thread is taken: the ping waits its turn, no stall
            else:
                self.failures += 1
                log.warning("worker %s: consumer did not answer its ping within %.0fs (%d/%d)", wid,
                            self.cfg.probe_timeout_s, self.failures, self.cfg.probe_failures)
            if self.failures >= self.cfg.probe_failures:
                log.critical("worker %s: its Celery consumer stopped consuming (Redis reconnect stall); "
                             "exiting so it is restarted; its requests migrate", wid)
                self.exit(EXIT_STALLED)
                return now + self.cfg.probe_interval_s
        self._token = uuid.uuid4().hex
        self._sent_at = time.monotonic()
        self.rt.send_ping(self._token)
        return now + 0.5

    def stop(self) -> None:
        self._stop_evt.set()
