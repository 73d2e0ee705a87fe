"""Small Redis writes from many requests, sent together: one pipeline per short window instead of a round trip
each.

A request through the API writes a few things nobody waits for: its load contributions (placed, prefilled,
done: farm.router.load) and its observation for the planner. Each was a round trip of its own, and on the
machines measured a round trip costs 50-150 us of the API's CPU (redis-py, and the send and receive system
calls), several per request. `PipelineBatcher.submit(job)` queues a job (a function that adds commands to a
pipeline, and optionally one that takes their replies); a writer thread sends whatever has queued every
`window_s` in one pipeline, in the order submitted, so a request's later write never overtakes its earlier one.
Under gevent the thread is a greenlet and the wait cooperative.

Writes are retried while Redis restarts (up to `retry_s`), then dropped with a warning: every caller's write
here is repaired by something else when lost (load contributions have deadlines the reaper ends; an observation
is a sample).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Job:
    """Commands to add to the pipeline (`add(pipe)`, returns how many it added) and what to do with their
    replies (`done(replies)`, a command's error in its place; `done(None)` when they could not be sent)."""

    add: Callable[[Any], int]
    done: Callable[[list[Any] | None], None] | None = None


class PipelineBatcher:
    def __init__(self, r: redis.Redis, window_s: float = 0.002, retry_s: float = 10.0, name: str = "redis-batch"):
        self.r = r
        self.window_s = window_s
        self.retry_s = retry_s
        self._jobs: deque[Job] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self._lock = threading.Lock()
        self.sent = self.dropped = 0

    def submit(self, job: Job) -> None:
        if not self._started:
            with self._lock:
                if not self._started:
                    self._thread.start()
                    self._started = True
        self._jobs.append(job)
        self._wake.set()

    def flush(self) -> None:
        """Send what has queued now, in this thread (tests, shutdown)."""
        self._send(self._take())

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._started:
            self._thread.join(timeout=5)
        self.flush()

    def _take(self) -> list[Job]:
        jobs = []
        while True:
            try:
                jobs.append(self._jobs.popleft())
            except IndexError:
                return jobs

    def _send(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        deadline = time.monotonic() + self.retry_s
        while True:
            pipe = self.r.pipeline(transaction=False)
            counts = [job.add(pipe) for job in jobs]
            try:
                replies = pipe.execute(raise_on_error=False)
                break
            except (redis.ConnectionError, redis.TimeoutError):
                if time.monotonic() >= deadline or self._stop.is_set():
                    self.dropped += len(jobs)
                    log.warning("dropping %d queued Redis writes: Redis unreachable", len(jobs))
                    for job in jobs:
                        if job.done is not None:
                            self._settle(job, None)
                    return
                time.sleep(0.25)
        self.sent += len(jobs)
        at = 0
        for job, n in zip(jobs, counts, strict=True):
            if job.done is not None:  # replies as they came, errors included (the job knows what to do with one)
                self._settle(job, replies[at:at + n])
            at += n

    @staticmethod
    def _settle(job: Job, replies: list[Any] | None) -> None:
        try:
            job.done(replies)  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - one job's surprise must not keep the others' replies from them
            log.exception("Redis batch reply handler")

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self.window_s:
                time.sleep(self.window_s)  # let the requests of this moment join the pipeline
            try:
                self._send(self._take())
            except Exception:  # noqa: BLE001 - the writer must outlive any surprise
                log.exception("Redis batch writer")
