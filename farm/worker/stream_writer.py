"""Token streams from a worker to the readers (API processes, batch drivers) over Redis Streams, batched.

A request is `open`ed with its reader (`reply_to`) before its first event; `emit(request_id, event)` may then be
called from any thread. A pump thread flushes `flush_ms` after the first event that is not flushed yet (a linger, as
Kafka's producer has): per reader one XADD of a *reply batch* holding the events of all of that reader's requests
since the last flush (farm.protocol.stream_events), consecutive text deltas of a request merged, all readers in one
pipeline. Redis round trips therefore grow with readers and flushes, not with requests or tokens: a worker streaming
256 requests to one API process writes one entry per flush. Redis Streams keep order and never drop entries, and a
reader reads from its last seen id, so tokens are neither lost nor reordered. The first token of a request and its end
(done, error) are flushed at once (batching must not add to TTFT); its start lingers like a delta.

The same thread polls the cancel flags of the open requests and the leases of their readers (farm.protocol.keys):
a flag aborts its request (the client went away); a reader lease that stays missing for the request's grace
period means the API process that reads died, so nobody will ever read the tokens (no orphan work).

With nothing to flush and nothing open the pump sleeps until an event arrives: an idle worker costs no wakeups
(a fixed tick of `flush_ms` cost each idle worker about 6 ms of CPU a second, 50 wakeups).

Every batch carries (writer id, sequence number), both per reader (a reader idle for FORGET_READER_S is forgotten,
and numbered afresh under a new writer id should it return): a flush whose answer never came (Redis
restarting, or with Sentinel the primary died) is sent again, whole, and readers skip what they already have. A
batch Redis did not take, for any reason (unreachable, restarting, out of memory under `noeviction`, MISCONF, BUSY),
is kept and sent again, and a reader's later batches wait behind it: per attempt each reader gets only its oldest
batch not yet taken, so a reader never sees a batch after a later one nor a hole. Only a batch nobody could still be
waiting for (older than the reply streams' TTL) is ever given up. With
`replica_ack_ms` each flush also waits (WAIT) until a replica holds it, so a failover cannot lose events a reader
has not seen; a primary that refuses writes for want of a replica (NOREPLICAS, redis.ha.min_replicas_max_lag_s)
is waited out like an unreachable one (farm.infra.redis_client raises it as a ConnectionError).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from farm.protocol import (
    EVENT_FIELD,
    STREAM_TTL_S,
    Event,
    cancel_key,
    encode_reply,
    reader_lease_key,
    reply_stream_key,
)

log = logging.getLogger(__name__)
NO_REPLICA_RETRY_S = 5.0  # after a WAIT no replica answered, flushes do not wait for this long
# One flush() tries this many times before it hands back to the pump (which polls flags, then flushes again): about
# 25 s when Redis refuses connections (a restart), up to redis.socket's timeout per attempt when nothing answers (a
# partition). The batches stay queued either way.
FLUSH_ATTEMPTS = 30
GIVE_UP_S = STREAM_TTL_S  # a batch this old has no reader left waiting for it (their requests timed out)
# A reader this writer sent nothing to for this long, with no request open, loses its numbering: a long-lived
# worker would otherwise keep one per API process life it ever answered (gunicorn recycles its workers). Should
# the reader come back, it is numbered again from 1 under a new writer id, so it skips nothing as already seen.
FORGET_READER_S = 2 * STREAM_TTL_S
MIN_POLL_S = 0.005  # the pump never wakes for flag polls more often than this


@dataclass(slots=True)
class _Route:
    """Where one open request's events go, and how long its reader's lease may be missing."""

    reply_to: str
    grace_s: float  # 0: the request has no reader lease (never orphaned)
    streaming: bool = False  # its first token was sent (later deltas wait for the flush window)


@dataclass(slots=True)
class _Numbering:
    """One reader's batches from this writer: the writer id they carry and their sequence numbers."""

    writer: str
    seq: itertools.count = field(default_factory=lambda: itertools.count(1))
    used: float = 0.0  # monotonic time of its last batch


