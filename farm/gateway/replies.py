"""The reading side of the reply streams: one `ReplyReader` per process follows the process's own reply stream
and hands each request's typed events to that request's `Mailbox`.

Every request a process submits names the process's reader (`GenerationRequest.reply_to`); workers write the
events of all of a reader's requests into its stream, one entry per flush (farm.worker.stream_writer). So one XREAD
here serves every request in flight, however many: the API process does not hold a Redis connection per open stream,
and Redis round trips grow with flushes, not with requests or tokens.

The reader also keeps what every request of the process would otherwise ask Redis for on its own:
- its lease (`reader_lease_key`), refreshed every quarter of `reliability.lease_ttl_s`: workers abort the
  requests of a reader whose lease lapsed (the process died, nobody reads);
- which of the workers serving its requests are gone (`gone`), refreshed every `reliability.check_interval_s`
  in one round trip (farm.cluster.liveness.processes_gone), for the requests' migration; by process, so a worker
  restarted under its id is alive for the requests placed on it and gone for those of the process that died.
  For a heartbeat's lifetime after the reader itself could not reach Redis, a lapsed heartbeat alone does not
  count: the workers could not beat either (a 35 s outage had every request migrated, and computed twice). Nor
  after the wall clock stepped forward (a resumed virtual machine, NTP): Redis expires keys by the wall clock, so
  the step lapses every heartbeat at once, the live workers' too.

It reads from the last entry id it saw, so a Redis restart loses nothing it has not read (the workers retry their
flushes) and a batch written twice (a retried flush) is skipped by its writer's sequence number. Entries it has
read are trimmed from the stream; the stream and the lease expire once the reader is gone.

Threads: the reader is a thread, and a mailbox a deque with an Event. Under the API's gevent worker both are
cooperative (the standard library is monkey-patched); in the batch driver they are real threads.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections import deque

import redis

from farm.cluster import registry
from farm.cluster.liveness import Process, process_of, processes_gone
from farm.config.processes import ReliabilityConfig
from farm.protocol import (
    EVENT_FIELD,
    DeltaEvent,
    ErrorEvent,
    Event,
    ReplyBatch,
    StartEvent,
    decode_reply,
    reader_lease_key,
    reply_stream_key,
)

log = logging.getLogger(__name__)

READ_COUNT = 1024  # entries per XREAD: one per worker flush, each holding many requests' events
TRIM_EVERY_S = 1.0
SEEN_WRITERS_MAX = 4096  # writer sequence numbers remembered (a writer is a worker process's life)
CLOCK_STEP_S = 1.0  # the wall clock gaining this much on the monotonic one between two loops is a step


class Mailbox:
    """The events of one request attempt, put by the reader, taken by whoever reads the request; `first_delta_at`
    and `last_delta_at` are when its first and its latest tokens arrived (monotonic), whenever they are read: a
    response reads its choices one after another, and a choice's time to first token or between tokens is not the
    time its turn came."""

    __slots__ = ("_events", "_ready", "first_delta_at", "last_delta_at")

    def __init__(self) -> None:
        self._events: deque[Event] = deque()
        self._ready = threading.Event()
        self.first_delta_at: float | None = None
        self.last_delta_at: float | None = None

    def put(self, events: list[Event]) -> None:
        if any(isinstance(e, DeltaEvent) for e in events):
            self.last_delta_at = time.monotonic()
            if self.first_delta_at is None:
                self.first_delta_at = self.last_delta_at
        self._events.extend(events)
        self._ready.set()

    def take(self, timeout: float) -> list[Event]:
        """What arrived since the last take, waiting up to `timeout` seconds for something."""
        if not self._events:
            self._ready.wait(timeout)
        self._ready.clear()
        out = []
        while True:  # popleft one at a time: a put from another thread meanwhile is kept, never lost
            try:
                out.append(self._events.popleft())
            except IndexError:
                return out


def new_reader_id(kind: str) -> str:
    """`<kind>-<host>-<pid>-<random>`: unique per process life, and a valid id on the wire."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64]
    return f"{kind}-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ReplyReader:
    """Follows one reply stream for a process; `open` a mailbox before the request's task is sent."""

    def __init__(self, r: redis.Redis, rcfg: ReliabilityConfig, kind: str = "api"):
        self.r = r
        self.rcfg = rcfg
        self.reader_id = new_reader_id(kind)
        self.stream = reply_stream_key(self.reader_id)
        self.lease_key = reader_lease_key(self.reader_id)
        self.lease_ttl_s = rcfg.lease_ttl_s
        self._boxes: dict[str, Mailbox] = {}
        self._seen: dict[str, int] = {}  # writer -> last sequence number read
        self._writer_of: dict[str, str] = {}  # open request -> the writer that sent it events last
        # the worker processes requests depend on -> (their record, how many requests): a worker restarted under its
        # id is another process, watched apart from the one that died
        self._watched: dict[Process, tuple[registry.WorkerInfo | None, int]] = {}
        self._gone: frozenset[Process] = frozenset()  # the watched processes found dead at the last check
        # after this reader could not reach Redis, a missing heartbeat proves nothing until the workers had a
        # heartbeat's lifetime to beat again: monotonic time from which it counts again
        self._beats_count_from = 0.0
        self._wall = time.time  # the wall clock Redis expires keys by (a test steps it)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0  # batches that were not reply batches (logged)

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> ReplyReader:
        """Take the lease now (a worker may check it as soon as a task is sent), then follow the stream."""
        with self._lock:
            if self._thread is not None:
                return self
            self._renew_lease()
            self._thread = threading.Thread(target=self._run, name=f"replies-{self.reader_id}", daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.r.delete(self.stream, self.lease_key)
        except redis.RedisError:
            pass  # both expire

    # -- requests ----------------------------------------------------------------------------------------
    def open(self, attempt_id: str) -> Mailbox:
        box = Mailbox()
        self._boxes[attempt_id] = box
        return box

    def close(self, attempt_id: str) -> None:
        self._boxes.pop(attempt_id, None)
        self._writer_of.pop(attempt_id, None)

    def watch(self, worker_id: str, info: registry.WorkerInfo | None) -> Process:
        """Keep the liveness of `worker_id`'s process (the one `info` describes; None: whichever runs under the id)
        current while a request depends on it; returns the key to `unwatch` and ask `gone` with."""
        proc = process_of(worker_id, info)
        with self._lock:
            old, n = self._watched.get(proc, (None, 0))
            self._watched[proc] = (info or old, n + 1)
        return proc

    def unwatch(self, proc: Process) -> None:
        with self._lock:
            info, n = self._watched.get(proc, (None, 0))
            if n <= 1:
                self._watched.pop(proc, None)
            else:
                self._watched[proc] = (info, n - 1)

    def gone(self, proc: Process) -> bool:
        """Whether a watched process was found dead at the last check (at most `check_interval_s` ago)."""
        return proc in self._gone

    # -- the reader thread -------------------------------------------------------------------------------
    def _renew_lease(self) -> None:
        self.r.set(self.lease_key, "1", ex=max(1, math.ceil(self.lease_ttl_s)))

    def _check_workers(self) -> None:
        with self._lock:
            watched = {proc: info for proc, (info, _) in self._watched.items()}
        beats = time.monotonic() >= self._beats_count_from
        self._gone = frozenset(processes_gone(self.r, watched, beats)) if watched else frozenset()

    def _run(self) -> None:
        last_id = "0-0"
        trimmed = last_id
        next_lease = next_check = next_trim = 0.0
        wall_lead = self._wall() - time.monotonic()
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                wall_lead = self._after_clock_step(wall_lead, now)
                if now >= next_lease:
                    try:
                        self._renew_lease()
                        next_lease = now + self.lease_ttl_s / 4
                    except redis.ResponseError as e:  # a write refused (out of memory, MISCONF): keep reading,
                        log.warning("reply reader %s: lease not renewed: %s", self.reader_id, e)  # tokens still come
                        next_lease = now + 0.25
                if now >= next_check:
                    self._check_workers()
                    next_check = now + self.rcfg.check_interval_s
                if now >= next_trim and last_id != trimmed:
                    self.r.xtrim(self.stream, minid=last_id, approximate=False)
                    trimmed, next_trim = last_id, now + TRIM_EVERY_S
                block_ms = int(min(max(min(next_lease, next_check) - time.monotonic(), 0.001), 1.0) * 1000) or 1
                resp = self.r.xread({self.stream: last_id}, count=READ_COUNT, block=block_ms)
            except (redis.ConnectionError, redis.TimeoutError):
                # every worker's heartbeat may lapse while Redis is away: none counts until they could beat again
                self._beats_count_from = time.monotonic() + registry.HEARTBEAT_TTL_S
                time.sleep(0.25)  # Redis restarting: the workers keep their batches until it is back
                continue
            except redis.RedisError:
                log.warning("reply reader %s: Redis error", self.reader_id, exc_info=True)
                time.sleep(0.25)
                continue
            for _key, entries in resp or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    self._deliver(fields.get(EVENT_FIELD.encode()) or fields.get(EVENT_FIELD))

    def _after_clock_step(self, wall_lead: float, now: float) -> float:
        """Heartbeats judged again only a heartbeat's lifetime after the wall clock stepped forward (every key with
        a TTL lapsed at once in Redis); returns the wall clock's lead over the monotonic one now."""
        lead = self._wall() - now
        if lead - wall_lead > CLOCK_STEP_S:
            log.warning("reply reader %s: the wall clock stepped %.1f s forward: heartbeats count again in %d s",
                        self.reader_id, lead - wall_lead, registry.HEARTBEAT_TTL_S)
            self._beats_count_from = now + registry.HEARTBEAT_TTL_S
        return lead

    def _deliver(self, raw: bytes | str | None) -> None:
        try:
            batch = decode_reply(raw or b"")
        except ValueError as e:
            self.dropped += 1
            log.warning("reply reader %s: dropped an entry that is not a reply batch: %s", self.reader_id, e)
            return
        last = self._seen.get(batch.writer, 0)
        if batch.seq <= last:
            return  # a flush retried after a connection error: read already
        if self._seen.pop(batch.writer, None) is None and len(self._seen) >= SEEN_WRITERS_MAX:
            self._seen.pop(next(iter(self._seen)))  # the writer heard from longest ago (each read moves to the end)
        self._seen[batch.writer] = batch.seq
        if last and batch.seq > last + 1:  # numbered per reader with no gap: batches were lost on the way
            self._fail_lost(batch, batch.seq - last - 1)
        for rid, events in batch.events.items():
            box = self._boxes.get(rid)
            if box is not None:  # else: finished, cancelled or migrated away; its events are moot
                self._writer_of[rid] = batch.writer
                box.put(events)

    def _fail_lost(self, batch: ReplyBatch, missing: int) -> None:
        """A writer's batches `missing` before this one never arrived (Redis lost them: a restart without the
        last second of its AOF, or a writer that gave them up): the open requests that writer fed last, and any in
        this batch that does not begin here, may miss tokens. They end with an error (`events_lost`, retried like a
        lost worker) instead of a shortened answer that looks whole."""
        hit = {rid for rid, writer in list(self._writer_of.items()) if writer == batch.writer and rid in self._boxes}
        hit |= {rid for rid, events in batch.events.items()
                if rid in self._boxes and not (events and isinstance(events[0], StartEvent))}
        log.error("reply reader %s: %d batches from writer %s were lost; failing %d requests", self.reader_id,
                  missing, batch.writer, len(hit))
        for rid in hit:
            self._boxes[rid].put([ErrorEvent(f"{missing} reply batches from the worker were lost on the way; "
                                             "the answer is incomplete", "events_lost")])
            batch.events.pop(rid, None)  # what came after the hole is not delivered: the request has ended
