"""Placing a request: the layout per model from the live workers, the router's choice, the tasks sent to the
chosen workers' queues; the Submission that reads it back."""

from __future__ import annotations

import logging
import math
import time

import redis

from farm import metrics, registry
from farm.config import FarmConfig
from farm.gateway.errors import NoWorkersError
from farm.gateway.submission import Dispatch, Submission
from farm.protocol import (
    TASK_DECODE,
    TASK_GENERATE,
    TASK_PREFILL,
    GenerationRequest,
    lease_key,
    queue_name,
)
from farm.protocol.queues import direct_queue
from farm.router.router import Placement, Router

log = logging.getLogger("farm.gateway")


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
