"""Placing one request: the model's layout from its live workers, the router's choice, the load recorded, the
first task sent to the chosen worker's own queue.

Layout per model, from the live worker registry (read once per placement):
- prefill and decode workers present -> disaggregated (`disaggregation.mode: always`) or conditional: the router
  picks the decode worker by KV overlap and load, and a remote prefill only when the uncached part of the prompt
  is long enough and the prefill worker's queue short enough (Dynamo's rule); the prefill task computes the
  prompt's KV, emits a signed KV handle and hands the decode task to the chosen decode worker's queue;
- otherwise aggregated workers (`both`) -> one generate task on the worker the router picks;
- decode workers alone -> the decode task prefills locally.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from farm.cluster import registry
from farm.cluster.liveness import Process, process_of
from farm.config import FarmConfig
from farm.gateway.failures import NoWorkersError
from farm.infra import tracing
from farm.infra.broker import TaskPublisher, send_generation
from farm.protocol import TASK_DECODE, TASK_GENERATE, TASK_PREFILL, GenerationRequest
from farm.protocol.queues import direct_queue
from farm.router.router import Estimate, Placement, Router
from farm.telemetry import prometheus

# The workers a request has lost (farm.gateway.submission): worker id -> the start time (WorkerInfo.started_at) of
# the process that was lost. A worker registered again under that id and started later is a new process (the
# supervisor restarted it): it may take the request, which then continues on the same model instead of failing.
Lost = Mapping[str, float]
NOTHING_LOST: Lost = MappingProxyType({})


def was_lost(proc: Process, lost: Lost) -> bool:
    """Whether the worker process `proc` is (no newer than) one the request lost; a process of unknown start under a
    lost id counts as lost."""
    wid, started = proc
    return wid in lost and (started is None or started <= lost[wid])


@dataclass
class Dispatch:
    """The first task of a request and the worker whose queue it was sent to."""

    task: str
    worker_id: str


@dataclass
class Placed:
    """Where a request went: its layout, the router's placements by stage ("prefill", "decode", "both") and
    the task that was sent."""

    layout: str
    placements: dict[str, Placement]
    dispatch: Dispatch


@dataclass
class Pools:
    """A model's live workers by what they can do, read once for one placement."""

    prefill: list[registry.WorkerInfo]
    decode: list[registry.WorkerInfo]  # decode workers, else aggregated ones (both decode)

    @classmethod
    def of(cls, live: list[registry.WorkerInfo], model: str, exclude: Lost = NOTHING_LOST) -> Pools:
        by_role: dict[str, list[registry.WorkerInfo]] = {"prefill": [], "decode": [], "both": []}
        for w in live:
            # a lost process is left out, e.g. one that just died, its heartbeat not yet lapsed
            if w.model == model and not was_lost(process_of(w.worker_id, w), exclude):
                by_role.setdefault(w.role, []).append(w)
        return cls(by_role["prefill"], by_role["decode"] or by_role["both"])


