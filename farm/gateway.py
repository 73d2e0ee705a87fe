"""The API's door into the farm: route a request to workers and read its token stream.

Layout per model, from the live worker registry:
- prefill and decode workers present -> disaggregated: the router picks the prefill worker by KV
  overlap and load and the decode worker by decode load; the prefill task computes the prompt's KV,
  emits a signed KV handle and hands the decode task to the chosen decode worker's queue;
- otherwise aggregated workers (`both`) -> one generate task on the worker the router picks;
- decode workers alone -> the decode task prefills locally.
Tasks go to the chosen worker's own queue. While a reader iterates `events`, it checks the workers that
hold the request (farm.reliability.worker_gone); one that died before starting it or mid-stream makes
the request migrate to another worker with the tokens streamed so far (Submission). Load is recorded in
Redis as the request moves (placed -> prefilled -> done) so every API replica sees the same load.
Events come back on the request's Redis Stream (farm.protocol) and are read here with XREAD.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from farm import metrics, registry, reliability
from farm.config import FarmConfig
from farm.protocol import (
    CANCEL_TTL_S,
    EVENT_FIELD,
    TASK_DECODE,
    TASK_GENERATE,
    TASK_PREFILL,
    GenerationRequest,
    SamplingParams,
    cancel_key,
    lease_key,
    migration_id,
    queue_name,
    stream_key,
)
from farm.protocol.keys import OBS_STREAM
from farm.protocol.queues import direct_queue
from farm.router.router import BusyError, Placement, Router
from farm.tokenization import IncrementalDetokenizer, get_tokenizer

log = logging.getLogger(__name__)

OBS_MAXLEN = 20_000

__all__ = ["BusyError", "ClientGone", "Gateway", "GatewayTimeout", "NoWorkersError", "Submission"]


class NoWorkersError(RuntimeError):
    """No live worker serves the model: the API answers 503."""


class ClientGone(ConnectionError):
    """The reader's client went away while it waited: the caller cancels the request (Submission.cancel)."""


class GatewayTimeout(TimeoutError):
    """No progress from the workers within the configured time: the API answers 504."""


@dataclass
class Dispatch:
    """A task sent to one worker's queue, and where to re-send it if that worker vanishes."""

    task: str
    args: list[Any]
    worker_id: str
    fallback_queue: str


