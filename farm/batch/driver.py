"""The batch driver: runs a batch's lines through the farm's Gateway, below interactive traffic.

How a batch runs. `POST /v1/batches` stores the batch (status `validating`) and sends one
`farm.batch.drive` task to the dedicated `farm.batch` queue, which only batch-driver processes consume
(`python -m tasks.batch`), never the generation workers. The driver task validates the input file
(`validating` -> `in_progress`, or `failed` with line-numbered errors), then feeds the lines to the
same `Gateway.submit` the live endpoints use, a bounded number at a time, in prefix-grouped order
(farm.batch.schedule), and records each result in Redis. When every line has a result it writes the
output and error files (`finalizing` -> `completed`).

Why this and not Celery message priorities alone. Interactive and batch requests end up in the same
engines, and what decides who waits is how many sequences each engine holds, not the order of a queue:
a worker reserves up to `celery.worker_threads` messages (prefetch 1 per thread) and its engine batches
everything it holds, with no priority classes. Priorities in the broker (`queue_order_strategy:
priority`, Redis transport: 0 served first, 9 last) only reorder a backlog the workers have not taken
yet. So the driver itself is the throttle: it keeps at most `batch.max_inflight` lines in flight per
driver process while the farm is otherwise idle, and shrinks to `batch.min_inflight` as soon as
interactive requests are in flight (the farm's shared load, `farm:load`, minus the batch's own lines,
`farm:batch:inflight`), for `interactive_hold_s` after the last sighting. A chat request therefore finds
free engine slots and at most a few batch sequences beside it, and a 50,000-line batch is just a steady,
small stream. Line tasks are additionally sent with Celery priority `batch.priority` (9), so should a
worker's queue ever back up, interactive messages are taken first. (Only the first stage gets the low
priority: in a disaggregated layout the prefill worker sends the decode stage at normal priority.)

Durability. Everything lives in Redis and on disk (farm.batch.store). A driver holds a lease on the
batch (TTL `lease_ttl_s`, refreshed while it runs); each line's result is recorded once, keyed by its
custom_id (HSETNX + counters in one Lua script). A line whose worker dies migrates to another worker with
the tokens so far, as interactive requests do (farm.gateway.submission); a line that times out, or whose
worker was lost with no other to take it, is cancelled and run again under a new request id, up to
`max_attempts` runs, then goes to the error file. The driver task is acked late; if the driver process dies its lease lapses, and every
driver process's reaper re-sends batches that are active and unowned, so another driver (or the same
one, restarted) resumes from Redis: recorded lines are skipped, the rest run. Output files are written
from the recorded results with ids derived from the batch id, so finalizing twice rewrites the same
files. Nothing is dropped: a line ends up in the output file, in the error file, or (only when the
batch is cancelled) in neither, and request_counts always equal the lines in the two files.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis

from farm.batch import handoff
from farm.batch.file_store import FileStore
from farm.batch.lease import LeaseKeeper
from farm.batch.line import LineRunner, Outcome
from farm.batch.preparation import Preparation
from farm.batch.results import Results
from farm.batch.schedule import Plan
from farm.batch.store import TERMINAL, BatchStore
from farm.batch.throttle import LoadWatch, Slots
from farm.batch.validate import PreparedLine
from farm.config import FarmConfig
from farm.gateway.reading import Answer
from farm.infra.broker import TaskPublisher
from farm.infra.redis_client import connect
from farm.protocol import DoneEvent, Usage
from farm.protocol.keys import batch_kick_key
from farm.telemetry import prometheus

log = logging.getLogger(__name__)


class BatchDriver:
    """One per driver process; `drive(batch_id)` runs in a Celery task thread, several at once. Its parts: the
    validating stage (`prep`), running one line (`lines`), recording results and ending batches (`results`), the
    window of lines in flight (`load`, `slots`), and the reaper (farm.batch.handoff)."""

    def __init__(self, cfg: FarmConfig, r: redis.Redis | None = None, celery_app=None, gateway=None):
        self.cfg = cfg
        self.bcfg = cfg.batch
        self.r = r or connect(cfg.redis, health_check_interval=10, socket_keepalive=True)
        if celery_app is None:
            from farm.infra.broker import make_celery

            celery_app = make_celery(cfg)
        self.celery = celery_app
        self.store = BatchStore(self.r)
        self.files = FileStore.from_config(self.r, cfg)
        self._gateway = gateway
        self._gw_lock = threading.Lock()
        self.load = LoadWatch(self.bcfg, lambda: self.gateway.router.loads.loads(), self.store.inflight_count)
        self.slots = Slots(self.load)
        self.stopping = threading.Event()
        self._reaper: threading.Thread | None = None
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        self.prep = Preparation(cfg, self.r, self.store, self.files, lambda *a, **k: self.results.end(*a, **k))
        self.results = Results(cfg, self.r, self.store, self.files, self.prep.tokenizer)
        self.lines = LineRunner(cfg, self.store, self.results, lambda: self.gateway)

    @property
    def gateway(self):
        with self._gw_lock:
            if self._gateway is None:
                from farm.gateway import Gateway

                self._gateway = Gateway(self.cfg, self.r, publisher=TaskPublisher(self.r, self.bcfg.priority),
                                        reader_kind="batch")
            return self._gateway

    # -- the reaper: batches nobody drives ------------------------------------------------------------
    def reap(self) -> int:
        """Send active batches without a live driver to the driver queue; returns how many."""
        return handoff.reap(self.celery, self.store, self.bcfg)

    def start_reaper(self) -> None:
        self._reaper = handoff.start_reaper(self.celery, self.store, self.bcfg, self.stopping, self.files)

    def stop(self) -> None:
        """Warm shutdown: drivers stop dispatching, let in-flight lines finish (grace), hand batches on."""
        self.stopping.set()

    # -- one batch ----------------------------------------------------------------------------------------
    def drive(self, batch_id: str) -> str:
        token = f"{self.identity}:{uuid.uuid4().hex[:8]}"
        if not self.store.acquire_lease(batch_id, token, self.bcfg.lease_ttl_s):
            return "leased"  # another driver runs it (this message was a duplicate or a redelivery)
        self.r.delete(batch_kick_key(batch_id))  # taken: should this driver die, the reaper may re-send it at once
        keeper = LeaseKeeper(self.store, batch_id, token, self.bcfg.lease_ttl_s)
        keeper.start()
        outcome = "error"
        try:
            outcome = self._step(batch_id, keeper)
            if outcome in TERMINAL:  # its prepared lines (prompts' token ids) are no longer needed on this disk
                self.prep.prepared_file(batch_id).unlink(missing_ok=True)
            return outcome
        finally:
            keeper.stop()
            try:
                self.store.release_lease(batch_id, token)
                if outcome == "abandoned" and self.stopping.is_set():
                    handoff.send_to_driver(self.celery, self.store, batch_id, self.bcfg, force=True)
            except redis.RedisError:
                pass  # the reaper of a live driver picks the batch up once the lease lapses

    def _step(self, bid: str, keeper: LeaseKeeper) -> str:
        b = self.store.get(bid)
        if b is None:
            return "missing"
        st = b["status"]
        if st in TERMINAL:
            return st
        if st == "validating" and time.time() > b["expires_at"]:
            return self.results.end(bid, ("validating",), "expired", expired_at=int(time.time()))
        if st == "validating":
            st = self.prep.validate(bid, b)
        if st == "in_progress":
            st = self._run(bid, self.store.get(bid) or b, keeper)
        if st == "abandoned" or keeper.lost:
            return "abandoned"
        if st == "cancelling":
            return self.results.finalize(bid, "cancelled")
        if st == "finalizing":
            final = (self.store.get(bid) or {}).get("final_status") or "completed"
            return self.results.finalize(bid, final)
        return st or "missing"

    # -- in progress: the dispatch loop -----------------------------------------------------------------
    def _run(self, bid: str, b: dict[str, Any], keeper: LeaseKeeper) -> str:
        lines = self.prep.load_prepared(bid, b)
        if lines is None:
            return self.store.status(bid) or "missing"
        recorded = self.store.recorded_ids(bid)
        todo = [ln for ln in lines if ln.custom_id not in recorded]
        for ln in todo:  # answered by the semantic layer at validation (a guard's refusal): no worker
            if ln.answer is not None:
                rid = ("chatcmpl-" if ln.kind == "chat" else "cmpl-") + uuid.uuid4().hex
                self.results.record_success(bid, ln, rid,
                                            Answer(ln.answer, DoneEvent(ln.finish_reason or "stop", Usage())))
        todo = [ln for ln in todo if ln.answer is None]
        if recorded:
            log.info("batch %s: resuming, %d of %d lines already recorded", bid, len(recorded), len(lines))
        mode = b.get("schedule") or self.bcfg.schedule
        plan = Plan(todo, mode, self.cfg.block_size, self.bcfg.warm_prefix_min_blocks)
        stop = threading.Event()  # in-flight lines give up (cancel on the worker) when set
        wake = threading.Event()
        inflight: dict[Future, PreparedLine] = {}
        attempts: Counter[str] = Counter()
        reason = "done"
        next_check = 0.0
        pool = ThreadPoolExecutor(max_workers=self.bcfg.max_inflight, thread_name_prefix=f"batch-{bid[-6:]}")

        def collect(fut: Future) -> None:
            line = inflight.pop(fut)
            self.slots.release()
            plan.finished(line)
            try:
                out: Outcome = fut.result()
            except Exception as e:  # noqa: BLE001 - a bug or Redis trouble in one line: run it again
                log.exception("batch %s line %d", bid, line.line)
                out = Outcome("retry", count=True, delay=1.0, code="internal_error", reason=str(e))
            if out.kind != "retry" or stop.is_set():
                return
            prometheus.count_farm(self.r, "farm_batch_lines", "retried")
            if out.count:
                attempts[line.custom_id] += 1
            if attempts[line.custom_id] >= self.bcfg.max_attempts:
                self.results.record_failure(bid, line, out.code or "failed", f"{out.reason} (after "
                                            f"{attempts[line.custom_id]} attempts)")
            else:
                plan.again(line, time.monotonic() + out.delay)

        try:
            while True:
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + 0.5
                    try:
                        st = self.store.status(bid)
                    except redis.RedisError:  # Redis failing over or restarting: keep going (the lease
                        st = "in_progress"    # keeper gives the batch up if that lasts a whole lease)
                    if st != "in_progress":
                        reason = st or "missing"
                        break
                    if time.time() > b["expires_at"]:
                        reason = "expired"
                        break
                if keeper.lost:
                    reason = "lease"
                    break
                if self.stopping.is_set():
                    reason = "shutdown"
                    break
                for fut in [f for f in inflight if f.done()]:
                    collect(fut)
                if not inflight and not len(plan):
                    lost = self._unrecorded(bid, todo)
                    if lost == []:
                        break
                    for ln in lost or []:
                        plan.again(ln, now)
                while self.slots.take():
                    line = plan.next(time.monotonic())
                    if line is None:
                        self.slots.release()
                        break
                    fut = pool.submit(self.lines.run, bid, line, plan, stop, wake)
                    inflight[fut] = line
                    fut.add_done_callback(lambda _f: wake.set())
                wake.wait(0.25)
                wake.clear()
        finally:
            if reason == "shutdown" and inflight:
                deadline = time.monotonic() + self.bcfg.shutdown_grace_s
                while inflight and time.monotonic() < deadline:
                    for fut in [f for f in inflight if f.done()]:
                        collect(fut)
                    wake.wait(0.25)
                    wake.clear()
            stop.set()
            for fut in list(inflight):
                try:
                    fut.result(timeout=self.bcfg.poll_s * 3 + 10)
                except Exception:  # noqa: BLE001 - collected below either way
                    pass
                collect(fut)
            pool.shutdown(wait=True)
        now_s = int(time.time())
        if reason == "done":
            ok, st = self.store.transition(bid, ("in_progress",), "finalizing", finalizing_at=now_s,
                                           final_status="completed")
            return st or "missing"
        if reason == "expired":
            done = self.store.recorded_ids(bid)
            for ln in lines:
                if ln.custom_id not in done:
                    self.results.record_failure(bid, ln, "batch_expired", "This request could not be executed "
                                                "before the completion window expired.")
            ok, st = self.store.transition(bid, ("in_progress",), "finalizing", finalizing_at=now_s,
                                           final_status="expired")
            return st or "missing"
        if reason in ("lease", "shutdown"):
            return "abandoned"
        return reason

    def _unrecorded(self, bid: str, lines: list[PreparedLine]) -> list[PreparedLine] | None:
        """Lines run to their end whose result Redis does not hold: a failover to a replica that had not
        yet received them loses acknowledged writes (asynchronous replication), and they run again. None
        (not an empty list) while Redis cannot say."""
        try:
            recorded = self.store.recorded_ids(bid)
        except redis.RedisError:
            time.sleep(0.5)
            return None
        lost = [ln for ln in lines if ln.custom_id not in recorded]
        if lost:
            log.warning("batch %s: %d recorded results are gone (a Redis failover?); running them again", bid,
                        len(lost))
        return lost


_driver: BatchDriver | None = None
_driver_lock = threading.Lock()


def get_driver(celery_app=None) -> BatchDriver:
    """The process's driver (one per process: it owns the Gateway, the window and the reaper)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            from farm.config import get_config

            _driver = BatchDriver(get_config(), celery_app=celery_app)
        return _driver
