"""The batch driver: runs a batch's lines through the farm's Gateway, below interactive traffic.

(Over 400 lines: one class whose threads — dispatch, lease renewal, the reaper, finalizing — share the
batch's state under one lock; split, that state would be passed between modules.)

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from farm import metrics, registry
from farm.apikeys import OWNER_ANONYMOUS, KeyRing, tenant_cache_salt
from farm.batch.files import FileStore
from farm.batch.schedule import Plan
from farm.batch.store import TERMINAL, BatchStore, kick_key
from farm.batch.validate import PreparedLine, validate_input
from farm.config import FarmConfig
from farm.config.batch import BatchConfig, prepared_path
from farm.gateway.reading import Answer, collect
from farm.openai.logprobs import for_kind
from farm.openai.responses import Choice, full_response
from farm.protocol import (
    BATCH_QUEUE,
    TASK_BATCH_DRIVE,
    DeltaEvent,
    DoneEvent,
    GenerationRequest,
    SamplingParams,
    Usage,
)
from farm.quota import Limiter
from farm.redis_client import connect

log = logging.getLogger(__name__)


def send_to_driver(celery_app, store: BatchStore, batch_id: str, bcfg: BatchConfig, force: bool = False) -> bool:
    """Put the batch on the driver queue, unless it was put there within `kick_ttl_s` (or `force`)."""
    if not store.mark_kicked(batch_id, bcfg.kick_ttl_s, force=force):
        return False
    celery_app.send_task(TASK_BATCH_DRIVE, args=[batch_id], queue=BATCH_QUEUE)
    return True


class LowPriority:
    """The Celery app as the Gateway sees it, sending every task with a low message priority."""

    def __init__(self, app, priority: int):
        self._app = app
        self._priority = priority

    def send_task(self, *args, **kwargs):
        kwargs.setdefault("priority", self._priority)
        return self._app.send_task(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._app, name)


@dataclass
class Outcome:
    kind: str  # recorded | retry | cancelled
    count: bool = False  # a retry that uses up one of the line's attempts
    delay: float = 0.0
    code: str = ""
    reason: str = ""


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


class LoadWatch:
    """The window of batch lines this process may have in flight, from the farm's interactive load."""

    def __init__(self, driver: BatchDriver):
        self.driver = driver
        self.bcfg = driver.bcfg
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
                    loads = self.driver.gateway.router.loads.loads()
                    total = sum(v.get("dn", 0) for v in loads.values())
                    self.interactive = max(0, total - self.driver.store.inflight_count())
                except redis.RedisError:
                    pass
                if self.interactive >= self.bcfg.interactive_threshold:
                    self._busy_until = now + self.bcfg.interactive_hold_s
            size = self.bcfg.min_inflight if now < self._busy_until else self.bcfg.max_inflight
        metrics.BATCH_WINDOW.set(size)
        return size


