"""A worker process's runtime: one engine, its transfer server, stream writer and registry heartbeat.

Celery task threads call `prefill`, `decode` and `generate`; each checks its request (one Redis round trip:
cancelled? its reader still there? already claimed?), opens its route to the reader's reply stream, submits it to
the shared engine and returns: all requests of the process share one continuous batch, and a worker holds as many
requests as its engine takes (running or waiting there), not as many as Celery has task threads. Outputs leave
through callbacks on the engine's thread; a prefill's hand-over to the decode stage (KV handle, decode task) runs
on a small pool so the engine never waits for Redis. A message is acknowledged once its request is in the engine;
a worker that dies after that loses nothing, because the gateway reading the request migrates it (with the tokens
so far) to another worker (farm.gateway.submission). A warm shutdown (SIGTERM) waits for the requests in the
engine to finish before the engine stops.
"""

from __future__ import annotations

import contextvars
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import redis

from farm.backends import connector_import, make_engine
from farm.cluster import registry
from farm.config import FarmConfig
from farm.engine.contract import ConnectorEngine, RequestOutput, ServingEngine
from farm.engine.sampling import TokenLogprobs
from farm.engine.scheduler import KVImport
from farm.infra import tracing
from farm.infra.broker import TaskPublisher, send_generation
from farm.infra.process_identity import started_since_boot
from farm.infra.redis_client import connect
from farm.infra.secret import farm_secret
from farm.models.directories import model_vocab_size, require_model_dir
from farm.protocol import (
    TASK_DECODE,
    TASK_PING,
    TASK_RELEASE_KV,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    InvalidTask,
    Role,
    StartEvent,
    Usage,
    cancel_key,
    claim_key,
    direct_queue,
    is_request_id,
    queue_name,
    queues_for_role,
    reader_lease_key,
)
from farm.protocol.keys import alive_key, ping_key
from farm.router.kv_publisher import KVEventPublisher
from farm.transfer.handle import HandleError, KVHandle, check_bound
from farm.transfer.shm import host_id as shm_host_id
from farm.transfer.staging import StagingPool
from farm.transfer.tcp import TransferError, TransferServer, checksum, fetch_blocks
from farm.worker import task_context
from farm.worker.stream_writer import StreamWriter
from farm.worker.watchdog import WorkerGuard

log = logging.getLogger(__name__)

# Whether a task's request may run here, in one round trip. KEYS: cancel flag, reader lease, stage claim;
# ARGV: this worker, claim TTL, "1" when the request has a reader lease, the heartbeat key prefix.
# -> "cancelled" (its client left or it migrated) | "orphaned" (its reader's lease lapsed) | "claimed" (another
# live worker runs this stage: a re-sent task) | "ok" (claimed here, also taken over from a dead holder)
_ADMIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 'cancelled' end
if ARGV[3] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then return 'orphaned' end
if redis.call('SET', KEYS[3], ARGV[1], 'NX', 'EX', ARGV[2]) then return 'ok' end
local holder = redis.call('GET', KEYS[3])
if holder and redis.call('EXISTS', ARGV[4] .. holder) == 0 then
  redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[2])
  return 'ok'
