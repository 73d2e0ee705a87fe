"""A worker process's runtime: one engine, its transfer server, stream writer and registry heartbeat.

Celery task threads call `prefill`, `decode` and `generate`; each submits to the shared engine (so all
requests of the process share one continuous batch) and blocks until its request is finished, which is
when Celery acknowledges the message (acks_late).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import redis

from farm import registry
from farm.backends import connector_import, make_engine
from farm.config import FarmConfig, farm_secret
from farm.engine.engine import RequestOutput
from farm.engine.sampling import TokenLogprobs
from farm.engine.scheduler import KVImport
from farm.models import model_vocab_size, require_model_dir
from farm.protocol import (
    TASK_DECODE,
    TASK_PING,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    InvalidTask,
    Role,
    StartEvent,
    cancel_key,
    claim_key,
    direct_queue,
    is_request_id,
    lease_key,
    queue_name,
    queues_for_role,
)
from farm.redis_client import connect
from farm.reliability import WorkerGuard, ping_key
from farm.router.events import KVEventPublisher
from farm.streams import StreamWriter
from farm.transfer.handle import KVHandle
from farm.transfer.shm import host_id as shm_host_id
from farm.transfer.staging import StagingPool
from farm.transfer.tcp import TransferError, TransferServer, checksum, fetch_blocks

log = logging.getLogger(__name__)


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
        self._check_block_size()
        self.kv_events = KVEventPublisher(self.r, worker_id)
        self.engine = make_engine(cfg, mcfg, mdir, self.kv_events, worker_id=worker_id, role=role)  # builtin | vllm
        ha = cfg.redis.ha
        self.streams = StreamWriter(self.r, cfg.engine.stream_flush_ms, self.engine.active_request_ids,
                                    self.engine.abort, replica_ack_ms=ha.replica_ack_timeout_ms if ha.enabled else 0)
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
            block_size=self.block_size,
            transfer_endpoint=f"{cfg.transfer.advertise_host}:{self.transfer.port}",
            queues=queues_for_role(model, role) + [direct_queue(worker_id)], device=str(self.engine.runner.device),
            num_blocks=self.engine.pool.num_blocks,
        )
        self.heartbeat = registry.Heartbeat(self.r, self.info, self.engine.stats)
        self.concurrency = cfg.celery.worker_threads  # tasks.worker sets the real --concurrency
        self.inflight = 0  # generation tasks running now (the watchdog tells a stall from a full pool)
        self._inflight_lock = threading.Lock()
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

    def stop(self) -> None:
        if not self.heartbeat.is_alive():
            return  # never started (Celery stopped before it was ready)
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
        try:
            self.heartbeat.drain()
        except redis.RedisError:
            pass
        log.info("worker %s draining: %d requests in flight", self.worker_id, self.inflight)

    def busy(self) -> bool:
        return self.inflight >= self.concurrency - 1

    def send_ping(self, token: str) -> None:
        """The consumer watchdog's probe (farm.reliability.WorkerGuard): a task through our own queue."""
        if self.celery is not None:
            self.celery.send_task(TASK_PING, args=[self.worker_id, token], queue=direct_queue(self.worker_id))

    def pong(self, token: str) -> None:
        self.r.set(ping_key(self.worker_id), token, ex=300)

    # -- helpers ------------------------------------------------------------------------------------
    def _check_held(self, handle: dict[str, Any]) -> None:
        rid = handle["request_id"]
        held = self.engine.held.get(rid)
        if held is None or held.seq.block_table != handle["block_ids"]:
            raise TransferError(f"no blocks held for request {rid} (expired or already pulled)")

    def _run(self, req: GenerationRequest, on_done, **submit_kw) -> RequestOutput:
        """Submit to the engine, stream deltas, and block until the request finishes."""
        done = threading.Event()
        result: dict[str, RequestOutput] = {}

        def on_output(out: RequestOutput) -> None:
            if out.text or (out.token_ids and not out.finished):
                lp = [x.to_list() for x in out.logprobs] if out.logprobs else None
                self.streams.emit(req.request_id, DeltaEvent(out.text, len(out.token_ids), out.token_ids, lp).to_dict())
            if out.finished:
                result["out"] = out
                on_done(out)
                done.set()

        if req.lease_s > 0:  # the API that reads this request died -> abort it (no orphan work)
            self.streams.watch_lease(req.request_id, req.lease_s)
        with self._inflight_lock:
            self.inflight += 1
        try:
            self.engine.submit(req.request_id, req.prompt_token_ids, req.sampling, on_output,
                               max_request_s=self.cfg.celery.max_request_s, **submit_kw)
            if not done.wait(self.cfg.celery.max_request_s + 30):
                self.engine.abort(req.request_id)
                done.wait(10)
        finally:
            with self._inflight_lock:
                self.inflight -= 1
            self.streams.unwatch_lease(req.request_id)
        return result.get("out") or RequestOutput(req.request_id, finished=True, finish_reason="error:timeout")

    def _finish_event(self, req: GenerationRequest, out: RequestOutput, prefill_worker: str, mode: str,
                      cached_tokens: int | None = None) -> None:
        reason = out.finish_reason or "stop"
        if reason.startswith("error:"):
            self.streams.emit(req.request_id, ErrorEvent(reason[6:], "engine_error").to_dict())
            return
        usage = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                 "cached_tokens": out.cached_tokens if cached_tokens is None else cached_tokens}
        self.streams.emit(req.request_id, DoneEvent(reason, usage, prefill_worker, self.worker_id, mode).to_dict())

    def _should_skip(self, request_id: str, stage: str, lease_s: float = 0.0) -> bool:
        """Skip a request whose client is gone, whose reader's lease lapsed (a redelivered message of a
        request migrated or abandoned long ago), or whose stage another worker already claimed (a task
        re-sent after its first worker vanished must not run twice)."""
        try:
            if self.r.exists(cancel_key(request_id)):
                return True
            if lease_s > 0 and not self.r.exists(lease_key(request_id)):
                log.warning("request %s: nobody reads it any more (lease gone); skipping", request_id)
                return True
            key, ttl = claim_key(request_id, stage), int(self.cfg.celery.visibility_timeout_s)
            if self.r.set(key, self.worker_id, nx=True, ex=ttl):
                return False
            holder = (self.r.get(key) or b"").decode()
            if holder and not self.r.exists(registry.alive_key(holder)):
                self.r.set(key, self.worker_id, ex=ttl)  # its worker died: redelivered, run it here
                return False
            return True
        except redis.RedisError:
            return False

    # -- tasks --------------------------------------------------------------------------------------
    def accept(self, message: Any, handle: Any = None) -> GenerationRequest | None:
        """A task's request message as untrusted input (farm.protocol.InvalidTask): the request, or None
        after failing only that request, with an `invalid_task` error event on its stream when its id is
        usable. A request for another model, or a handle that is not an object, is refused too."""
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
            log.warning("refused an invalid task (request %r): %s", str(rid)[:80], e)
            if is_request_id(rid):
                self.streams.emit(rid, ErrorEvent(f"invalid task: {e}", "invalid_task").to_dict())
            return None

    def generate(self, req: GenerationRequest) -> dict[str, Any]:
        """Aggregated: prefill and decode here."""
        if self._should_skip(req.request_id, "generate", req.lease_s):
            return {"finish_reason": "skipped"}
        self.streams.emit(req.request_id, StartEvent(self.role, self.worker_id, self.worker_id, "local").to_dict())
        out = self._run(req, lambda o: self._finish_event(req, o, self.worker_id, "local"))
        return {"finish_reason": out.finish_reason, "completion_tokens": out.completion_tokens}

    def prefill(self, req: GenerationRequest) -> dict[str, Any] | None:
        """Compute the prompt's KV, hold it, and pass a signed handle on to the decode queue."""
        if self._should_skip(req.request_id, "prefill", req.lease_s):
            return None
        self.streams.emit(req.request_id, StartEvent("prefill", self.worker_id).to_dict())
        t0 = time.monotonic()
        out = self._run(req, lambda o: None, prefill_only=True)
        handle = None
        if getattr(out, "kv_transfer_params", None) is not None:  # vLLM: its KV connector holds the blocks
            handle = self.engine.connector_handle(req, out, self.info.transfer_endpoint, shm_host_id(), self.secret)
        elif out.finish_reason == "prefilled" and out.held_blocks is not None:
            data = self.engine.runner.read_blocks(out.held_blocks)
            handle = KVHandle(
                request_id=req.request_id, worker_id=self.worker_id, endpoint=self.info.transfer_endpoint,
                host_id=shm_host_id(),
                transport=",".join(t for t in self.cfg.transfer.transports if t != "nixl" or self.nixl),
                block_ids=out.held_blocks, block_hashes=[str(h) for h in (out.block_hashes or [])],
                num_tokens=len(req.prompt_token_ids), first_token=out.first_token, cached_tokens=out.cached_tokens,
                layout=self.engine.runner.layout.to_dict(), checksum=checksum(data),
                expires_at=time.time() + self.cfg.transfer.handle_ttl_s,
                first_logprobs=out.first_logprobs.to_list() if out.first_logprobs else None,
            ).signed(self.secret)
            log.debug("prefill %s: %d tokens in %.3fs", req.request_id, len(req.prompt_token_ids),
                      time.monotonic() - t0)
        elif out.finish_reason == "abort":
            return None
        # Hand over to decode; with no handle (prefill failed) the decode worker prefills locally.
        queue = req.decode_queue or queue_name(req.model, "decode")
        if queue.startswith("farm.w.") and not self._direct_queue_alive(queue):
            queue = queue_name(req.model, "decode")  # the chosen decode worker vanished: any will do
        if self.celery is not None:
            self.celery.send_task(TASK_DECODE, args=[req.to_dict(), handle], queue=queue)
        return handle

    def _direct_queue_alive(self, queue: str) -> bool:
        return any(direct_queue(w.worker_id) == queue for w in registry.live_workers(self.r, model=self.model))

    def decode(self, req: GenerationRequest, handle: dict[str, Any] | None) -> dict[str, Any]:
        """Pull the handle's blocks (or prefill locally if that fails) and decode in the batch."""
        if self._should_skip(req.request_id, "decode", req.lease_s):
            return {"finish_reason": "skipped"}
        kv_import = None
        prefill_worker, mode, cached = self.worker_id, "local", None
        pull: dict[str, Any] = {}
        if handle and handle.get("kv_transfer_params") is not None:  # vLLM prefill: its connector pulls
            kv_import = connector_import(self.engine, handle, self.secret)
            if kv_import is not None:
                prefill_worker, mode, cached = handle["worker_id"], "remote", int(handle["cached_tokens"])
        elif handle:
            try:
                data = fetch_blocks(handle, self.secret, allow_shm="shm" in self.cfg.transfer.transports,
                                    nixl_name=f"{self.worker_id}-pull" if self.nixl else None,
                                    device=self.engine.runner.device, info=pull, staging=self.staging)
                if data.shape[3] != self.block_size:
                    raise TransferError("block size mismatch between prefill and decode workers")
                kv_import = KVImport(data, int(handle["num_tokens"]), int(handle["first_token"]),
                                     release=self.staging.release,
                                     first_logprobs=TokenLogprobs.from_list(handle.get("first_logprobs")))
                prefill_worker, mode, cached = handle["worker_id"], "remote", int(handle["cached_tokens"])
            except TransferError as e:
                log.warning("request %s: KV pull failed (%s); prefilling locally", req.request_id, e)
        start = StartEvent("decode", self.worker_id, prefill_worker, mode, pull if mode == "remote" else None)
        self.streams.emit(req.request_id, start.to_dict())
        out = self._run(req, lambda o: self._finish_event(req, o, prefill_worker, mode, cached),
                        kv_import=kv_import)
        return {"finish_reason": out.finish_reason, "completion_tokens": out.completion_tokens}


_runtime: WorkerRuntime | None = None


def set_runtime(rt: WorkerRuntime | None) -> None:
    global _runtime
    _runtime = rt


def get_runtime() -> WorkerRuntime:
    if _runtime is None:
        raise RuntimeError("this process has no worker runtime (not started through tasks.worker)")
    return _runtime
