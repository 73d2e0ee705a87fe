"""The router: place a request on the worker that serves it cheapest, with state shared in Redis.

Stages are timed (hashing, index lookup, load read, scheduling) so routing overhead is measured, not
guessed. Modes: `kv` (cost function over the KV-block index, the load and each worker's measured step
costs: farm.router.policy), `least-loaded` (cache-blind: fewest outstanding requests, the baseline kv must
beat by reusing cache, not by packing), `round-robin`, `random`. Nothing on the decision path waits for Redis: the
index, the load and the step costs are this process's copies, kept current by one follower
(IndexFollower). Without worker KV events (`use_kv_events: false`) the index is approximated from this
router's own past placements, each remembered for `approx_ttl_s`.

Admission: a worker is busy when its KV cache is above `busy_threshold`, or when the request would wait
behind other work there and its predicted time to first token exceeds `ttft_target_ms`; when every
candidate is busy the request is refused (503 with Retry-After) instead of queueing without end.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from farm.cluster import registry
from farm.config import FarmConfig
from farm.infra.redis_batch import PipelineBatcher
from farm.protocol.hashing import block_hashes, salt_root
from farm.router.costs import CostBook
from farm.router.index import IndexFollower, KVIndex
from farm.router.load import LoadMirror, LoadTracker, empty_load
from farm.router.policy import (
    Candidate,
    RoundRobin,
    dynamo_costs,
    has_queue,
    least_loaded_pick,
    measured_costs,
    predicted_ttft,
    softmax_pick,
)
from farm.telemetry import prometheus

log = logging.getLogger(__name__)
LIVE_VIEW_MAX_AGE_S = 2.0  # a placement trusts the follower's list of live workers for this long


class BusyError(RuntimeError):
    """Every candidate worker is above the load threshold: shed the request (503 + Retry-After). `full`: every
    one's KV cache is full (room comes back as requests finish: worth a short wait, Gateway.submit); else some
    would only start past the TTFT target (waiting makes that worse)."""

    def __init__(self, message: str, retry_after_s: int, stage: str = "generate", full: bool = False):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.stage = stage
        self.full = full


@dataclass
class Placement:
    worker: registry.WorkerInfo
    overlap_blocks: int  # leading request blocks cached on the chosen worker (any tier), as predicted
    mode: str
    cost: float | None = None
    predicted_ttft_s: float | None = None  # on the chosen worker (not for decode-only placements)
    timings_us: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Estimate:
    """What a placement would give a prompt, without making it (Router.estimate)."""

    ttft_s: float  # predicted time to the first token on the best worker
    overlap_blocks: int  # prompt blocks cached there (tier-weighted)
    worker: str


class ApproxIndex(KVIndex):
    """Predicted cache contents from past placements, each forgotten after a TTL (a block placed again
    on the same worker lives until its latest placement expires)."""

    def __init__(self, ttl_s: float):
        super().__init__()
        self.ttl_s = ttl_s
        self._expiry: deque[tuple[float, str, list[int]]] = deque()
        self._until: dict[tuple[str, int], float] = {}  # (worker, hash) -> when its latest placement expires
        self._lock_approx = threading.RLock()

    def record(self, worker: str, hashes: list[int]) -> None:
        with self._lock_approx:
            self.expire()
            until = time.monotonic() + self.ttl_s
            self.store(worker, hashes)
            for h in hashes:
                self._until[(worker, h)] = until
            self._expiry.append((until, worker, hashes))

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock_approx:
            while self._expiry and self._expiry[0][0] <= now:
                _, w, hs = self._expiry.popleft()
                gone = [h for h in hs if self._until.get((w, h), 0.0) <= now]
                for h in gone:
                    self._until.pop((w, h), None)
                self.remove(w, gone)


class Router:
    def __init__(self, cfg: FarmConfig, r: redis.Redis, follow: bool = True):
        self.cfg = cfg
        self.rc = cfg.router
        self.r = r
        self.block_size = cfg.engine.block_size
        self._block_sizes: dict[str | None, int] = {}
        # a following router serves requests: their load writes go out batched (farm.infra.redis_batch)
        self.batcher = PipelineBatcher(r, name="redis-batch") if follow else None
        self.loads = LoadTracker(r, cfg.celery.max_request_s, LoadMirror() if follow else None, self.batcher)
        self.costs = CostBook(self.rc.cost_prior)
        self.rng = random.Random()
        self.rr: dict[str, RoundRobin] = {}
        self._warned: set[str] = set()
        self._live: tuple[float, list[registry.WorkerInfo]] = (-math.inf, [])
        self.follower: IndexFollower | None = None
        # Placements not yet confirmed by KV events (the prefill is still running) are predicted for
        # a short while, so concurrent requests sharing a new prefix follow the first one instead of
        # each prefilling it somewhere else. Without events, predictions are all there is.
        self.predicted = ApproxIndex(self.rc.approx_ttl_s if not self.rc.use_kv_events
                                     else self.rc.prediction_ttl_s)
        self.index: KVIndex = KVIndex() if self.rc.use_kv_events else self.predicted
        if follow:
            self.follower = IndexFollower(r, self.index if self.rc.use_kv_events else None, maintenance=self.maintain,
                                          load_mirror=self.loads.mirror, follow_kv=self.rc.use_kv_events).start()

    def stop(self) -> None:
        if self.follower:
            self.follower.stop()
        if self.batcher is not None:
            self.batcher.stop()

    def maintain(self, live: list[registry.WorkerInfo]) -> None:
        """About every second (the follower's prune): end expired load, refresh the workers' step costs, keep
        the live workers for placements."""
        self._live = (time.monotonic(), live)
        self.loads.reap()
        self.refresh_costs(live)

    def live_workers(self, max_age_s: float = LIVE_VIEW_MAX_AGE_S) -> list[registry.WorkerInfo] | None:
        """The live workers as the follower saw them at its last prune (about every second), or None when that
        view is older than `max_age_s` (no follower, or it cannot reach Redis): placements then read Redis."""
        at, live = self._live
        return live if time.monotonic() - at <= max_age_s else None

    def refresh_costs(self, live: list[registry.WorkerInfo]) -> None:
        """Each live worker's measured step costs, from its heartbeat (one round trip)."""
        self.costs.update({w.worker_id: w.model for w in live},
                          registry.heartbeats(self.r, [w.worker_id for w in live]))

    def block_size_of(self, model: str | None) -> int:
        """The KV block size of `model` (models[].block_size); the engine default for a model not configured.
        Remembered per model: it is asked for every candidate of every decision."""
        bs = self._block_sizes.get(model)
        if bs is None:
            try:
                bs = self.cfg.block_size(model) if model else self.block_size
            except KeyError:
                bs = self.block_size
            self._block_sizes[model] = bs
        return bs

    def hashes(self, token_ids: Sequence[int], model: str | None = None, salt: str = "") -> list[int]:
        """The prompt's block hashes as its workers cache them: chained from its cache salt's root, if any."""
        return block_hashes(token_ids, self.block_size_of(model), salt_root(salt))

    def _compatible(self, workers: list[registry.WorkerInfo]) -> list[registry.WorkerInfo]:
        ok = []
        for w in workers:
            bs = self.block_size_of(w.model)
            if w.block_size != bs:
                if w.worker_id not in self._warned:
                    self._warned.add(w.worker_id)
                    log.error("REFUSING worker %s: its KV block size %d differs from model %s's %d "
                              "(models[].block_size); it would be routed wrongly", w.worker_id, w.block_size,
                              w.model, bs)
                continue
            ok.append(w)
        return ok

    def choose(self, workers: list[registry.WorkerInfo], hashes: list[int], num_tokens: int, stage: str,
               loads: dict[str, dict[str, int]] | None = None, decode_tokens: float | None = None) -> Placement:
        """Pick a worker for `stage` ("prefill", "decode" or "both") among `workers`. `decode_tokens`: the
        output tokens the cost expects of the request (None: its model's measured mean)."""
        t0 = time.perf_counter()
        workers = self._compatible(workers)
        if not workers:
            raise LookupError("no compatible worker")
        mode = self.rc.mode
        bs = self.block_size_of(workers[0].model)
        request_blocks = math.ceil(num_tokens / bs)
        t1 = time.perf_counter()
        # the baseline is cache-blind: no index read
        overlaps = self._overlaps(workers, hashes) if stage != "decode" and mode != "least-loaded" else {}
        t2 = time.perf_counter()
        if loads is None:
            loads = self.loads.loads()
        t3 = time.perf_counter()
        cands = self._candidates(workers, overlaps, loads, bs)
        # the predicted TTFT per candidate, computed once: admission and the measured cost both use it
        ttfts = [predicted_ttft(c, request_blocks) for c in cands] if stage != "decode" else None
        self._shed_if_busy(cands, request_blocks, stage, ttfts)
        cost = None
        if mode == "round-robin":
            i = self.rr.setdefault(stage, RoundRobin()).pick(len(workers))
        elif mode == "least-loaded":
            i = least_loaded_pick(cands, request_blocks, stage, self.rng)
        elif mode == "random":
            i = self.rng.randrange(len(workers))
        else:
            if self.rc.cost == "dynamo":
                costs = dynamo_costs(cands, request_blocks, self.rc.overlap_weight if stage != "decode" else 0.0)
            else:
                costs = measured_costs(cands, request_blocks, stage, decode_tokens, ttfts)
            i = softmax_pick(costs, self.rc.temperature, self.rng)
            cost = costs[i]
        t4 = time.perf_counter()
        chosen = workers[i]
        if stage != "decode" and mode == "kv":
            self.predicted.record(chosen.worker_id, hashes)
        timings = {"hash": 0.0, "index": (t2 - t1) * 1e6, "load": (t3 - t2) * 1e6,
                   "schedule": ((t4 - t3) + (t1 - t0)) * 1e6}
        prometheus.record_routing(mode, stage, timings, cands[i].overlap_blocks, len(hashes))
        ttft = ttfts[i] if ttfts is not None else None
        return Placement(chosen, int(overlaps.get(chosen.worker_id, 0)) if overlaps else 0, mode, cost, ttft,
                         timings)

    def estimate(self, workers: list[registry.WorkerInfo], hashes: list[int], num_tokens: int,
                 loads: dict[str, dict[str, int]] | None = None) -> Estimate | None:
        """The soonest first token among `workers` for a prompt: its predicted TTFT on the best of them and the
        prompt blocks cached there. What MoM compares between models that score alike (farm.semantic.selection);
        nothing is placed or recorded. None without a compatible worker."""
        workers = self._compatible(workers)
        if not workers:
            return None
        bs = self.block_size_of(workers[0].model)
        request_blocks = math.ceil(num_tokens / bs)
        cands = self._candidates(workers, self._overlaps(workers, hashes), self.loads.loads() if loads is None
                                 else loads, bs)
        ttft, best = min((predicted_ttft(c, request_blocks), i) for i, c in enumerate(cands))
        return Estimate(ttft, int(cands[best].overlap_blocks), cands[best].worker)

    def _overlaps(self, workers: list[registry.WorkerInfo], hashes: list[int]) -> dict[str, float]:
        """Each worker's cached prefix of `hashes`, in blocks weighted by tier (the KV index, or the placements
        predicted without one)."""
        ids = [w.worker_id for w in workers]
        overlaps = self.index.overlaps(hashes, ids)
        scores = self.index.weighted(hashes, overlaps, self.rc.tier_weights)
        if self.predicted is not self.index:
            self.predicted.expire()
            for w, n in self.predicted.overlaps(hashes, ids).items():
                scores[w] = max(float(n), scores.get(w, 0.0))
        return scores

    def _candidates(self, workers: list[registry.WorkerInfo], overlaps: dict[str, float],
                    loads: dict[str, dict[str, int]], bs: int) -> list[Candidate]:
        out = []
        for w in workers:
            ld = loads.get(w.worker_id) or empty_load()
            out.append(Candidate(w.worker_id, overlaps.get(w.worker_id, 0), ld["p"] / bs, ld["d"], w.num_blocks,
                                 self.costs.of(w.worker_id), ld.get("dn", 0), ld.get("pn", 0)))
        return out

    def _shed_if_busy(self, cands: list[Candidate], request_blocks: int, stage: str,
                      ttfts: list[float] | None) -> None:
        """Refuse the request (BusyError) when every candidate is busy: its KV cache above `busy_threshold`,
        or (prefill placements) the request would queue there and its predicted TTFT exceeds the target."""
        threshold = self.rc.busy_threshold
        target_s = self.rc.ttft_target_ms / 1000 if stage != "decode" else 0.0

        def full(c: Candidate) -> bool:
            if threshold <= 0 or not c.capacity_blocks:
                return False
            used = c.active_blocks + (c.pending_prefill_blocks if stage != "decode" else 0)
            return used / c.capacity_blocks > threshold

        def slow(i: int) -> bool:
            return target_s > 0 and ttfts is not None and has_queue(cands[i]) and ttfts[i] > target_s

        every_full = all(full(c) for c in cands)
        if every_full:
            why = f"above {threshold:.0%} of their KV capacity"
        elif all(full(c) or slow(i) for i, c in enumerate(cands)):
            why = f"too loaded to start this request within router.ttft_target_ms ({self.rc.ttft_target_ms:.0f} ms)"
        else:
            return
        raise BusyError(f"all {len(cands)} {stage} workers are {why}", retry_after_s=self.rc.retry_after_s,
                        stage=stage, full=every_full)
