"""The retention sweep: final batches, their results and their output and error files are deleted
`batch.retention_s` after they ended, so Redis (and the files directory) hold what clients may still fetch,
not every batch ever run; and uploads whose `expires_after` passed are deleted (one a batch still reads waits
for that batch to end). Run by every driver process's reaper thread; deletes are idempotent, so drivers
sweeping at once do no harm."""

from __future__ import annotations

import logging
import time

from farm.batch.file_store import FileStore
from farm.batch.store import BatchStore

log = logging.getLogger(__name__)


def sweep(store: BatchStore, files: FileStore, retention_s: float, now: float | None = None) -> int:
    """Delete every batch that ended more than `retention_s` ago, with its output and error files; returns
    how many. The input file is the client's (OpenAI keeps it until the client deletes it)."""
    cutoff = (time.time() if now is None else now) - retention_s
    n = 0
    while ids := store.ended_before(cutoff):
        for bid in ids:
            b = store.get(bid) or {}
            for fid in (b.get("output_file_id"), b.get("error_file_id")):
                if fid:
                    files.delete(fid)
            store.forget(bid)
            n += 1
    if n:
        log.info("batch retention: %d batches older than %ds deleted", n, retention_s)
    return n + sweep_expired_uploads(store, files, now)


def sweep_expired_uploads(store: BatchStore, files: FileStore, now: float | None = None) -> int:
    """Delete the uploads whose `expires_after` has passed, but those an unfinished batch reads (read once per
    sweep, and paged past: they stay first in line until their batch ends); returns how many."""
    busy = store.active_inputs()
    now = time.time() if now is None else now
    n = skipped = 0
    while ids := files.expired(now, start=skipped):
        for fid in ids:
            if fid in busy:
                skipped += 1
            else:
                n += files.delete(fid)
    if n:
        log.info("files: %d uploads past their expires_after deleted", n)
    return n
