"""A driver's lease on the batch it runs (farm.protocol.keys.batch_lease_key): taken in `BatchDriver.drive`,
refreshed here while the batch runs; a driver that lost it stops, and the reaper of a live driver re-sends a
batch whose lease lapsed."""

from __future__ import annotations

import logging
import threading
import time

import redis

from farm.batch.store import BatchStore

log = logging.getLogger(__name__)


class LeaseKeeper(threading.Thread):
    """Refreshes the driver's lease on a batch; `lost` once it could not for a whole TTL."""

    def __init__(self, store: BatchStore, batch_id: str, token: str, ttl_s: float):
        super().__init__(name=f"lease-{batch_id[-8:]}", daemon=True)
        self.store, self.batch_id, self.token, self.ttl_s = store, batch_id, token, ttl_s
        self.lost = False
        self._stop_evt = threading.Event()

    def run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop_evt.wait(self.ttl_s / 3):
            try:
                if not self.store.refresh_lease(self.batch_id, self.token, self.ttl_s):
                    log.warning("batch %s: lease lost (another driver owns it now)", self.batch_id)
                    self.lost = True
                    return
                last_ok = time.monotonic()
            except redis.RedisError:
                if time.monotonic() - last_ok > self.ttl_s:
                    self.lost = True
                    return

    def stop(self) -> None:
        self._stop_evt.set()
