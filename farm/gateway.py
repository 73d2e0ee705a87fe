"""The API's door into the farm: route a request to workers and read its token stream.

Layout per model, from the live worker registry:
- prefill and decode workers present -> disaggregated: the router picks the prefill worker by KV
  overlap and load and the decode worker by decode load; the prefill task computes the prompt's KV,
  emits a signed KV handle and hands the decode task to the chosen decode worker's queue;
- otherwise aggregated workers (`both`) -> one generate task on the worker the router picks;
- decode workers alone -> the decode task prefills locally.
Tasks go to the chosen worker's own queue; if that worker vanishes before starting, the task is re-sent
to the model's shared queue (workers claim each stage, so it never runs twice). Load is recorded in
Redis as the request moves (placed -> prefilled -> done) so every API replica sees the same load.
Events come back on the request's Redis Stream (farm.protocol) and are read here with XREAD.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

from farm import metrics, registry
from farm.config import FarmConfig
from farm.protocol import (
    CANCEL_TTL_S,
    EVENT_FIELD,
    TASK_DECODE,
    TASK_GENERATE,
    TASK_PREFILL,
    GenerationRequest,
    cancel_key,
    queue_name,
    stream_key,
)
from farm.router.keys import direct_queue
from farm.router.router import BusyError, Placement, Router

log = logging.getLogger(__name__)

OBS_STREAM = "farm:obs"  # one entry per finished request: ttft, itl, isl, osl (read by the planner)
OBS_MAXLEN = 20_000

__all__ = ["BusyError", "Gateway", "GatewayTimeout", "NoWorkersError", "Submission"]


class NoWorkersError(RuntimeError):
    """No live worker serves the model: the API answers 503."""


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
    """One request in flight: iterate its events, or cancel it."""

    def __init__(self, gw: Gateway, req: GenerationRequest, layout: str, placements: dict[str, Placement],
                 dispatch: Dispatch):
        self.gw = gw
        self.req = req
        self.request_id = req.request_id
        self.layout = layout
        self.placements = placements
        self.dispatch = dispatch
        self._last_id = "0-0"
        self.finished = False
        self._started = False
        self._loads_open = {"p", "d"}
        self._t0 = time.monotonic()
        self.ttft_s: float | None = None
        self._last_delta: float | None = None
        self._itl_sum, self._itl_n = 0.0, 0

    @property
    def predicted_overlap_tokens(self) -> int:
        p = self.placements.get("prefill") or self.placements.get("both")
        return p.overlap_blocks * self.gw.cfg.engine.block_size if p else 0

    @property
    def router_mode(self) -> str:
        return self.gw.cfg.router.mode

    def _end_load(self, kind: str) -> None:
        if kind not in self._loads_open:
            return
        self._loads_open.discard(kind)
        stage = "decode" if kind == "d" else ("prefill" if "prefill" in self.placements else "both")
        p = self.placements.get(stage) or self.placements.get("both")
        if p is not None:
            try:
                self.gw.router.loads.end(kind, p.worker.worker_id, self.request_id)
            except redis.RedisError:
                pass  # the deadline reaper ends it later

    def _resend_if_vanished(self) -> None:
        d = self.dispatch
        if self._started or d.worker_id == "":
            return
        if not self.gw.r.exists(registry.alive_key(d.worker_id)):
            log.warning("request %s: worker %s vanished before starting it; re-sending to %s",
                        self.request_id, d.worker_id, d.fallback_queue)
            self.gw.celery.send_task(d.task, args=d.args, queue=d.fallback_queue)
            d.worker_id = ""

    def events(self, first_timeout_s: float | None = None, idle_timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield stream events in order until `done` or `error`; raise GatewayTimeout on silence."""
        cfg = self.gw.cfg
        first = first_timeout_s if first_timeout_s is not None else cfg.api.first_event_timeout_s
        idle = idle_timeout_s if idle_timeout_s is not None else cfg.api.request_timeout_s
        key = stream_key(self.request_id)
        got_any = False
        deadline = time.monotonic() + first
        next_check = time.monotonic() + cfg.router.placement_timeout_s
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise GatewayTimeout(
                    f"no {'progress' if got_any else 'response'} from workers within "
                    f"{idle if got_any else first:.0f}s"
                )
            if not self._started and now >= next_check:
                self._resend_if_vanished()
                next_check = now + cfg.router.placement_timeout_s
            block_ms = int(min(remaining, 1.0) * 1000) or 1
            resp = self.gw.r.xread({key: self._last_id}, count=256, block=block_ms)
            if not resp:
                continue
            for _key, entries in resp:
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    ev = json.loads(fields.get(EVENT_FIELD.encode()) or fields.get(EVENT_FIELD))
                    got_any = self._started = True
                    deadline = time.monotonic() + idle
                    kind = ev.get("type")
                    if kind == "delta" or (kind == "start" and ev.get("role") == "decode"):
                        self._end_load("p")
                    if kind == "delta" and ev.get("n"):
                        self._observe_delta(ev["n"])
                    if kind in ("done", "error"):
                        self.finished = True
                        self._end_load("p")
                        self._end_load("d")
                        if kind == "done":
                            metrics.record_usage(self.req.model, ev.get("usage", {}), ev.get("prefill"))
                            self._record_observation(ev)
                        self.gw.r.delete(key)
                    yield ev
                    if self.finished:
                        return

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
            self.gw.r.set(cancel_key(self.request_id), "1", ex=CANCEL_TTL_S)
            self._end_load("p")
            self._end_load("d")


class Gateway:
    def __init__(self, cfg: FarmConfig, r: redis.Redis, celery_app=None, router: Router | None = None):
        self.cfg = cfg
        self.r = r
        if celery_app is None:
            from tasks.celery_app import make_celery

            celery_app = make_celery(cfg)
        self.celery = celery_app
        self.router = router or Router(cfg, r)

    def _workers(self, model: str) -> dict[str, list[registry.WorkerInfo]]:
        by_role: dict[str, list[registry.WorkerInfo]] = {"prefill": [], "decode": [], "both": []}
        for w in registry.live_workers(self.r, model=model):
            by_role.setdefault(w.role, []).append(w)
        return by_role

    @staticmethod
    def _pools(by_role: dict[str, list[registry.WorkerInfo]]) -> tuple[list, list]:
        """(prefill workers, workers that can decode: decode workers, else aggregated ones)."""
        return by_role["prefill"], by_role["decode"] or by_role["both"]

    def layout(self, model: str) -> str:
        """How `model` is served now; raises NoWorkersError when nothing can serve it."""
        prefill, decode = self._pools(self._workers(model))
        mode = self.cfg.disaggregation.mode
        if not decode or (mode == "always" and not prefill):
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
        layout = self.layout(req.model)
        prefill_pool, decode_pool = self._pools(self._workers(req.model))
        req.created = req.created or time.time()
        t0 = time.perf_counter()
        hashes = self.router.hashes(req.prompt_token_ids)
        metrics.ROUTING_STAGE_SECONDS.labels(stage="hash").observe(time.perf_counter() - t0)
        loads = self.router.loads.loads()
        n = len(req.prompt_token_ids)
        bs = self.cfg.engine.block_size
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
        self.celery.send_task(task, args=args, queue=direct_queue(p.worker.worker_id))
        return Submission(self, req, layout, placements, Dispatch(task, args, p.worker.worker_id, fallback))
