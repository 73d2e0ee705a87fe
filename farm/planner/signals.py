"""What the planner looks at, read from Redis in a few round trips per step.

Per model and role: registered workers, messages waiting in the role's queues (shared and per-worker,
with kombu's priority lists), prompt tokens placed but not yet prefilled, decoding requests, and KV-cache
use from the workers' heartbeats. Per model: the traffic of the last window from the gateway's
observation stream (request rate, prompt and output lengths, TTFT and ITL). The policies only see
these dataclasses, so the simulation can feed them the same shapes.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from farm.cluster import registry
from farm.protocol import queue_depths, queue_name
from farm.protocol.keys import OBS_STREAM, alive_key
from farm.protocol.queues import direct_queue
from farm.router.load import LoadTracker

ROLE_QUEUES = {"prefill": ("prefill",), "decode": ("decode",), "both": ("generate",)}


@dataclass
class RoleSignals:
    """Load of one role of one model, summed over its registered workers."""

    role: str
    workers: int = 0  # registered and heartbeating (ready) workers
    queued: int = 0  # messages waiting in the role's queues
    pending_tokens: int = 0  # prompt tokens placed on these workers and not yet prefilled
    pending_requests: int = 0
    decoding: int = 0  # requests decoding on these workers
    running: int = 0  # engine-reported running sequences
    waiting: int = 0  # engine-reported waiting (not yet scheduled) sequences
    kv_used: int = 0
    kv_total: int = 0

    @property
    def kv_util(self) -> float:
        return self.kv_used / self.kv_total if self.kv_total else 0.0


@dataclass
class Traffic:
    """Finished requests of one model over the last window, as the gateway observed them."""

    window_s: float = 0.0
    requests: int = 0
    rate: float = 0.0  # arrivals per second (completions, corrected by the change of in-flight requests)
    isl: float = 0.0  # mean prompt tokens
    osl: float = 0.0  # mean completion tokens
    ttft_p50: float = 0.0
    ttft_p90: float = 0.0
    itl_mean: float = 0.0
    itl_p90: float = 0.0
    remote_fraction: float = 1.0  # share of requests prefilled on a prefill worker
    remote_isl: float = 0.0  # mean prompt tokens of those
    local_isl: float = 0.0  # mean prompt tokens of the requests prefilled on their decode worker
    inflight: int = 0


@dataclass
class ModelSignals:
    model: str
    ts: float
    roles: dict[str, RoleSignals] = field(default_factory=dict)
    traffic: Traffic = field(default_factory=Traffic)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "ts": self.ts, "roles": {r: asdict(s) for r, s in self.roles.items()},
                "traffic": asdict(self.traffic)}


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))]


def summarize_traffic(obs: list[dict[str, Any]], window_s: float, inflight: int = 0,
                      inflight_before: int | None = None, remote_min_tokens: int | None = None) -> Traffic:
    """Traffic from observation records ({ttft, itl, isl, osl, prefill}); pure, shared with the simulation.

    Completions lag arrivals during a ramp; adding the growth of in-flight requests over the window
    gives the arrival rate (Little's law bookkeeping, no arrival log needed). A request "belongs" on a
    prefill worker when its prompt exceeds `remote_min_tokens` (the disaggregation rule, ignoring the
    prefix cache); without a rule, where it really ran decides. Judging by length keeps the estimate
    honest while there are no prefill workers at all."""
    n = len(obs)
    growth = inflight - inflight_before if inflight_before is not None else 0
    t = Traffic(window_s=window_s, requests=n, inflight=inflight,
                rate=max(0, n + growth) / window_s if window_s > 0 else 0.0)
    if not n:
        return t
    ttfts = [float(o.get("ttft") or 0.0) for o in obs]
    itls = [float(o["itl"]) for o in obs if o.get("itl")]
    t.isl = statistics.fmean(float(o.get("isl") or 0) for o in obs)
    t.osl = statistics.fmean(float(o.get("osl") or 0) for o in obs)
    t.ttft_p50, t.ttft_p90 = percentile(ttfts, 50), percentile(ttfts, 90)
    t.itl_mean = statistics.fmean(itls) if itls else 0.0
    t.itl_p90 = percentile(itls, 90)
    remote, local = [], []
    for o in obs:
        far = (o.get("prefill") == "remote" if remote_min_tokens is None
               else float(o.get("isl") or 0) > remote_min_tokens)
        (remote if far else local).append(o)
    t.remote_fraction = len(remote) / n
    t.remote_isl = statistics.fmean(float(o.get("isl") or 0) for o in remote) if remote else 0.0
    t.local_isl = statistics.fmean(float(o.get("isl") or 0) for o in local) if local else 0.0
    return t


class InflightHistory:
    """Recent (time, requests in flight) readings of one model: the arrival rate over a window is the
    completions in it plus the growth of in-flight requests across it."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._readings: deque[tuple[float, int]] = deque()

    def start_of_window(self, now: float, inflight: int) -> tuple[float, int] | None:
        """The last reading at or before the window's start, else the oldest (None on the first call);
        then records this one."""
        while len(self._readings) > 1 and self._readings[1][0] <= now - self.window_s:
            self._readings.popleft()
        first = self._readings[0] if self._readings else None
        self._readings.append((now, inflight))
        return first


def traffic_window(obs: list[dict[str, Any]], now: float, window_s: float, inflight: int,
                   since: tuple[float, int] | None, remote_min_tokens: int | None = None) -> Traffic:
    """Lengths and latencies over the last `window_s`; the arrival rate from `since` = (time, in flight
    then) to now: completions in that span plus the growth of in-flight requests."""
    t = summarize_traffic(obs, window_s, inflight, remote_min_tokens=remote_min_tokens)
    span = window_s if since is None else max(1e-3, now - since[0])
    recent = sum(1 for o in obs if float(o.get("ts", 0)) >= now - span)
    t.rate = max(0, recent + (inflight - since[1] if since else 0)) / span  # arrivals = done + growth
    return t


class RedisSignals:
    """Reads ModelSignals for a model from the farm's Redis (registry, load hash, queues, obs stream)."""

    def __init__(self, r: redis.Redis, window_s: float = 30.0, remote_min_tokens: int | None = None,
                 clock=time.time):
        self.r = r
        self.window_s = window_s
        self.remote_min_tokens = remote_min_tokens
        self.clock = clock
        self.loads = LoadTracker(r)
        self._history: dict[str, InflightHistory] = {}

    def queue_depths(self, queues: list[str]) -> list[int]:
        return queue_depths(self.r, queues)

    def collect(self, model: str) -> ModelSignals:
        now = self.clock()
        workers = registry.live_workers(self.r, model=model)
        loads = self.loads.loads()
        stats_raw = self.r.mget([alive_key(w.worker_id) for w in workers]) if workers else []
        roles = {role: RoleSignals(role) for role in ROLE_QUEUES}
        queues: dict[str, list[str]] = {role: [queue_name(model, k) for k in ks] for role, ks in ROLE_QUEUES.items()}
        for w, raw in zip(workers, stats_raw, strict=True):
            s = roles.setdefault(w.role, RoleSignals(w.role))
            s.workers += 1
            queues.setdefault(w.role, []).append(direct_queue(w.worker_id))
            ld = loads.get(w.worker_id) or {}
            s.pending_tokens += ld.get("p", 0)
            s.pending_requests += ld.get("pn", 0)
            s.decoding += ld.get("dn", 0)
            stats = json.loads(raw) if raw else {}
            s.running += int(stats.get("running", 0))
            s.waiting += int(stats.get("waiting", 0))
            total = int(stats.get("blocks_total", 0))
            s.kv_total += total
            s.kv_used += total - int(stats.get("blocks_free", total))
        flat = [(role, q) for role, qs in queues.items() for q in qs]
        for (role, _q), depth in zip(flat, self.queue_depths([q for _r, q in flat]), strict=True):
            roles[role].queued += depth
        inflight = sum(s.decoding for s in roles.values())
        return ModelSignals(model, now, roles, self.traffic(model, now, inflight))

    def observations(self, model: str, since: float) -> list[dict[str, Any]]:
        """Observation records of `model` finished after `since` (wall clock, seconds)."""
        out = []
        for _id, fields in self.r.xrange(OBS_STREAM, min=f"{int(since * 1000)}-0", max="+", count=20_000):
            raw = fields.get(b"o") or fields.get("o")
            if raw is None:
                continue
            o = json.loads(raw)
            if o.get("model") == model and float(o.get("ts", 0)) >= since:
                out.append(o)
        return out

    def traffic(self, model: str, now: float, inflight: int) -> Traffic:
        since = self._history.setdefault(model, InflightHistory(self.window_s)).start_of_window(now, inflight)
        obs = self.observations(model, now - max(self.window_s, now - since[0] if since else 0))
        return traffic_window(obs, now, self.window_s, inflight, since, self.remote_min_tokens)