class Submission:
    """One request in flight: iterate its events, or cancel it.

    While it reads, it holds the request's lease (workers abort a leased request nobody reads) and checks
    every `reliability.check_interval_s` that the workers serving the request are alive. When one died
    mid-request, the request migrates (`_migrate`): a new attempt `<id>.m<n>` with the prompt plus the
    tokens already streamed and `max_tokens` reduced, placed on another worker; its events continue the
    same client stream, with usage counted as if nothing happened.
    """

    def __init__(self, gw: Gateway, req: GenerationRequest, layout: str, placements: dict[str, Placement],
                 dispatch: Dispatch):
        self.gw = gw
        self.req = req
        self.request_id = req.request_id
        self.layout = layout
        self.placements = placements
        self.dispatch = dispatch
        self.attempt_id = req.request_id  # the request id the workers see now (changes on migration)
        self.migrations = 0
        self._last_id = "0-0"
        self._seen: dict[str, int] = {}  # stream writer -> last event sequence read
        self.finished = False
        self._started = False
        self._loads: list[tuple[str, str, str]] = []  # (kind, worker, request id) not yet ended
        self._open_loads(placements, req.request_id)
        self._t0 = time.monotonic()
        self.ttft_s: float | None = None
        self._last_delta: float | None = None
        self._itl_sum, self._itl_n = 0.0, 0
        self._ids: list[int] = []  # token ids streamed to the reader, across attempts
        self._text = ""  # their text, as streamed
        self._carried = 0  # tokens of _ids that are part of the current attempt's prompt
        self._boundary = None  # detokenizer that renders the first text after a migration
        self._stage: dict[str, str] = {}  # stage -> worker that serves it now (from start events)
        self._lost: set[str] = set()
        self._info: dict[str, registry.WorkerInfo] = {p.worker.worker_id: p.worker for p in placements.values()}
        self._lease_at = time.monotonic()
        self._placed_at = time.monotonic()

    @property
    def predicted_overlap_tokens(self) -> int:
        p = self.placements.get("prefill") or self.placements.get("both")
        return p.overlap_blocks * self.gw.cfg.block_size(self.req.model) if p else 0

    @property
    def router_mode(self) -> str:
        return self.gw.cfg.router.mode

    def _open_loads(self, placements: dict[str, Placement], rid: str) -> None:
        p = placements.get("prefill") or placements.get("both")
        d = placements.get("decode") or placements.get("both")
        if p is not None:
            self._loads.append(("p", p.worker.worker_id, rid))
        if d is not None:
            self._loads.append(("d", d.worker.worker_id, rid))

    def _end_load(self, kind: str) -> None:
        for load in [x for x in self._loads if x[0] == kind]:
            self._loads.remove(load)
            try:
                self.gw.router.loads.end(kind, load[1], load[2])
            except redis.RedisError:
                pass  # the deadline reaper ends it later

    def _refresh_lease(self, force: bool = False) -> None:
        ttl = self.gw.cfg.reliability.lease_ttl_s
        now = time.monotonic()
        if force or now - self._lease_at >= ttl / 4:
            self.gw.r.set(lease_key(self.attempt_id), "1", ex=max(1, math.ceil(ttl)))
            self._lease_at = now

    def _watched(self) -> list[str]:
        """Workers whose death loses this request now: before any event the one whose queue holds it."""
        if not self._started:
            waited = time.monotonic() - self._placed_at >= self.gw.cfg.router.placement_timeout_s
            return [self.dispatch.worker_id] if self.dispatch.worker_id and waited else []
        if "decode" in self._stage:
            return [self._stage["decode"]]
        out = [self._stage["prefill"]] if "prefill" in self._stage else []
        d = self.placements.get("decode")
        if d is not None:
            out.append(d.worker.worker_id)
        return out

    def _lost_worker(self) -> str | None:
        for wid in self._watched():
            if wid in self._lost or reliability.worker_gone(self.gw.r, wid, self._info.get(wid)):
                return wid
        return None

    def _clean_prefix(self) -> int:
        """How many streamed tokens to carry over: all whose text the reader already has (a multi-byte
        character still held back by the dead worker's detokenizer is generated again)."""
        n = len(self._ids)
        try:
            tok = get_tokenizer(self.gw.cfg, self.req.model)
        except Exception:  # noqa: BLE001 - no tokenizer here: carry everything
            return n
        for k in range(n, max(-1, n - 8), -1):
            if tok.decode(self._ids[:k], skip_special_tokens=True) == self._text:
                self._boundary = IncrementalDetokenizer(tok)
                self._boundary.ids, self._boundary.text = list(self._ids[:k]), self._text
                return k
        return n

    def _migrate(self, lost: str) -> dict[str, Any] | None:
        """Move the request off `lost`; returns the event that ends the stream instead, if any."""
        rcfg = self.gw.cfg.reliability
        self._lost.add(lost)
        old = self.attempt_id
        try:
            pipe = self.gw.r.pipeline(transaction=False)
            pipe.set(cancel_key(old), "1", ex=CANCEL_TTL_S)  # if it was only slow, it stops now
            pipe.delete(lease_key(old), stream_key(old))
            pipe.execute()
        except redis.RedisError:
            pass
        self._end_load("p")
        self._end_load("d")
        if self.migrations >= rcfg.max_migrations:
            metrics.MIGRATIONS.labels(outcome="limit").inc()
            return {"type": "error", "code": "worker_lost",
                    "message": f"worker {lost} was lost and the request already moved {self.migrations} "
                               f"times (reliability.max_migrations)"}
        self.migrations += 1
        k = self._clean_prefix()
        del self._ids[k:]
        self._carried = k
        orig = self.req
        left = orig.sampling.max_tokens - k
        if left <= 0:  # everything was generated, only the done event was lost
            metrics.MIGRATIONS.labels(outcome="finished").inc()
            return {"type": "done", "finish_reason": "length", "migrations": self.migrations,
                    "usage": {"prompt_tokens": len(orig.prompt_token_ids), "completion_tokens": k,
                              "cached_tokens": 0}}
        sampling = SamplingParams.from_dict({**orig.sampling.to_dict(), "max_tokens": left})
        req = GenerationRequest(migration_id(orig.request_id, self.migrations), orig.model,
                                orig.prompt_token_ids + self._ids, sampling, created=orig.created,
                                lease_s=orig.lease_s, origin=orig.request_id)
        log.warning("request %s: worker %s lost after %d tokens; migrating as %s", orig.request_id, lost, k,
                    req.request_id)
        deadline = time.monotonic() + rcfg.migration_wait_s
        while True:
            try:
                self.attempt_id = req.request_id
                self._refresh_lease(force=True)
                _layout, placements, dispatch = self.gw._place(req, exclude=self._lost)
                break
            except (NoWorkersError, BusyError, redis.RedisError) as e:
                if time.monotonic() >= deadline:
                    metrics.MIGRATIONS.labels(outcome="no_worker").inc()
                    return {"type": "error", "code": "worker_lost",
                            "message": f"worker {lost} was lost and no other worker took the request: {e}"}
                time.sleep(rcfg.check_interval_s)
        metrics.MIGRATIONS.labels(outcome="migrated").inc()
        self.placements, self.dispatch = placements, dispatch
        self._info.update({p.worker.worker_id: p.worker for p in placements.values()})
        self._open_loads(placements, req.request_id)
        self._started, self._stage, self._last_id = False, {}, "0-0"
        self._placed_at = time.monotonic()
        return None

    def _on_event(self, ev: dict[str, Any]) -> None:
        """Book-keeping of one event of the current attempt, before the reader sees it."""
        kind = ev.get("type")
        if kind == "start" and ev.get("worker"):
            self._stage["prefill" if ev.get("role") == "prefill" else "decode"] = ev["worker"]
        elif kind == "delta":
            if self._boundary is not None:  # first text after a migration: render it after the carried text
                ev["text"] = self._boundary.add(list(ev.get("ids") or []))
                if ev["text"]:
                    self._boundary = None
            self._ids.extend(ev.get("ids") or [])
            self._text += ev.get("text", "")
        elif kind == "done" and self.migrations:
            usage = dict(ev.get("usage") or {})
            n_prompt = len(self.req.prompt_token_ids)
            usage["prompt_tokens"] = n_prompt
            usage["completion_tokens"] = int(usage.get("completion_tokens", 0)) + self._carried
            usage["cached_tokens"] = min(int(usage.get("cached_tokens", 0)), n_prompt)
            ev["usage"] = usage
            ev["migrations"] = self.migrations

    def events(self, first_timeout_s: float | None = None, idle_timeout_s: float | None = None,
               client_gone: Callable[[], bool] | None = None) -> Iterator[dict[str, Any]]:
        """Yield stream events in order until `done` or `error`; raise GatewayTimeout on silence.

        A Redis restart while reading is waited out (the deadline still applies): workers keep their
        tokens until Redis is back, and XREAD resumes from the last id seen. `client_gone` is asked every
        `reliability.check_interval_s`, also while nothing arrives (queued, or a non-streaming answer
        being collected); when it says so, ClientGone is raised."""
        cfg = self.gw.cfg
        first = first_timeout_s if first_timeout_s is not None else cfg.api.first_event_timeout_s
        idle = idle_timeout_s if idle_timeout_s is not None else cfg.api.request_timeout_s
        got_any = False
        deadline = time.monotonic() + first
        next_check = 0.0
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise GatewayTimeout(
                    f"no {'progress' if got_any else 'response'} from workers within "
                    f"{idle if got_any else first:.0f}s"
                )
            try:
                if now >= next_check:
                    next_check = now + cfg.reliability.check_interval_s
                    if client_gone is not None and client_gone():
                        raise ClientGone(f"request {self.request_id}: the client closed its connection")
                    self._refresh_lease()
                    lost = self._lost_worker()
                    if lost is not None:
                        end = self._migrate(lost)
                        if end is not None:
                            yield from self._finish(end)
                            return
                        deadline = time.monotonic() + first
                        continue
                block_ms = int(min(remaining, cfg.reliability.check_interval_s, 1.0) * 1000) or 1
                resp = self.gw.r.xread({stream_key(self.attempt_id): self._last_id}, count=256, block=block_ms)
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.25)  # Redis restarting: keep waiting until the deadline
                continue
            if not resp:
                continue
            for _key, entries in resp:
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    ev = json.loads(fields.get(EVENT_FIELD.encode()) or fields.get(EVENT_FIELD))
                    writer, seq = ev.pop("w", None), ev.pop("s", 0)
                    if writer is not None:  # a writer that retried after a Redis error may repeat events
                        if seq <= self._seen.get(writer, 0):
                            continue
                        self._seen[writer] = seq
                    got_any = self._started = True
                    deadline = time.monotonic() + idle
                    self._on_event(ev)
                    kind = ev.get("type")
                    if kind == "delta" or (kind == "start" and ev.get("role") == "decode"):
                        self._end_load("p")
                    if kind == "delta" and ev.get("n"):
                        self._observe_delta(ev["n"])
                    if kind in ("done", "error"):
                        yield from self._finish(ev)
                        return
                    yield ev

    def _finish(self, ev: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self.finished = True
        self._end_load("p")
        self._end_load("d")
        if ev.get("type") == "done":
            metrics.record_usage(self.req.model, ev.get("usage", {}), ev.get("prefill"))
            self._record_observation(ev)
        try:
            self.gw.r.delete(stream_key(self.attempt_id), lease_key(self.attempt_id))
        except redis.RedisError:
            pass  # both expire
        yield ev

    def _observe_delta(self, n: int) -> None:
        now = time.monotonic()
        if self.ttft_s is None:
            self.ttft_s = now - self._t0
        elif self._last_delta is not None:
            self._itl_sum += now - self._last_delta
            self._itl_n += n
        self._last_delta = now

    @property
    def itl_s(self) -> float | None:
        return self._itl_sum / self._itl_n if self._itl_n else None

    def _record_observation(self, done: dict[str, Any]) -> None:
        """What the planner plans from: observed latency and request sizes, in a capped stream."""
        usage = done.get("usage", {})
        obs = {"model": self.req.model, "ts": time.time(), "ttft": self.ttft_s or 0.0, "itl": self.itl_s or 0.0,
               "isl": usage.get("prompt_tokens", 0), "osl": usage.get("completion_tokens", 0),
               "prefill": done.get("prefill", "")}
        metrics.observe_latency(self.req.model, self.ttft_s, self.itl_s, time.monotonic() - self._t0)
        try:
            self.gw.r.xadd(OBS_STREAM, {"o": json.dumps(obs)}, maxlen=OBS_MAXLEN, approximate=True)
        except redis.RedisError:
            pass

    def cancel(self) -> None:
        """Tell the workers to stop generating (client gone); idempotent."""
        if not self.finished:
            pipe = self.gw.r.pipeline(transaction=False)
            for rid in {self.request_id, self.attempt_id}:
                pipe.set(cancel_key(rid), "1", ex=CANCEL_TTL_S)
            pipe.delete(lease_key(self.attempt_id))
            pipe.execute()
            self._end_load("p")
            self._end_load("d")


class Gateway:
    def __init__(self, cfg: FarmConfig, r: redis.Redis, celery_app=None, router: Router | None = None):
        self.cfg = cfg
        self.r = r
        if celery_app is None:
            from farm.broker import make_celery

            celery_app = make_celery(cfg)
        self.celery = celery_app
        self.router = router or Router(cfg, r)

    def _workers(self, model: str, exclude: set[str] | frozenset[str] = frozenset()) -> dict[str, list[registry.WorkerInfo]]:
        by_role: dict[str, list[registry.WorkerInfo]] = {"prefill": [], "decode": [], "both": []}
        for w in registry.live_workers(self.r, model=model):
            if w.worker_id not in exclude:  # e.g. just died, its heartbeat not yet lapsed
                by_role.setdefault(w.role, []).append(w)
        return by_role

    @staticmethod
    def _pools(by_role: dict[str, list[registry.WorkerInfo]]) -> tuple[list, list]:
        """(prefill workers, workers that can decode: decode workers, else aggregated ones)."""
        return by_role["prefill"], by_role["decode"] or by_role["both"]

    def layout(self, model: str, exclude: set[str] | frozenset[str] = frozenset()) -> str:
        """How `model` is served now; raises NoWorkersError when nothing can serve it. With `exclude`
        (re-placing a request whose worker died) decode workers prefill locally when no prefill worker is
        left, even in mode `always`: finishing the request beats refusing it."""
        prefill, decode = self._pools(self._workers(model, exclude))
        mode = self.cfg.disaggregation.mode
        if not decode or (mode == "always" and not prefill and not exclude):
            raise NoWorkersError(self._no_workers_message(model, prefill, decode))
        if prefill and mode != "never":
            return "disaggregated" if mode == "always" else "conditional"
        return "aggregated" if decode[0].role == "both" else "decode-only"

    def _no_workers_message(self, model: str, prefill: list, decode: list) -> str:
        if decode and not prefill:
            return f"disaggregation.mode is 'always' but no prefill worker serves model {model!r}"
        return f"no live worker serves model {model!r}"

    def submit(self, req: GenerationRequest) -> Submission:
        """Route and enqueue; raises NoWorkersError (no worker) or BusyError (every worker busy)."""
        req.lease_s = self.cfg.reliability.lease_ttl_s
        layout, placements, dispatch = self._place(req)
        return Submission(self, req, layout, placements, dispatch)

    def _place(self, req: GenerationRequest, exclude: set[str] | frozenset[str] = frozenset()
               ) -> tuple[str, dict[str, Placement], Dispatch]:
        """Choose workers for `req`, record their load, take its lease and send its first task."""
        layout = self.layout(req.model, exclude)
        prefill_pool, decode_pool = self._pools(self._workers(req.model, exclude))
        req.created = req.created or time.time()
        t0 = time.perf_counter()
        hashes = self.router.hashes(req.prompt_token_ids, req.model)
        metrics.ROUTING_STAGE_SECONDS.labels(stage="hash").observe(time.perf_counter() - t0)
        loads = self.router.loads.loads()
        n = len(req.prompt_token_ids)
        bs = self.cfg.block_size(req.model)
        dcfg = self.cfg.disaggregation
        placements: dict[str, Placement] = {}
        remote = False
        if layout == "disaggregated":
            d = self.router.choose(decode_pool, hashes, n, "decode", loads)
            p = self.router.choose(prefill_pool, hashes, n, "prefill", loads)
            remote = True
        else:
            # the decode worker may prefill itself: weigh its cached prefix as well as its load
            d = self.router.choose(decode_pool, hashes, n, "both", loads)
            p = d
            if layout == "conditional":
                uncached = n - d.overlap_blocks * bs
                if uncached > dcfg.remote_min_uncached_tokens:
                    cand = self.router.choose(prefill_pool, hashes, n, "prefill", loads)
                    queued = (loads.get(cand.worker.worker_id) or {}).get("pn", 0)
                    if queued < dcfg.max_prefill_queue:
                        p, remote = cand, True
        if remote:
            placements["prefill"], placements["decode"] = p, d
            req.decode_queue = direct_queue(d.worker.worker_id)
            task, args, fallback = TASK_PREFILL, [req.to_dict()], queue_name(req.model, "prefill")
        else:
            placements["both"] = d
            if d.worker.role == "both":
                task, args, fallback = TASK_GENERATE, [req.to_dict()], queue_name(req.model, "generate")
            else:
                task, args, fallback = TASK_DECODE, [req.to_dict(), None], queue_name(req.model, "decode")
        self.router.loads.begin("p", p.worker.worker_id, req.request_id, max(0, n - p.overlap_blocks * bs))
        self.router.loads.begin("d", d.worker.worker_id, req.request_id, math.ceil(n / bs))
        if req.lease_s > 0:  # before the task: a worker skips a leased request whose lease is missing
            self.r.set(lease_key(req.request_id), "1", ex=max(1, math.ceil(req.lease_s)))
        self.celery.send_task(task, args=args, queue=direct_queue(p.worker.worker_id))
        return layout, placements, Dispatch(task, args, p.worker.worker_id, fallback)