end
return 'claimed'
"""
HANDOVER_THREADS = 4  # prefill hand-overs (read the held KV for its checksum, sign, send the decode task)
# A decode task that Redis does not take (unreachable, refusing writes) is sent again for this long; then the
# prefill gives the request back to its reader (ErrorEvent.HANDOVER_FAILED), which places it again.
HANDOVER_SEND_S = 10.0
# The engine's finish reasons that name the request's own fault (a schema, a migrated prefix that breaks it).
CLIENTS_ERRORS = ("error:invalid request", "error:structured output failed")


class WorkerRuntime:
    def __init__(self, cfg: FarmConfig, role: Role, model: str, worker_id: str, celery_app=None):
        self.cfg = cfg
        self.role = role
        self.model = model
        self.worker_id = worker_id
        self.celery = celery_app
        self.secret = farm_secret(cfg)
        mcfg = cfg.model(model)
        mdir = require_model_dir(cfg, mcfg)
        self.block_size = cfg.block_size(model)
        self.vocab_size = model_vocab_size(mdir)  # task messages are checked against it (accept)
        self.r = connect(cfg.redis, health_check_interval=10)
        # the decode tasks of this worker's prefills (none without a Celery app: a runtime driven by hand)
        self.publisher = TaskPublisher(self.r) if celery_app is not None else None
        self._check_block_size()
        self.kv_events = KVEventPublisher(self.r, worker_id)
        self.engine: ServingEngine = make_engine(cfg, mcfg, mdir, self.kv_events, worker_id=worker_id,
                                                 role=role)  # builtin | vllm
        ha = cfg.redis.ha
        self.streams = StreamWriter(self.r, cfg.engine.stream_flush_ms, self.engine.abort,
                                    replica_ack_ms=ha.replica_ack_timeout_ms if ha.enabled else 0)
        self._admit = self.r.register_script(_ADMIT)
        self._handover = ThreadPoolExecutor(HANDOVER_THREADS, thread_name_prefix="handover")
        self.staging = StagingPool()
        self.nixl = None
        if "nixl" in cfg.transfer.transports:
            from farm.transfer import nixl

            if nixl.available():
                self.nixl = nixl.NixlSource(worker_id, self.engine.runner.kv)
            else:
                log.warning("transfer.transports lists nixl but the nixl package is not installed")
        self.transfer = TransferServer(worker_id, self.secret, self._check_held, self.engine.runner.read_blocks,
                                       self.engine.release_held, cfg.transfer.bind_host, nixl_source=self.nixl)
        self.info = registry.WorkerInfo(
            worker_id=worker_id, role=role, model=model, hostname=socket.gethostname(), pid=os.getpid(),
            since_boot=started_since_boot(os.getpid()),
            block_size=self.block_size,
            transfer_endpoint=f"{cfg.transfer.advertise_host}:{self.transfer.port}",
            queues=queues_for_role(model, role) + [direct_queue(worker_id)], device=str(self.engine.runner.device),
            num_blocks=self.engine.pool.num_blocks,
        )
        self.heartbeat = registry.Heartbeat(self.r, self.info, self.engine.stats)
        self.concurrency = cfg.celery.worker_threads  # tasks.worker sets the real --concurrency
        self.tasks_running = 0  # task threads busy now (the watchdog tells a stall from a full pool)
        self.inflight = 0  # requests in the engine now (a warm shutdown waits for them)
        self._count_lock = threading.Lock()
        self._idle = threading.Condition(self._count_lock)
        self.guard = WorkerGuard(self)

    def _check_block_size(self) -> None:
        """Every worker of a model must use one KV block size (the router hashes prompts with it): refuse
        to start beside a live worker of the model that uses another."""
        for w in registry.live_workers(self.r, model=self.model):
            if w.worker_id != self.worker_id and w.block_size != self.block_size:
                raise RuntimeError(
                    f"KV block size mismatch for model {self.model!r}: this worker uses {self.block_size}, live "
                    f"worker {w.worker_id} uses {w.block_size}; requests would be routed wrongly. Give every "
                    f"worker of the model the same configuration (models[].block_size), or stop {w.worker_id}")

    def start(self) -> WorkerRuntime:
        self.kv_events.start()
        self.engine.start()
        self.streams.start()
        self.transfer.start()
        registry.register(self.r, self.info)
        self.heartbeat.start()
        self.guard.start()
        log.info("worker %s (%s, %s) ready; KV transfer on %s", self.worker_id, self.role, self.model,
                 self.info.transfer_endpoint)
        return self

    def stop(self, wait_s: float | None = None) -> None:
        """Stop after the requests in the engine finished (up to `wait_s`, default celery.max_request_s): the
        heartbeat, stream writer and transfer server keep serving them meanwhile."""
        if not self.heartbeat.is_alive():
            return  # never started (Celery stopped before it was ready)
        self.wait_idle(self.cfg.celery.max_request_s if wait_s is None else wait_s)
        self._handover.shutdown(wait=True)
        self.heartbeat.stop()
        self.guard.stop()
        try:
            registry.deregister(self.r, self.worker_id)
        except redis.RedisError:
            pass
        self.transfer.stop()
        self.engine.stop()
        self.streams.stop()
        self.kv_events.stop()

    def drain(self) -> None:
        """Warm shutdown began: leave routing now, stay alive until the requests in flight finish."""
        self.guard.draining.set()  # the consumer stops on purpose now: no stall to watch for
        try:
            self.heartbeat.drain()
        except redis.RedisError:
            pass
        log.info("worker %s draining: %d requests in flight", self.worker_id, self.inflight)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in the engine; False when `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self.inflight > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("worker %s: stopping with %d requests still running", self.worker_id, self.inflight)
                    return False
                self._idle.wait(min(left, 1.0))
        return True

    def busy(self) -> bool:
        return self.tasks_running >= self.concurrency - 1

    def task(self) -> _TaskSlot:
        """`with rt.task():` around a task's work: counts the task threads in use (WorkerGuard.busy)."""
        return _TaskSlot(self)

    def send_ping(self, token: str) -> None:
        """The consumer watchdog's probe (farm.worker.watchdog.WorkerGuard): a task through our own queue."""
        if self.celery is not None:
            self.celery.send_task(TASK_PING, args=[self.worker_id, token], queue=direct_queue(self.worker_id))

    def release_unpulled(self, handle: Any) -> None:
        """TASK_RELEASE_KV: a decode will not pull this handle's blocks; free them if this worker holds them."""
        if self.transfer.release_unpulled(handle):
            log.info("request %s: KV blocks freed, their decode will not pull them", handle.get("request_id"))

    def _send_release(self, req: GenerationRequest, handle: dict[str, Any], why: str) -> None:
        """Tell the prefill worker of `handle` that this decode will not pull its blocks (`why`), through its own
        queue: it may be out of this worker's reach while Redis still reaches both. A message lost here costs
        only the blocks' wait for the handle's expiry."""
        if self.celery is None:
            return
        try:
            self.celery.send_task(TASK_RELEASE_KV, args=[handle], queue=direct_queue(str(handle["worker_id"])))
            log.info("request %s: asked %s to free the KV blocks it holds for it (%s)", req.request_id,
                     handle["worker_id"], why)
        except Exception as e:  # noqa: BLE001 - never fail the request for it
            log.warning("request %s: could not ask its prefill worker to free its blocks: %s", req.request_id, e)

    def pong(self, token: str) -> None:
        self.r.set(ping_key(self.worker_id), token, ex=300)

    # -- helpers ------------------------------------------------------------------------------------
    def _check_held(self, handle: dict[str, Any]) -> None:
        rid = handle["request_id"]
        held = self.engine.held.get(rid)
        if held is None or held.seq.block_table != handle["block_ids"]:
            raise TransferError(f"no blocks held for request {rid} (expired or already pulled)")

    def _submit(self, req: GenerationRequest, on_finish: Callable[[RequestOutput], None], **submit_kw: Any) -> None:
        """Hand the request to the engine and return; its deltas stream as they come, and `on_finish(out)` runs
        with its last output (on the engine's thread: it must not block)."""
        rid = req.request_id
        espan = task_context.engine_span(req, self.role, self.worker_id) if tracing.ENABLED else None
        first = [espan is not None]  # a first token still to mark
        fields, t0 = contextvars.copy_context(), time.monotonic()  # the task's log fields, for the request's last line

        def on_output(out: RequestOutput) -> None:
            if first[0] and out.token_ids:
                first[0] = False
                espan.add_event("first_token")  # type: ignore[union-attr]
            if out.text or out.token_ids:  # a last token without text (a skipped special token) counts too
                lp = [x.to_list() for x in out.logprobs] if out.logprobs else None
                plp = None if out.prompt_logprobs is None else \
                    [None if x is None else x.to_list() for x in out.prompt_logprobs]
                self.streams.emit(rid, DeltaEvent(out.text, len(out.token_ids), out.token_ids, lp, plp))
            if out.finished:
                fields.run(_log_finished, self.role, out, time.monotonic() - t0)
                token = None
                if espan is not None:
                    task_context.end_engine_span(espan, out)
                    token = tracing.attach(tracing.context_of(espan))  # a hand-over continues the trace from here
                try:
                    on_finish(out)
                finally:
                    tracing.detach(token)
                    self.streams.close(rid)
                    self._ended()

        with self._count_lock:
            self.inflight += 1
        try:
            self.engine.submit(rid, req.prompt_token_ids, req.sampling, on_output,
                               max_request_s=self.cfg.celery.max_request_s, cache_salt=req.cache_salt,
                               generated=req.generated, **submit_kw)
        except Exception as e:  # noqa: BLE001 - the engine refused it: fail this request alone
            log.exception("request %s: the engine refused it", rid)
            on_output(RequestOutput(rid, finished=True, finish_reason=f"error:{e}"))

    def _ended(self) -> None:
        with self._count_lock:
            self.inflight -= 1
            if self.inflight <= 0:
                self._idle.notify_all()

    def _finish_event(self, req: GenerationRequest, out: RequestOutput, prefill_worker: str, mode: str,
                      cached_tokens: int | None = None) -> None:
        reason = out.finish_reason or "stop"
        if reason.startswith("error:"):
            # what the request itself asked for and the engine could not do is the client's (the API's 400)
            code = ErrorEvent.INVALID_REQUEST if reason.startswith(CLIENTS_ERRORS) else "engine_error"
            self.streams.emit(req.request_id, ErrorEvent(reason[6:], code))
            return
        usage = Usage(out.prompt_tokens, out.completion_tokens,
                      out.cached_tokens if cached_tokens is None else cached_tokens)
        self.streams.emit(req.request_id, DoneEvent(reason, usage, prefill_worker, self.worker_id, mode))

    def _admitted(self, req: GenerationRequest, stage: str) -> bool:
        return self._admission(req, stage) == "ok"

    def _admission(self, req: GenerationRequest, stage: str) -> str:
        """Run a request ("ok") only when its client is still there, its reader's lease holds (else it is a redelivered
        message of a request migrated or abandoned long ago, or its reader died) and no other live worker runs
        this stage (a task re-sent after its first worker vanished must not run twice). A request refused for
        its lapsed lease gets an `orphaned` error, so a reader that is in fact alive fails it at once instead of
        waiting for it."""
        leased = req.lease_s > 0 and bool(req.reply_to)
        with tracing.span("farm.admit", tracing.CLIENT, {"db.system.name": "redis", "db.operation.name": "EVALSHA",
                                                         "farm.stage": stage}) as span:
            try:
                verdict = self._admit(
                    keys=[cancel_key(req.request_id), reader_lease_key(req.reply_to) if leased else cancel_key(""),
                          claim_key(req.request_id, stage)],
                    args=[self.worker_id, int(self.cfg.celery.visibility_timeout_s), "1" if leased else "0",
                          alive_key("")])
            except redis.RedisError:
                return "ok"  # Redis trouble: run it (claims only prevent duplicates, never losses)
            verdict = verdict.decode() if isinstance(verdict, bytes) else verdict
            if span is not None:
                span.set_attribute("farm.verdict", str(verdict))
        if verdict == "orphaned":
            log.warning("request %s: its reader's lease lapsed before it started; refusing it", req.request_id)
            self.streams.emit_once(req.request_id, req.reply_to, ErrorEvent(
                "the request's reader lost its lease before a worker took the request; retry", "orphaned"))
        return str(verdict)

    # -- tasks --------------------------------------------------------------------------------------
    def accept(self, message: Any, handle: Any = None) -> GenerationRequest | None:
        """A task's request message as untrusted input (farm.protocol.InvalidTask): the request, or None
        after failing only that request, with an `invalid_task` error event for its reader when its id and
        reader are usable. A request for another model, or a handle that is not an object, is refused too."""
        try:
            req = GenerationRequest.from_dict(message, vocab_size=self.vocab_size,
                                              max_model_len=self.cfg.model(self.model).max_model_len)
            if req.model != self.model:
                raise InvalidTask(f"this worker serves {self.model!r}, not {req.model[:80]!r}")
            if handle is not None and not isinstance(handle, dict):
                raise InvalidTask("the KV handle must be an object")
            return req
        except InvalidTask as e:
            rid = message.get("request_id") if isinstance(message, dict) else None
            reply_to = message.get("reply_to") if isinstance(message, dict) else None
            log.warning("refused an invalid task (request %r): %s", str(rid)[:80], e)
            if is_request_id(rid) and is_request_id(reply_to):
                self.streams.emit_once(rid, reply_to, ErrorEvent(f"invalid task: {e}", "invalid_task"))
            return None

    def run(self, req: GenerationRequest, stage: Callable[[], None]) -> None:
        """A task's stage for an accepted request. One that fails unexpectedly fails that request at once (its
        engine work aborted, an `engine_error` event for its reader), instead of leaving its client to wait for its
        timeout; Celery has acked the task (acks late, not on failure), so it is not run twice."""
        try:
            stage()
        except Exception as e:  # noqa: BLE001 - this request fails, the worker goes on
            log.exception("request %s: the worker failed it", req.request_id)
            self.engine.abort(req.request_id)
            self.streams.emit_once(req.request_id, req.reply_to, ErrorEvent(
                f"the worker failed this request ({type(e).__name__})", "engine_error"))

    def generate(self, req: GenerationRequest) -> None:
        """Aggregated: prefill and decode here."""
        if not self._admitted(req, "generate"):
            return
        self.streams.open(req.request_id, req.reply_to, req.lease_s)
        self.streams.emit(req.request_id, StartEvent(self.role, self.worker_id, self.worker_id, "local"))
        self._submit(req, lambda out: self._finish_event(req, out, self.worker_id, "local"))

    def prefill(self, req: GenerationRequest) -> None:
        """Compute the prompt's KV and hold it; the hand-over (a signed handle to the decode queue) follows on
        the hand-over pool once the engine is done with it."""
        if not self._admitted(req, "prefill"):
            return
        self.streams.open(req.request_id, req.reply_to, req.lease_s)
        self.streams.emit(req.request_id, StartEvent("prefill", self.worker_id))
        t0 = time.monotonic()
        self._submit(req, lambda out: self._handover.submit(self._hand_over, req, out, t0, tracing.current_context()),
                     prefill_only=True)

    def _hand_over(self, req: GenerationRequest, out: RequestOutput, t0: float,
                   trace_ctx: Any = None) -> dict[str, Any] | None:
        """Pass the prefilled request on to the decode stage; with no handle (prefill failed) the decode worker
        prefills locally. An aborted prefill (client gone, reader lost) goes no further. `trace_ctx`: the prefill's
        trace context (tracing on), so the decode task joins the request's trace."""
        if trace_ctx is None:
            return self._hand_over_traced(req, out, t0)
        with tracing.span("farm.kv.handover", context=trace_ctx, attributes={"farm.request_id": req.request_id}):
            return self._hand_over_traced(req, out, t0)

    def _hand_over_traced(self, req: GenerationRequest, out: RequestOutput, t0: float) -> dict[str, Any] | None:
        try:
            handle = None
            if getattr(out, "kv_transfer_params", None) is not None:  # vLLM: its KV connector holds the blocks
                handle = cast(ConnectorEngine, self.engine).connector_handle(req, out, self.info.transfer_endpoint,
                                                                            shm_host_id(), self.secret)
            elif out.finish_reason == "prefilled" and out.held_blocks is not None:
                data = self.engine.runner.read_blocks(out.held_blocks)
                handle = KVHandle(
                    request_id=req.request_id, worker_id=self.worker_id, endpoint=self.info.transfer_endpoint,
                    host_id=shm_host_id(),
                    transport=",".join(t for t in self.cfg.transfer.transports if t != "nixl" or self.nixl),
                    block_ids=out.held_blocks, block_hashes=[str(h) for h in (out.block_hashes or [])],
                    num_tokens=len(req.prompt_token_ids), first_token=out.first_token,
                    cached_tokens=out.cached_tokens, layout=self.engine.runner.layout.to_dict(),
                    checksum=checksum(data), expires_at=time.time() + self.cfg.transfer.handle_ttl_s,
                    first_logprobs=out.first_logprobs.to_list() if out.first_logprobs else None,
                ).signed(self.secret)
                log.debug("prefill %s: %d tokens in %.3fs", req.request_id, len(req.prompt_token_ids),
                          time.monotonic() - t0)
            elif out.finish_reason == "abort":
                return None
            queue = req.decode_queue or queue_name(req.model, "decode")
            if queue.startswith("farm.w.") and not self._direct_queue_alive(queue):
                queue = queue_name(req.model, "decode")  # the chosen decode worker vanished: any will do
            if self.publisher is not None:
                self._send_decode(req, handle, queue)
            return handle
        except Exception as e:  # noqa: BLE001 - whatever failed, the reader must hear of it, not wait 600 s
            log.exception("request %s: hand-over to decode failed", req.request_id)
            self.engine.release_held(req.request_id)
            self.streams.emit_once(req.request_id, req.reply_to, ErrorEvent(
                f"the prefill worker could not hand the request to decode ({type(e).__name__})",
                ErrorEvent.HANDOVER_FAILED))
            return None

    def _send_decode(self, req: GenerationRequest, handle: dict[str, Any] | None, queue: str) -> None:
        """Send the decode task, again while Redis does not take it, for up to HANDOVER_SEND_S."""
        give_up = time.monotonic() + HANDOVER_SEND_S
        pause = 0.05
        while True:
            try:
                send_generation(cast(TaskPublisher, self.publisher), TASK_DECODE, [req.to_dict(), handle], queue)
                return
            except redis.RedisError:
                if time.monotonic() + pause > give_up:
                    raise
                log.warning("request %s: Redis did not take the decode task; sending it again", req.request_id)
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

    def _direct_queue_alive(self, queue: str) -> bool:
        return any(direct_queue(w.worker_id) == queue for w in registry.live_workers(self.r, model=self.model))

    def decode(self, req: GenerationRequest, handle: dict[str, Any] | None) -> None:
        """Pull the handle's blocks (or prefill locally if that fails) and decode in the batch. A handle whose
        blocks this decode will not pull (its request was cancelled or orphaned before it started, the pull
        failed) is given back to its prefill worker at once."""
        verdict = self._admission(req, "decode")
        if verdict != "ok":
            if verdict in ("cancelled", "orphaned") and _built_in_handle(handle):  # "claimed": another pulls it
                self._send_release(req, cast(dict, handle), verdict)
            return
        self.streams.open(req.request_id, req.reply_to, req.lease_s)
        kv_import = None
        prefill_worker, mode, cached = self.worker_id, "local", None
        pull: dict[str, Any] = {}
        if handle:
            try:
                check_bound(handle, request_id=req.request_id, prompt_ids=req.prompt_token_ids,
                            block_size=self.block_size, cache_salt=req.cache_salt)
            except HandleError as e:
                log.warning("request %s: KV handle refused (%s); prefilling locally", req.request_id, e)
                handle = None
        if handle and handle.get("kv_transfer_params") is not None:  # vLLM prefill: its connector pulls
            kv_import = connector_import(self.engine, handle, self.secret)
            if kv_import is not None:
                prefill_worker, mode, cached = handle["worker_id"], "remote", int(handle["cached_tokens"])
        elif handle:
            try:
                runner = getattr(self.engine, "runner", None)  # the built-in engine's; vLLM's imports through its connector
                if runner is None or handle.get("layout") != runner.layout.to_dict():  # before any connection
                    raise TransferError("KV layout (layers, heads, dtype, block size) differs from this worker's")
                with task_context.pull_span(handle, pull):  # tracing on: a span around the pull
                    data = fetch_blocks(handle, self.secret, timeout=self.cfg.transfer.pull_timeout_s,
                                        allow_shm="shm" in self.cfg.transfer.transports,
                                        nixl_name=f"{self.worker_id}-pull" if self.nixl else None,
                                        device=runner.device, info=pull, staging=self.staging)
                # only a TCP pull's buffer is the staging pool's: a shared-memory or NIXL one given to the pool
                # would stay mapped there for good (the pool keeps up to 1 GiB of what it is given)
                kv_import = KVImport(data, int(handle["num_tokens"]), int(handle["first_token"]),
                                     release=self.staging.release if pull.get("transport") == "tcp" else None,
                                     first_logprobs=TokenLogprobs.from_list(handle.get("first_logprobs")))
                prefill_worker, mode, cached = handle["worker_id"], "remote", int(handle["cached_tokens"])
            except TransferError as e:
                log.warning("request %s: KV pull failed (%s); prefilling locally", req.request_id, e)
                self._send_release(req, handle, "pull failed")
        self.streams.emit(req.request_id, StartEvent("decode", self.worker_id, prefill_worker, mode,
                                                     pull if mode == "remote" else None))
        self._submit(req, lambda out: self._finish_event(req, out, prefill_worker, mode, cached), kv_import=kv_import)