class Placer:
    """Chooses workers for requests and sends their first task (one per gateway)."""

    def __init__(self, cfg: FarmConfig, r: Any, router: Router, publisher: TaskPublisher):
        self.cfg, self.r, self.router, self.publisher = cfg, r, router, publisher

    def _read(self, model: str, exclude: Lost) -> tuple[Pools, str]:
        """The model's live workers and the layout they serve it in. From the router's view of the live workers,
        refreshed about every second by its follower (no Redis round trip per placement); from Redis when that
        view is missing or stale, when re-placing a request, and before refusing one (a worker that registered
        within the last second is not in the view yet). A worker that died since the view was taken is left
        by the request's own watch (Submission re-places it after router.placement_timeout_s)."""
        live = None if exclude else self.router.live_workers()  # re-placing a request: ask Redis
        if live is not None:
            pools = Pools.of(live, model, exclude)
            try:
                return pools, self._layout(model, pools, False)
            except NoWorkersError:
                pass
        pools = Pools.of(registry.live_workers(self.r, model=model), model, exclude)
        return pools, self._layout(model, pools, bool(exclude))

    def layout(self, model: str, exclude: Lost = NOTHING_LOST) -> str:
        """How `model` is served now; raises NoWorkersError when nothing can serve it."""
        return self._read(model, exclude)[1]

    def _layout(self, model: str, pools: Pools, replacing: bool) -> str:
        """`replacing` (a request whose worker died): decode workers prefill locally when no prefill worker is
        left, even in mode `always`: finishing the request beats refusing it."""
        mode = self.cfg.disaggregation.mode
        if not pools.decode or (mode == "always" and not pools.prefill and not replacing):
            if pools.decode and not pools.prefill:
                raise NoWorkersError(f"disaggregation.mode is 'always' but no prefill worker serves model {model!r}")
            raise NoWorkersError(f"no live worker serves model {model!r}")
        if pools.prefill and mode != "never":
            return "disaggregated" if mode == "always" else "conditional"
        return "aggregated" if pools.decode[0].role == "both" else "decode-only"

    def place(self, req: GenerationRequest, exclude: Lost = NOTHING_LOST) -> Placed:
        """Choose workers for `req`, record their load and send its first task; NoWorkersError, BusyError."""
        if not tracing.ENABLED:
            return self._place(req, exclude)
        with tracing.span("farm.place", attributes={"farm.request_id": req.request_id, "farm.model": req.model,
                                                    "farm.prompt_tokens": len(req.prompt_token_ids)}) as span:
            placed = self._place(req, exclude)
            span.set_attributes({"farm.layout": placed.layout, "farm.task": placed.dispatch.task, **{
                f"farm.{stage}_worker": p.worker.worker_id for stage, p in placed.placements.items()}, **{
                f"farm.{stage}_overlap_blocks": p.overlap_blocks for stage, p in placed.placements.items()}})
            return placed

    def estimate(self, model: str, token_ids: list[int], cache_salt: str = "") -> Estimate | None:
        """The predicted start of a prompt on `model`'s workers (Router.estimate), where its prefill would run:
        the prefill pool when disaggregated, the decode (or aggregated) workers otherwise. None when nothing
        serves the model now."""
        try:
            pools, layout = self._read(model, frozenset())
        except NoWorkersError:
            return None
        workers = pools.prefill if layout == "disaggregated" else pools.decode
        return self.router.estimate(workers, self.router.hashes(token_ids, model, cache_salt), len(token_ids))

    def _place(self, req: GenerationRequest, exclude: Lost) -> Placed:
        pools, layout = self._read(req.model, exclude)
        req.created = req.created or time.time()
        # a prompt's log-probabilities are computed where the whole prompt is, cached or not: never on a separate
        # prefill worker, and no worker is chosen, nor its prefill load counted lighter, for a prefix it holds
        local = req.sampling.prompt_logprobs is not None
        t0 = time.perf_counter()
        hashes = [] if local else self.router.hashes(req.prompt_token_ids, req.model, req.cache_salt)
        prometheus.ROUTING_STAGE_SECONDS.labels(stage="hash").observe(time.perf_counter() - t0)
        loads = self.router.loads.loads()
        n = len(req.prompt_token_ids)
        bs = self.cfg.block_size(req.model)
        dcfg = self.cfg.disaggregation
        remote = False
        if layout == "disaggregated" and not local:
            d = self.router.choose(pools.decode, hashes, n, "decode", loads)
            p = self.router.choose(pools.prefill, hashes, n, "prefill", loads)
            remote = True
        else:
            # the decode worker may prefill itself: weigh its cached prefix as well as its load
            d = p = self.router.choose(pools.decode, hashes, n, "both", loads)
            if layout == "conditional" and not local and n - d.overlap_blocks * bs > dcfg.remote_min_uncached_tokens:
                cand = self.router.choose(pools.prefill, hashes, n, "prefill", loads)
                if (loads.get(cand.worker.worker_id) or {}).get("pn", 0) < dcfg.max_prefill_queue:
                    p, remote = cand, True
        placements: dict[str, Placement]
        if remote:
            placements = {"prefill": p, "decode": d}
            req.decode_queue = direct_queue(d.worker.worker_id)
            task, args = TASK_PREFILL, [req.to_dict()]
        else:
            placements = {"both": d}
            if d.worker.role == "both":
                task, args = TASK_GENERATE, [req.to_dict()]
            else:
                task, args = TASK_DECODE, [req.to_dict(), None]
        self.router.loads.begin_soon([("p", p.worker.worker_id, req.request_id, max(0, n - p.overlap_blocks * bs)),
                                      ("d", d.worker.worker_id, req.request_id, math.ceil(n / bs))])
        send_generation(self.publisher, task, args, direct_queue(p.worker.worker_id))
        return Placed(layout, placements, Dispatch(task, p.worker.worker_id))
