"""Token streams from workers to the API over Redis Streams, batched.

Workers call `emit(request_id, event)` from any thread; a pump thread flushes every `flush_ms` with one
pipeline for all requests (XADD + EXPIRE), merging consecutive text deltas of a request. Redis Streams
keep order and never drop entries, and the API reads them with XREAD from its last seen id, so tokens
are neither lost nor reordered, and Redis round trips do not scale with tokens. The same thread polls
the cancel keys of the worker's active requests and aborts those whose client went away, and the
leases of leased requests (farm.protocol.lease_key): a lease that stays missing for its grace period
means the API that read the request died, so nobody will ever read the tokens (no orphan work).

With Redis Sentinel (`replica_ack_ms`), each flush also waits (WAIT) until a replica holds its events, so a
failover cannot lose events a reader has not seen: a flush whose answer never came (the primary died) is
sent again, whole, to the new primary, and readers skip what they already have (writer, sequence).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from farm.protocol import EVENT_FIELD, STREAM_TTL_S, cancel_key, lease_key, stream_key

log = logging.getLogger(__name__)
NO_REPLICA_RETRY_S = 5.0  # after a WAIT no replica answered, flushes do not wait for this long


class StreamWriter:
    def __init__(self, r: redis.Redis, flush_ms: float = 20.0,
                 active_ids: Callable[[], list[str]] | None = None,
                 on_cancel: Callable[[str], None] | None = None, cancel_poll_s: float = 0.2,
                 replica_ack_ms: int = 0):
        self.r = r
        self.replica_ack_ms = replica_ack_ms
        self._no_replica_until = 0.0  # WAIT found no replica: do not wait for one again before this
        self.flush_s = max(flush_ms, 1.0) / 1000.0
        self.active_ids = active_ids
        self.on_cancel = on_cancel
        self.cancel_poll_s = cancel_poll_s
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._streaming: set[str] = set()  # requests whose first token was already sent
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-writer", daemon=True)
        self._last_cancel_poll = 0.0
        self._leases: dict[str, float] = {}  # request id -> grace (s) a missing lease is tolerated
        self._lease_missing: dict[str, float] = {}  # request id -> when its lease was first seen missing
        self.writer_id = uuid.uuid4().hex[:12]  # events carry (writer_id, sequence) so repeats are skipped
        self._seq = itertools.count(1)  # next() is atomic under the GIL: flush may run on two threads

    def start(self) -> StreamWriter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self.flush()

    def watch_lease(self, request_id: str, grace_s: float) -> None:
        """Abort `request_id` once its lease has been missing for `grace_s` (its reader died)."""
        with self._lock:
            self._leases[request_id] = grace_s

    def unwatch_lease(self, request_id: str) -> None:
        with self._lock:
            self._leases.pop(request_id, None)
            self._lease_missing.pop(request_id, None)

    def emit(self, request_id: str, event: dict[str, Any], urgent: bool = False) -> None:
        kind = event.get("type")
        with self._lock:
            q = self._pending.setdefault(request_id, [])
            if kind == "delta" and q and q[-1].get("type") == "delta" and ("lp" in q[-1]) == ("lp" in event):
                q[-1]["text"] += event["text"]
                q[-1]["n"] += event["n"]
                for key in ("ids", "lp"):  # token ids and their log-probabilities stay aligned
                    if key in event:
                        q[-1].setdefault(key, []).extend(event[key])
            else:
                q.append(event)
            if kind == "delta" and q[-1] is event:
                for key in ("ids", "lp"):  # merged into later: never alias the caller's lists
                    if key in event:
                        event[key] = list(event[key])
            if kind == "delta" and request_id not in self._streaming:
                self._streaming.add(request_id)
                urgent = True  # the first token goes out at once: batching must not add to TTFT
            elif kind in ("done", "error"):
                self._streaming.discard(request_id)
        if urgent or kind != "delta":
            self._wake.set()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        # Each event carries (writer, sequence): a retry after a connection error may repeat events that
        # reached Redis before it dropped, and the reader skips what it has seen (Submission). The
        # pipeline is rebuilt per attempt (a failed execute() clears its commands).
        batch: list[tuple[str, list[str]]] = []
        for rid, events in pending.items():
            payloads = []
            for ev in events:
                payloads.append(json.dumps({**ev, "w": self.writer_id, "s": next(self._seq)}))
            batch.append((stream_key(rid), payloads))
        for attempt in range(30):
            pipe = self.r.pipeline(transaction=False)
            for key, payloads in batch:
                for payload in payloads:
                    pipe.xadd(key, {EVENT_FIELD: payload})
                pipe.expire(key, STREAM_TTL_S)
            wait = self.replica_ack_ms > 0 and time.monotonic() >= self._no_replica_until
            if wait:
                pipe.execute_command("WAIT", 1, self.replica_ack_ms)
            try:
                replies = pipe.execute()
                if wait and not replies[-1]:  # no replica holds them (none connected, or far behind)
                    self._no_replica_until = time.monotonic() + NO_REPLICA_RETRY_S
                    log.warning("stream writer: no replica acknowledged within %d ms; a failover now could lose "
                                "tokens not yet read (checking again in %.0f s)", self.replica_ack_ms,
                                NO_REPLICA_RETRY_S)
                return
            except redis.ConnectionError:
                time.sleep(min(0.1 * (attempt + 1), 1.0))  # Redis restarting: keep the tokens
        log.error("dropping stream events for %d requests: Redis unreachable", len(pending))

    def _poll_cancels(self) -> None:
        if not (self.active_ids and self.on_cancel):
            return
        now = time.monotonic()
        if now - self._last_cancel_poll < self.cancel_poll_s:
            return
        self._last_cancel_poll = now
        ids = self.active_ids()
        if not ids:
            return
        with self._lock:
            leased = [(i, self._leases[i]) for i in ids if i in self._leases]
        flags = self.r.mget([cancel_key(i) for i in ids] + [lease_key(i) for i, _ in leased])
        for rid, flag in zip(ids, flags[:len(ids)], strict=True):
            if flag is not None:
                self.on_cancel(rid)
        for (rid, grace), lease in zip(leased, flags[len(ids):], strict=True):
            if lease is not None:
                self._lease_missing.pop(rid, None)
                continue
            since = self._lease_missing.setdefault(rid, now)
            if now - since >= grace:
                log.warning("request %s: its reader's lease lapsed (the API died?); aborting it", rid)
                self.unwatch_lease(rid)
                self.on_cancel(rid)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_s)
            self._wake.clear()
            try:
                self.flush()
                self._poll_cancels()
            except redis.RedisError:
                log.warning("stream writer: Redis error", exc_info=True)
                time.sleep(0.5)
