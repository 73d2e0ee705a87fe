"""Handing batches to drivers: `send_to_driver` puts a batch on the driver queue (`farm.batch`) once, and the
reaper of every driver process re-sends the active batches no live driver holds (its driver died: the lease
lapsed), so another driver (or the same one, restarted) resumes them from Redis; the same thread runs the retention
sweep (farm.batch.retention)."""

from __future__ import annotations

import logging
import threading
import time

from farm.batch import retention
from farm.batch.file_store import FileStore
from farm.batch.store import BatchStore
from farm.config.batch import BatchConfig
from farm.protocol import BATCH_QUEUE, TASK_BATCH_DRIVE

log = logging.getLogger(__name__)
SWEEP_EVERY_S = 60.0  # the retention sweep's period (retention itself is days by default)


def send_to_driver(celery_app, store: BatchStore, batch_id: str, bcfg: BatchConfig, force: bool = False) -> bool:
    """Put the batch on the driver queue, unless it was put there within `kick_ttl_s` (or `force`)."""
    if not store.mark_kicked(batch_id, bcfg.kick_ttl_s, force=force):
        return False
    celery_app.send_task(TASK_BATCH_DRIVE, args=[batch_id], queue=BATCH_QUEUE)
    return True


def reap(celery_app, store: BatchStore, bcfg: BatchConfig) -> int:
    """Send active batches without a live driver to the driver queue; returns how many."""
    n = 0
    for bid in store.active_ids():
        if not store.leased(bid) and send_to_driver(celery_app, store, bid, bcfg):
            log.info("batch %s has no driver: re-sent to %s", bid, BATCH_QUEUE)
            n += 1
    return n


def start_reaper(celery_app, store: BatchStore, bcfg: BatchConfig, stopping: threading.Event,
                 files: FileStore | None = None) -> threading.Thread:
    """The reaper thread: `reap` every `reaper_interval_s` until `stopping` is set; with `files`, also the
    retention sweep (farm.batch.retention) once a minute."""

    def loop() -> None:
        next_sweep = 0.0
        while not stopping.wait(bcfg.reaper_interval_s):
            try:
                reap(celery_app, store, bcfg)
                if files is not None and time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + SWEEP_EVERY_S
                    retention.sweep(store, files, bcfg.retention_s)
            except Exception:  # noqa: BLE001 - Redis down or the like: try again next round
                log.exception("batch reaper")

    thread = threading.Thread(target=loop, name="batch-reaper", daemon=True)
    thread.start()
    return thread