def _built_in_handle(handle: Any) -> bool:
    """A handle of the built-in engine's blocks, which its prefill worker holds until pulled (vLLM's connector
    frees its own on its timeout)."""
    return isinstance(handle, dict) and handle.get("kv_transfer_params") is None and "worker_id" in handle


class _TaskSlot:
    def __init__(self, rt: WorkerRuntime):
        self.rt = rt

    def __enter__(self) -> None:
        with self.rt._count_lock:
            self.rt.tasks_running += 1

    def __exit__(self, *exc: object) -> None:
        with self.rt._count_lock:
            self.rt.tasks_running -= 1


_runtime: WorkerRuntime | None = None


def _log_finished(role: str, out: RequestOutput, seconds: float) -> None:
    """A worker's one INFO line per request, when the engine is done with it, in the request's log context (id,
    model, trace id; farm.infra.logcontext). Celery's own per-task lines are off at INFO (tasks/worker.py): they
    came when the request entered the engine and said nothing of how it went."""
    log.info("request %s %s in %.3f s: %s, %d prompt tokens (%d cached), %d generated", out.request_id,
             "prefilled" if role == "prefill" else "finished", seconds, out.finish_reason or "stop",
             out.prompt_tokens, out.cached_tokens, out.completion_tokens)


def set_runtime(rt: WorkerRuntime | None) -> None:
    global _runtime
    _runtime = rt


def get_runtime() -> WorkerRuntime:
    if _runtime is None:
        raise RuntimeError("this process has no worker runtime (not started through tasks.worker)")
    return _runtime
