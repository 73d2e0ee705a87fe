"""Worker side of the KV-block index: publish what happens to the worker's KV blocks.

The block pool reports `stored` / `removed` / `cleared` with chained block hashes; this publisher
buffers them and flushes in batches. Each flush is one Redis transaction that appends the batch to the
shared event stream and applies it to the worker's snapshot set, with the last event id, so a router can
start from a consistent snapshot and then follow the stream. Event ids are monotonic per worker; a
reader that sees a gap resyncs that worker from its set. A (re)starting worker begins with `cleared`.

The flush thread sleeps until an event arrives, then lingers `flush_ms` to gather the step's others: an idle
worker costs no wakeups. The event and its wire form are farm.protocol.kv_events.KVEvent; `epoch` changes when the
worker process restarts (ids start again at 1).
"""

from __future__ import annotations

import json
import logging
import threading
import time

import redis

from farm.protocol.keys import (
    EVENTS_KEEP_S,
    EVENTS_MAXLEN,
    EVENTS_STREAM,
    stream_min_id,
    worker_blocks_key,
    worker_seq_key,
)
from farm.protocol.kv_events import KVEvent, KVEventKind
from farm.router.index import member

log = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(self, r: redis.Redis, worker_id: str, flush_ms: float = 50.0, tier: str = "device"):
        self.r = r
        self.worker_id = worker_id
        self.flush_s = flush_ms / 1000.0
        self.tier = tier
        self._buf: list[KVEvent] = []
        self._lock = threading.Lock()
        self._next_id = 1
        self.epoch = time.time_ns()  # a new incarnation of the worker: readers reset its view
        self._stop = threading.Event()
        self._pending = threading.Event()  # set when the buffer gets its first event since the last flush
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.published = 0

    def __call__(self, kind: KVEventKind | str, hashes: list[int], parent: int | None,
                 tier: str | None = None) -> None:
        """The engines' KV event hook (farm.protocol.kv_events.KVEventHook), on the engine thread: buffer only,
        never block."""
        with self._lock:
            self._buf.append(KVEvent(self.worker_id, self.epoch, self._next_id, KVEventKind(kind), list(hashes),
                                     parent, tier or self.tier))
            self._next_id += 1
            first = len(self._buf) == 1
        if first:
            self._pending.set()

    def start(self) -> KVEventPublisher:
        self(KVEventKind.CLEARED, [], None)  # a (re)started worker holds nothing
        self.flush()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._pending.set()
        self._thread.join(timeout=5)
        try:
            self.flush()
        except redis.RedisError:
            pass

    def flush(self) -> None:
        with self._lock:
            batch, self._buf = self._buf, []
        if not batch:
            return
        for attempt in range(20):
            try:  # a failed execute() clears the pipeline's commands: built again for each attempt
                self._pipeline(batch).execute()
                self.published += sum(len(e.blocks) for e in batch)
                return
            except (redis.ConnectionError, redis.TimeoutError):  # restarting, or unreachable (a partition)
                time.sleep(min(0.1 * (attempt + 1), 1.0))
        with self._lock:  # Redis unreachable: keep the events, in order, for the next flush
            self._buf = batch + self._buf
        log.error("KV events for %s not published yet: Redis unreachable", self.worker_id)

    def _pipeline(self, batch: list[KVEvent]) -> redis.client.Pipeline:
        """One transaction: the worker's block set, its sequence key and the batch on the events stream."""
        pipe = self.r.pipeline(transaction=True)
        bkey = worker_blocks_key(self.worker_id)
        for ev in batch:
            if ev.kind is KVEventKind.CLEARED:
                pipe.delete(bkey)
            elif ev.kind is KVEventKind.STORED and ev.blocks:
                pipe.sadd(bkey, *(member(h, ev.tier) for h in ev.blocks))
            elif ev.kind is KVEventKind.REMOVED and ev.blocks:
                pipe.srem(bkey, *(member(h, ev.tier) for h in ev.blocks))
        pipe.set(worker_seq_key(self.worker_id), f"{self.epoch}:{batch[-1].event_id}")
        pipe.xadd(EVENTS_STREAM, {"w": self.worker_id, "d": json.dumps([ev.to_dict() for ev in batch])},
                  maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.xtrim(EVENTS_STREAM, minid=stream_min_id(EVENTS_KEEP_S), approximate=True)
        return pipe

    def _run(self) -> None:
        while not self._stop.is_set():
            self._pending.wait()
            if self._stop.wait(self.flush_s):  # the linger: one batch for the events of the next few steps
                return
            self._pending.clear()  # before taking the buffer: an event after this wakes the next round
            try:
                self.flush()
            except redis.RedisError:
                log.warning("KV event flush failed", exc_info=True)
            with self._lock:
                if self._buf:  # kept after Redis was unreachable: try again after the next linger
                    self._pending.set()
