"""How much of the farm a driver process's batch lines may take (farm.batch.driver explains why the driver is the
throttle): `LoadWatch` sizes the window of lines in flight from the farm's interactive load and `Slots` counts the
lines in flight against it; every line's task goes out with the batch's low message priority (batch.priority, the
driver's TaskPublisher)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from prometheus_client import Gauge

from farm.config.batch import BatchConfig

# A batch driver's own (its --metrics-port serves them): registered where a driver runs, not in the API, which
# exported them as a constant 0
BATCH_INFLIGHT = Gauge("farm_batch_inflight_lines", "Batch lines in flight in this batch-driver process")
BATCH_WINDOW = Gauge("farm_batch_window_lines",
                     "Batch lines a driver may have in flight now (small while interactive requests run)")


class LoadWatch:
    """The window of batch lines this process may have in flight, from the farm's interactive load: the farm's
    shared load (`loads`, the router's view of `farm:load`) minus the batch lines in flight farm-wide
    (`batch_inflight`)."""

    def __init__(self, bcfg: BatchConfig, loads: Callable[[], dict[str, dict[str, Any]]],
                 batch_inflight: Callable[[], int]):
        self.bcfg = bcfg
        self.loads = loads
        self.batch_inflight = batch_inflight
        self.interactive = 0
        self._next = 0.0
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def window(self) -> int:
        now = time.monotonic()
        with self._lock:
            if now >= self._next:
                self._next = now + self.bcfg.load_check_s
                try:
                    loads = self.loads()
                    total = sum(v.get("dn", 0) for v in loads.values())
                    self.interactive = max(0, total - self.batch_inflight())
                except redis.RedisError:
                    pass
                if self.interactive >= self.bcfg.interactive_threshold:
                    self._busy_until = now + self.bcfg.interactive_hold_s
            size = self.bcfg.min_inflight if now < self._busy_until else self.bcfg.max_inflight
        BATCH_WINDOW.set(size)
        return size


class Slots:
    """The lines this process has in flight (every batch it drives together), within the window `load` allows."""

    def __init__(self, load: LoadWatch):
        self.load = load
        self.inflight = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        window = self.load.window()
        with self._lock:
            if self.inflight >= window:
                return False
            self.inflight += 1
            BATCH_INFLIGHT.set(self.inflight)
            return True

    def release(self) -> None:
        with self._lock:
            self.inflight -= 1
            BATCH_INFLIGHT.set(self.inflight)