class BatchDriver:
    """One per driver process; `drive(batch_id)` runs in a Celery task thread, several at once."""

    def __init__(self, cfg: FarmConfig, r: redis.Redis | None = None, celery_app=None, gateway=None):
        self.cfg = cfg
        self.bcfg = cfg.batch
        self.r = r or connect(cfg.redis, health_check_interval=10, socket_keepalive=True)
        if celery_app is None:
            from farm.broker import make_celery

            celery_app = make_celery(cfg)
        self.celery = celery_app
        self.store = BatchStore(self.r)
        self.files = FileStore.from_config(self.r, cfg)
        self._gateway = gateway
        self._gw_lock = threading.Lock()
        self.load = LoadWatch(self)
        self.stopping = threading.Event()
        self._inflight = 0
        self._slot_lock = threading.Lock()
        self._reaper: threading.Thread | None = None
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        # batch lines spend their owner's token quota like interactive requests (the key ring's own
        # limits come from config entries only, so FARM_API_KEYS is not needed here)
        self.limiter = Limiter(self.r, cfg.api.limits, KeyRing.from_config(cfg, environ={}).overrides)
        self._owners: dict[str, str] = {}
        self._semantic = None  # farm.semantic.layer.SemanticLayer, built by the first batch that needs it
        self._sem_lock = threading.Lock()

    @property
    def gateway(self):
        with self._gw_lock:
            if self._gateway is None:
                from farm.gateway import Gateway

                self._gateway = Gateway(self.cfg, self.r, celery_app=LowPriority(self.celery, self.bcfg.priority),
                                        reader_kind="batch")
            return self._gateway

    # -- the reaper: batches nobody drives ------------------------------------------------------------
    def reap(self) -> int:
        """Send active batches without a live driver to the driver queue; returns how many."""
        n = 0
        for bid in self.store.active_ids():
            if not self.store.leased(bid) and send_to_driver(self.celery, self.store, bid, self.bcfg):
                log.info("batch %s has no driver: re-sent to %s", bid, BATCH_QUEUE)
                n += 1
        return n

    def start_reaper(self) -> None:
        def loop() -> None:
            while not self.stopping.wait(self.bcfg.reaper_interval_s):
                try:
                    self.reap()
                except Exception:  # noqa: BLE001 - Redis down or the like: try again next round
                    log.exception("batch reaper")

        self._reaper = threading.Thread(target=loop, name="batch-reaper", daemon=True)
        self._reaper.start()

    def stop(self) -> None:
        """Warm shutdown: drivers stop dispatching, let in-flight lines finish (grace), hand batches on."""
        self.stopping.set()

    # -- one batch ----------------------------------------------------------------------------------------
    def drive(self, batch_id: str) -> str:
        token = f"{self.identity}:{uuid.uuid4().hex[:8]}"
        if not self.store.acquire_lease(batch_id, token, self.bcfg.lease_ttl_s):
            return "leased"  # another driver runs it (this message was a duplicate or a redelivery)
        self.r.delete(kick_key(batch_id))  # taken: should this driver die, the reaper may re-send it at once
        keeper = LeaseKeeper(self.store, batch_id, token, self.bcfg.lease_ttl_s)
        keeper.start()
        outcome = "error"
        try:
            outcome = self._step(batch_id, keeper)
            return outcome
        finally:
            keeper.stop()
            try:
                self.store.release_lease(batch_id, token)
                if outcome == "abandoned" and self.stopping.is_set():
                    send_to_driver(self.celery, self.store, batch_id, self.bcfg, force=True)
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
            return self._end(bid, ("validating",), "expired", expired_at=int(time.time()))
        if st == "validating":
            st = self._validate(bid, b)
        if st == "in_progress":
            st = self._run(bid, self.store.get(bid) or b, keeper)
        if st == "abandoned" or keeper.lost:
            return "abandoned"
        if st == "cancelling":
            return self._finalize(bid, "cancelled")
        if st == "finalizing":
            final = (self.store.get(bid) or {}).get("final_status") or "completed"
            return self._finalize(bid, final)
        return st or "missing"

    def _end(self, bid: str, from_states: tuple[str, ...], to: str, **fields: Any) -> str:
        ok, st = self.store.transition(bid, from_states, to, **fields)
        if ok and to in TERMINAL:
            metrics.count_farm(self.r, "farm_batches", to)
        return st or "missing"

    # -- validating -----------------------------------------------------------------------------------------
    def _tokenizer(self, model: str):
        from farm.tokenization import get_tokenizer

        if model in self.cfg.semantic.aliases:  # only decoding a token-id prompt for the guards asks this
            model = self.cfg.default_model
        return get_tokenizer(self.cfg, model)

    def _semantic_layer(self):
        """The semantic layer of this driver process (built on first use): guards and MoM for batch lines."""
        with self._sem_lock:
            if self._semantic is None:
                from farm.semantic.layer import SemanticLayer

                self._semantic = SemanticLayer.from_config(self.cfg, redis_client=self.r, served=self._served_models)
            return self._semantic

    def _served_models(self) -> set[str]:
        return {w.model for w in registry.live_workers(self.r)}

    def _decide(self, model: str, messages: list[dict]):
        """A batch line's semantic verdict: as the API's, but never answered from (or stored in) the cache."""
        return self._semantic_layer().before(model, messages, no_cache=True)

    def _prepare(self, b: dict[str, Any]) -> tuple[list[PreparedLine], list[dict[str, Any]]]:
        meta = self.files.get(b["input_file_id"])
        try:
            data = self.files.read(b["input_file_id"]) if meta else None
        except FileNotFoundError:
            data = None
        if data is None:
            return [], [{"code": "input_file_missing", "message": f"The input file {b['input_file_id']} "
                         "no longer exists.", "param": "input_file_id", "line": None}]
        try:
            semantic = self.cfg.semantic.enabled
            return validate_input(data, b["endpoint"], [m.name for m in self.cfg.models], self._tokenizer,
                                  lambda m: self.cfg.model(m).max_model_len, self.bcfg.max_lines,
                                  self.bcfg.max_reported_errors, lambda m: self.cfg.model(m).defaults,
                                  self._decide if semantic else None, self.cfg.semantic.aliases,
                                  lambda m: self.cfg.model(m).backend)
        except redis.RedisError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the model's tokenizer is missing on this host
            log.exception("batch validation")
            return [], [{"code": "validation_error", "message": f"the input could not be validated: {e}",
                         "param": None, "line": None}]

    def _prepared_file(self, bid: str) -> Path:
        return prepared_path(self.cfg) / f"{bid}.jsonl"

    def _validate(self, bid: str, b: dict[str, Any]) -> str:
        lines, errors = self._prepare(b)
        now = int(time.time())
        if errors:
            log.info("batch %s failed validation: %d error(s), first: %s", bid, len(errors), errors[0])
            return self._end(bid, ("validating",), "failed", failed_at=now,
                             errors={"object": "list", "data": errors})
        path = self._prepared_file(bid)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            for ln in lines:
                f.write(ln.to_json() + "\n")
        os.replace(tmp, path)
        ok, st = self.store.transition(bid, ("validating",), "in_progress", in_progress_at=now, total=len(lines),
                                       model=lines[0].model)
        if ok:
            log.info("batch %s: %d requests validated, running", bid, len(lines))
        return st or "missing"

    def _load_prepared(self, bid: str, b: dict[str, Any]) -> list[PreparedLine] | None:
        try:
            with open(self._prepared_file(bid), "rb") as f:
                return [PreparedLine.from_json(raw) for raw in f if raw.strip()]
        except FileNotFoundError:
            pass
        lines, errors = self._prepare(b)  # prepared on another host, or lost: derive again from the input
        if errors:
            self._end(bid, ("in_progress",), "failed", failed_at=int(time.time()),
                      errors={"object": "list", "data": errors})
            return None
        return lines

    # -- in progress ----------------------------------------------------------------------------------------
    def _take_slot(self) -> bool:
        window = self.load.window()
        with self._slot_lock:
            if self._inflight >= window:
                return False
            self._inflight += 1
            metrics.BATCH_INFLIGHT.set(self._inflight)
            return True

    def _release_slot(self) -> None:
        with self._slot_lock:
            self._inflight -= 1
            metrics.BATCH_INFLIGHT.set(self._inflight)

    def _run(self, bid: str, b: dict[str, Any], keeper: LeaseKeeper) -> str:
        lines = self._load_prepared(bid, b)
        if lines is None:
            return self.store.status(bid) or "missing"
        recorded = self.store.recorded_ids(bid)
        todo = [ln for ln in lines if ln.custom_id not in recorded]
        for ln in todo:  # answered by the semantic layer at validation (a guard's refusal): no worker
            if ln.answer is not None:
                rid = ("chatcmpl-" if ln.kind == "chat" else "cmpl-") + uuid.uuid4().hex
                self._record_success(bid, ln, rid, Answer(ln.answer, DoneEvent(ln.finish_reason or "stop", Usage())))
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
            self._release_slot()
            plan.finished(line)
            try:
                out: Outcome = fut.result()
            except Exception as e:  # noqa: BLE001 - a bug or Redis trouble in one line: run it again
                log.exception("batch %s line %d", bid, line.line)
                out = Outcome("retry", count=True, delay=1.0, code="internal_error", reason=str(e))
            if out.kind != "retry" or stop.is_set():
                return
            metrics.count_farm(self.r, "farm_batch_lines", "retried")
            if out.count:
                attempts[line.custom_id] += 1
            if attempts[line.custom_id] >= self.bcfg.max_attempts:
                self._record_failure(bid, line, out.code or "failed", f"{out.reason} (after "
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
                while self._take_slot():
                    line = plan.next(time.monotonic())
                    if line is None:
                        self._release_slot()
                        break
                    fut = pool.submit(self._run_line, bid, line, plan, stop, wake)
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
                    self._record_failure(bid, ln, "batch_expired", "This request could not be executed "
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

    def _run_line(self, bid: str, line: PreparedLine, plan: Plan, stop: threading.Event,
                  wake: threading.Event) -> Outcome:
        """Run one line to its end; the result is recorded here, retries are decided by the caller."""
        from farm.gateway import BusyError, ClientGone, GatewayTimeout, NoWorkersError, WorkerError

        cfg = self.cfg
        rid = ("chatcmpl-" if line.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        # the batch owner's cache salt, as the API gives its interactive requests (farm.apikeys.tenant_cache_salt)
        req = GenerationRequest(rid, line.model, line.prompt_ids, SamplingParams.from_dict(line.sampling),
                                created=time.time(), cache_salt=tenant_cache_salt(self._owner(bid), line.cache_salt))

        def first_delta(_ev: DeltaEvent) -> None:
            plan.prefilled(line)
            wake.set()

        try:
            self.store.inflight_add(rid, time.time() + cfg.celery.max_request_s)
            try:
                sub = self.gateway.submit(req)
            except NoWorkersError as e:
                return Outcome("retry", delay=2.0, code="no_workers", reason=str(e))
            except BusyError as e:
                return Outcome("retry", delay=float(e.retry_after_s), code="overloaded", reason=str(e))
            try:
                # stop (cancelled, expired, handed over) is asked like a client that left
                answer = collect(sub.events(client_gone=stop.is_set), on_first_delta=first_delta)
            except ClientGone:
                return Outcome("cancelled")
            except GatewayTimeout as e:
                return Outcome("retry", count=True, code="timeout", reason=str(e))
            except WorkerError as e:
                if e.retryable:  # no worker could take it over: run it again later
                    log.warning("batch %s line %d (%s): %s; running it again", bid, line.line, line.custom_id, e)
                    return Outcome("retry", count=True, code=e.code, reason=str(e))
                self._record_failure(bid, line, e.code, f"generation failed: {e}", rid=rid, status=500)
                return Outcome("recorded")
            finally:
                sub.cancel()  # a no-op once it finished; stops the workers when the line gives up
                sub.close()
            if answer.finish_reason == "abort":
                if stop.is_set():
                    return Outcome("cancelled")
                return Outcome("retry", count=True, code="aborted", reason="the request was aborted")
            self._record_success(bid, line, rid, answer)
            return Outcome("recorded")
        except redis.RedisError as e:
            return Outcome("retry", delay=1.0, code="redis_error", reason=str(e))
        finally:
            try:
                self.store.inflight_remove(rid)
            except redis.RedisError:
                pass

    # -- results ----------------------------------------------------------------------------------------------
    def _record_success(self, bid: str, line: PreparedLine, rid: str, answer: Answer) -> None:
        usage = answer.usage.to_dict()
        logprobs = None
        if line.sampling.get("logprobs") is not None:
            logprobs = for_kind(line.kind, self._tokenizer(line.model), answer.token_ids, answer.logprobs)
        body = full_response(line.kind, rid, line.model, [Choice(answer.text, answer.finish_reason, logprobs)], usage)
        out = {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id,
               "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}
        if self.store.record(bid, line.custom_id, {"line": line.line, "ok": True, "out": out}, True, usage) == 1:
            metrics.count_farm(self.r, "farm_batch_lines", "completed")
            self._charge(bid, usage)

    def _charge(self, bid: str, usage: dict[str, Any]) -> None:
        """A recorded line's tokens go to the batch owner's quota (once: only the first record counts).
        The quota is checked when a batch is created; a batch admitted runs to its end."""
        owner = self._owner(bid)
        try:
            self.limiter.charge(owner, int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0)))
        except redis.RedisError:
            log.warning("batch %s: could not charge a line's tokens to its owner's quota", bid)

    def _owner(self, bid: str) -> str:
        """The batch's owner id (its creator's key; anonymous on a farm without keys), remembered while it runs."""
        owner = self._owners.get(bid)
        if owner is None:
            owner = self._owners[bid] = (self.store.get(bid) or {}).get("owner") or OWNER_ANONYMOUS
        return owner

    def _record_failure(self, bid: str, line: PreparedLine, code: str, message: str, rid: str | None = None,
                        status: int | None = None) -> None:
        """An error-file line: an HTTP-style error (status given) or a request that never got an answer."""
        if status is not None:
            resp = {"status_code": status, "request_id": rid,
                    "body": {"error": {"message": message, "type": "server_error", "param": None, "code": code}}}
            out = {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id, "response": resp,
                   "error": None}
        else:
            out = {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id, "response": None,
                   "error": {"code": code, "message": message}}
        if self.store.record(bid, line.custom_id, {"line": line.line, "ok": False, "out": out}, False) == 1:
            metrics.count_farm(self.r, "farm_batch_lines", "failed")

    # -- finalizing -------------------------------------------------------------------------------------------
    def _finalize(self, bid: str, final: str) -> str:
        """Write the output and error files from the recorded results (in input order), then end."""
        import json

        frm = "cancelling" if final == "cancelled" else "finalizing"
        self.store.set_fields(bid, sealed=True)  # no result is recorded after the files are written
        self._owners.pop(bid, None)
        b = self.store.get(bid) or {}
        if b.get("status") != frm:
            return b.get("status") or "missing"
        results = sorted(self.store.results(bid), key=lambda x: x["line"])
        suffix = bid.split("_", 1)[-1][:24]
        owner = b.get("owner")
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for field, ok, fid, name in (("output_file_id", True, f"file-{suffix}out", "output"),
                                     ("error_file_id", False, f"file-{suffix}err", "error")):
            chosen = [r["out"] for r in results if r["ok"] is ok]
            if chosen:
                chunks = ((json.dumps(o, separators=(",", ":")) + "\n").encode() for o in chosen)
                self.files.create(chunks, f"{bid}_{name}.jsonl", "batch_output", owner, file_id=fid)
                ids[field] = fid
        stamp = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}[final]
        st = self._end(bid, (frm,), final, **ids, **{stamp: int(time.time())})
        log.info("batch %s %s: %d results", bid, st, len(results))
        return st


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