class StreamWriter:
    def __init__(self, r: redis.Redis, flush_ms: float = 20.0, on_cancel: Callable[[str], None] | None = None,
                 cancel_poll_s: float = 0.2, replica_ack_ms: int = 0):
        self.r = r
        self.replica_ack_ms = replica_ack_ms
        self._no_replica_until = 0.0  # WAIT found no replica: do not wait for one again before this
        self.flush_s = max(flush_ms, 1.0) / 1000.0
        self.on_cancel = on_cancel
        self.cancel_poll_s = cancel_poll_s
        self._routes: dict[str, _Route] = {}  # open requests
        self._pending: dict[str, dict[str, list[dict[str, Any]]]] = {}  # reader -> request -> events
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one flush at a time: a reader skips sequence numbers it has seen
        self._wake = threading.Event()
        self._urgent = False  # flush at once (set with the wake)
        self._due = 0.0  # monotonic time the oldest unflushed event must be flushed by (0: nothing pending)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-writer", daemon=True)
        self._last_cancel_poll = 0.0
        self._lease_missing: dict[str, float] = {}  # reader -> when its lease was first seen missing
        self.writer_id = uuid.uuid4().hex[:12]
        self._numbering: dict[str, _Numbering] = {}  # reader -> its batches' writer id and numbers, 1, 2, ...
        self._generations = itertools.count(1)  # a reader numbered again gets the next writer id
        # reply stream key -> [(payload, made at)] that Redis has not taken yet, oldest first
        self._unsent: dict[str, list[tuple[str, float]]] = {}

    def start(self) -> StreamWriter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self.flush()

    # -- requests ----------------------------------------------------------------------------------------
    def open(self, request_id: str, reply_to: str, lease_grace_s: float = 0.0) -> None:
        """Route `request_id`'s events to reader `reply_to`; with a grace, abort the request once that reader's
        lease has been missing for that long. A request without a reader (`reply_to` "") emits nothing."""
        with self._lock:
            self._routes[request_id] = _Route(reply_to, lease_grace_s)

    def close(self, request_id: str) -> None:
        """The request ended (its last event was emitted): stop polling its flags. Idempotent."""
        with self._lock:
            self._routes.pop(request_id, None)

    def open_ids(self) -> list[str]:
        with self._lock:
            return list(self._routes)

    def emit(self, request_id: str, event: Event | dict[str, Any], urgent: bool = False) -> None:
        """Queue one event of an open request (typed, or its wire dict)."""
        ev = event if isinstance(event, dict) else event.to_dict()
        kind = ev["type"]
        with self._lock:
            route = self._routes.get(request_id)
            if route is None or not route.reply_to:
                return  # closed (its reader gave up) or nobody reads it
            q = self._pending.setdefault(route.reply_to, {}).setdefault(request_id, [])
            if kind == "delta" and q and q[-1]["type"] == "delta" and ("lp" in q[-1]) == ("lp" in ev):
                last = q[-1]
                last["text"] += ev["text"]
                last["n"] += ev["n"]
                for key in ("ids", "lp"):  # token ids and their log-probabilities stay aligned
                    if key in ev:
                        last[key] = last[key] + ev[key]  # never extend the caller's list in place
            else:
                q.append(ev)
            if kind == "delta" and not route.streaming:
                route.streaming = True
                urgent = True  # the first token goes out at once: batching must not add to TTFT
            # an end (done, error) goes at once; a start waits for the first token or the linger, whichever is first:
            # it names the workers for the response's headers, and flushed alone it cost a flush per request
            urgent = urgent or kind not in ("delta", "start")
            first = not self._due  # the first unflushed event: the linger starts now
            if first:
                self._due = time.monotonic() + self.flush_s
            self._urgent = self._urgent or urgent
        if urgent or first:
            self._wake.set()

    def emit_once(self, request_id: str, reply_to: str, event: Event) -> None:
        """One event for a request that is not open (a refused task's error), flushed soon."""
        self.open(request_id, reply_to)
        self.emit(request_id, event, urgent=True)
        self.close(request_id)

    # -- the pump --------------------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Send what is pending, behind whatever Redis has not taken yet. False when something is still unsent
        after FLUSH_ATTEMPTS (it stays queued, in order, for the next flush)."""
        with self._flush_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
                self._due, self._urgent = 0.0, False
            now = time.monotonic()
            for reader, events in pending.items():
                numbering = self._numbering.get(reader)
                if numbering is None:
                    numbering = self._numbering[reader] = _Numbering(f"{self.writer_id}.{next(self._generations)}")
                numbering.used = now
                self._unsent.setdefault(reply_stream_key(reader), []).append(
                    (encode_reply(numbering.writer, next(numbering.seq), events), now))
            self._forget_idle_readers(now)
            return self._send_unsent()

    def _forget_idle_readers(self, now: float) -> None:
        """Drop the numbering of readers idle for FORGET_READER_S with no request open and nothing unsent."""
        cutoff = now - FORGET_READER_S
        if not any(n.used < cutoff for n in self._numbering.values()):
            return
        with self._lock:
            busy = {rt.reply_to for rt in self._routes.values()}
        for reader in [x for x, n in self._numbering.items() if n.used < cutoff]:
            if reader not in busy and reply_stream_key(reader) not in self._unsent:
                del self._numbering[reader]

    def readers_numbered(self) -> int:
        """Readers whose batches this writer still numbers."""
        return len(self._numbering)

    def unsent(self) -> int:
        """Batches Redis has not taken yet."""
        return sum(len(q) for q in self._unsent.values())

    def _send_unsent(self) -> bool:
        failures, failure = 0, None
        while True:
            self._give_up_stale()
            if not self._unsent:
                if failures:
                    log.info("stream writer: Redis takes events again")
                return True
            try:
                self._write_oldest()
                continue  # what was taken is gone from the queue; the rest (a reader's later batches) at once
            except redis.RedisError as e:  # a timed-out attempt may have landed: readers skip what they have
                failure = e
            failures += 1
            if failures == 1:
                log.warning("stream writer: Redis refused events (%s: %s); keeping them and retrying",
                            type(failure).__name__, failure)
            if failures >= FLUSH_ATTEMPTS:
                log.error("stream writer: %d event batches wait for Redis (%s); kept, retrying", self.unsent(),
                          type(failure).__name__)
                return False
            time.sleep(min(0.1 * failures, 1.0))

    def _write_oldest(self) -> None:
        """One pipeline: each reader's oldest unsent batch (XADD, and its stream's TTL refreshed). A reader's next
        batch goes only once this one was taken, so none overtakes an earlier one. Raises a RedisError when the
        pipeline failed as a whole, or the first refusal of a reader's batch after the others were taken."""
        keys = list(self._unsent)
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.xadd(key, {EVENT_FIELD: self._unsent[key][0][0]})
            pipe.expire(key, STREAM_TTL_S)
        wait = self.replica_ack_ms > 0 and time.monotonic() >= self._no_replica_until
        if wait:
            pipe.execute_command("WAIT", 1, self.replica_ack_ms)
        replies = pipe.execute(raise_on_error=False)
        refused: BaseException | None = None
        for i, key in enumerate(keys):
            if isinstance(replies[2 * i], Exception):  # out of memory, MISCONF, ...: this reader's batch stays
                refused = replies[2 * i]
                continue
            queue = self._unsent[key]
            queue.pop(0)
            if not queue:
                del self._unsent[key]
        if wait and not isinstance(replies[-1], Exception) and not replies[-1]:  # no replica holds them
            self._no_replica_until = time.monotonic() + NO_REPLICA_RETRY_S
            log.warning("stream writer: no replica acknowledged within %d ms; a failover now could lose "
                        "tokens not yet read (checking again in %.0f s)", self.replica_ack_ms, NO_REPLICA_RETRY_S)
        if refused is not None:
            raise refused

    def _give_up_stale(self) -> None:
        """Drop batches older than GIVE_UP_S: every request they belong to has timed out at its reader."""
        cutoff = time.monotonic() - GIVE_UP_S
        for key in list(self._unsent):
            queue = self._unsent[key]
            stale = sum(1 for _, made in queue if made < cutoff)
            if stale:
                log.error("stream writer: giving up %d event batches for %s, unsent for %d s", stale, key,
                          GIVE_UP_S)
                del queue[:stale]
                if not queue:
                    del self._unsent[key]

    def _poll_flags(self) -> None:
        """Abort open requests whose cancel flag is set or whose reader's lease stayed missing past its grace."""
        if self.on_cancel is None:
            return
        now = time.monotonic()
        if now - self._last_cancel_poll < self.cancel_poll_s:
            return
        self._last_cancel_poll = now
        with self._lock:
            routes = list(self._routes.items())
        if not routes:
            self._lease_missing.clear()
            return
        readers = sorted({rt.reply_to for _, rt in routes if rt.grace_s > 0})
        flags = self.r.mget([cancel_key(rid) for rid, _ in routes] + [reader_lease_key(x) for x in readers])
        cancelled = {rid for (rid, _), flag in zip(routes, flags[:len(routes)], strict=True) if flag is not None}
        orphaned: set[str] = set()
        for reader, lease in zip(readers, flags[len(routes):], strict=True):
            if lease is not None:
                self._lease_missing.pop(reader, None)
                continue
            since = self._lease_missing.setdefault(reader, now)
            grace = min(rt.grace_s for _, rt in routes if rt.reply_to == reader and rt.grace_s > 0)
            if now - since >= grace:
                orphaned.add(reader)
                log.warning("reader %s: its lease lapsed (the API process died?); aborting its requests", reader)
        for reader in [x for x in self._lease_missing if x not in readers]:
            del self._lease_missing[reader]
        for rid, rt in routes:
            if rid in cancelled or rt.reply_to in orphaned:
                self.on_cancel(rid)

    def _timeout(self, now: float) -> float | None:
        """How long the pump may sleep: until the pending batch is due, or the next flag poll while requests are
        open; None (until woken) when there is neither."""
        with self._lock:
            if self._urgent:
                return 0.0
            due = self._due or (now + 1.0 if self._unsent else None)  # unsent batches: tried again each second
            if self._routes and self.on_cancel is not None:
                poll = self._last_cancel_poll + max(self.cancel_poll_s, MIN_POLL_S)
                due = poll if due is None else min(due, poll)
        return None if due is None else max(0.0, due - now)

    def _run(self) -> None:
        while not self._stop.is_set():
            timeout = self._timeout(time.monotonic())
            if timeout is None or timeout > 0:
                self._wake.wait(timeout)
            self._wake.clear()
            try:
                with self._lock:
                    ready = self._urgent or (self._due and time.monotonic() >= self._due)
                if ready or self._unsent:
                    self.flush()
                self._poll_flags()
            except redis.RedisError:
                log.warning("stream writer: Redis error", exc_info=True)
                time.sleep(0.5)
