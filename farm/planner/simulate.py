"""A simulated farm that the real Planner plans: it replays a request trace against per-worker costs
taken from a measured engine profile, so policies can be judged in minutes instead of hours.

The model (disaggregated, every prompt prefilled on a prefill worker):
- prefill workers pull prompts from one shared queue and serve one at a time in `profile.ttft(isl)`;
  the first token exists when its prefill ends (TTFT = queueing + prefill);
- the prompt then waits for a decode worker with a free slot (max_num_seqs and KV blocks, reserved for
  the whole sequence); each decode worker advances all its sequences one token per `profile.itl(b)`
  seconds, b = its sequences; the request's ITL is (done - first token) / (osl - 1), as the gateway sees it;
- a worker asked for starts serving `startup_s` later; a retired one takes nothing new, finishes what
  it has, then leaves (the warm shutdown of the real farm).
SimFarm is both the planner's signal source and its actuator, feeding it the same dataclasses as Redis.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from farm.config.planner import PlannerConfig
from farm.planner.planner import Planner
from farm.planner.profile import Profile
from farm.planner.signals import InflightHistory, ModelSignals, RoleSignals, percentile, traffic_window


@dataclass
class SimRequest:
    arrive: float
    isl: int
    osl: int
    first: float | None = None  # prefill finished: first token
    done: float | None = None
    tokens: float = 0.0  # tokens decoded after the first
    blocks: int = 0

    @property
    def ttft(self) -> float:
        return (self.first or 0.0) - self.arrive

    @property
    def itl(self) -> float:
        return ((self.done or 0.0) - (self.first or 0.0)) / max(1, self.osl - 1)


@dataclass
class SimWorker:
    role: str
    ready_at: float
    retiring: bool = False
    gone: bool = False
    job: SimRequest | None = None
    job_end: float = 0.0
    active: list[SimRequest] = field(default_factory=list)

    def ready(self, t: float) -> bool:
        return not self.gone and t >= self.ready_at

    def idle(self) -> bool:
        return self.job is None and not self.active


class SimFarm:
    """Prefill and decode pools under a trace; implements `collect` (signals) and `replicas`/`scale`."""

    name = "sim"

    def __init__(self, profile: Profile, model: str, prefill: int = 1, decode: int = 1, startup_s: float = 15.0,
                 dt: float = 0.05, window_s: float = 30.0):
        self.profile, self.model = profile, model
        self.startup_s, self.dt, self.window_s = startup_s, dt, window_s
        self.t = 0.0
        self.workers: list[SimWorker] = [SimWorker("prefill", 0.0) for _ in range(prefill)]
        self.workers += [SimWorker("decode", 0.0) for _ in range(decode)]
        self.prefill_q: deque[SimRequest] = deque()
        self.decode_q: deque[SimRequest] = deque()
        self.finished: list[SimRequest] = []
        self._done_ts: list[float] = []
        self._history = InflightHistory(window_s)
        self.inflight = 0
        self.worker_seconds = {"prefill": 0.0, "decode": 0.0}

    # -- actuator ---------------------------------------------------------------------------------------
    def _pool(self, role: str) -> list[SimWorker]:
        return [w for w in self.workers if w.role == role and not w.gone and not w.retiring]

    def replicas(self, model: str, role: str) -> int:
        return len(self._pool(role))

    def scale(self, model: str, role: str, n: int) -> str:
        pool = self._pool(role)
        for _ in range(n - len(pool)):
            self.workers.append(SimWorker(role, self.t + self.startup_s))
        for w in pool[n:][::-1] if n < len(pool) else []:
            w.retiring = True
        return f"{role} -> {n}"

    def ready_count(self, role: str) -> int:
        return sum(1 for w in self.workers if w.role == role and w.ready(self.t))

    # -- signals ----------------------------------------------------------------------------------------
    def collect(self, model: str) -> ModelSignals:
        t = self.t
        pre = RoleSignals("prefill", workers=self.ready_count("prefill"), queued=len(self.prefill_q))
        jobs = [w.job for w in self.workers if w.role == "prefill" and w.job is not None]
        pre.pending_tokens = sum(r.isl for r in self.prefill_q) + sum(r.isl for r in jobs)
        pre.pending_requests = len(self.prefill_q) + len(jobs)
        pre.running = len(jobs)
        dec = RoleSignals("decode", workers=self.ready_count("decode"), waiting=len(self.decode_q))
        active = [r for w in self.workers if w.role == "decode" for r in w.active]
        dec.decoding = self.inflight  # as in the farm: decode load is booked when a request is placed
        dec.running = len(active)
        dec.kv_used = sum(r.blocks for r in active)
        dec.kv_total = dec.workers * self.profile.kv_blocks
        since = self._history.start_of_window(t, self.inflight)
        lo = bisect.bisect_left(self._done_ts, min(t - self.window_s, since[0] if since else t))
        obs = [{"ts": r.done, "ttft": r.ttft, "itl": r.itl, "isl": r.isl, "osl": r.osl, "prefill": "remote"}
               for r in self.finished[lo:]]
        traffic = traffic_window(obs, t, self.window_s, self.inflight, since, remote_min_tokens=0)
        return ModelSignals(model, t, {"prefill": pre, "decode": dec}, traffic)

    # -- time ---------------------------------------------------------------------------------------------
    def arrive(self, req: SimRequest) -> None:
        self.prefill_q.append(req)
        self.inflight += 1

    def _slot(self, w: SimWorker, need: int) -> bool:
        used = sum(r.blocks for r in w.active)
        return len(w.active) < self.profile.max_num_seqs and used + need <= max(self.profile.kv_blocks, need)

    def tick(self) -> None:
        t0, t = self.t, self.t + self.dt
        self.t = t
        for w in self.workers:
            if not w.gone:  # starting and retiring workers cost too
                self.worker_seconds[w.role] += self.dt
        # prefill: finish and start jobs inside the tick, so no time is lost to the tick size
        for w in self.workers:
            if w.role != "prefill" or not w.ready(t):
                continue
            clock = max(t0, w.ready_at)
            while True:
                if w.job is not None:
                    if w.job_end > t:
                        break
                    w.job.first = w.job_end
                    self.decode_q.append(w.job)
                    clock, w.job = w.job_end, None
                if w.retiring or not self.prefill_q:
                    break
                w.job = self.prefill_q.popleft()
                w.job_end = max(clock, w.job.arrive) + self.profile.ttft(w.job.isl)
        # decode: admit waiting requests to the least busy worker with room, then advance every batch
        pool = [w for w in self.workers if w.role == "decode" and w.ready(t) and not w.retiring]
        while self.decode_q and pool:
            req = self.decode_q[0]
            need = math.ceil((req.isl + req.osl) / self.profile.block_size)
            room = [w for w in pool if self._slot(w, need)]
            if not room:
                break
            self.decode_q.popleft()
            req.blocks = need
            min(room, key=lambda w: len(w.active)).active.append(req)
        for w in self.workers:
            if w.role != "decode" or not w.active:
                continue
            step = self.dt / self.profile.itl(len(w.active))
            keep = []
            for r in w.active:
                r.tokens += step
                if r.tokens >= r.osl - 1:
                    r.done = t
                    self.finished.append(r)
                    self._done_ts.append(t)
                    self.inflight -= 1
                else:
                    keep.append(r)
            w.active = keep
        for w in self.workers:
            if w.retiring and not w.gone and w.idle():
                w.gone = True



@dataclass
class SimResult:
    label: str
    timeline: list[dict[str, Any]]
    requests: list[SimRequest]
    worker_seconds: dict[str, float]
    decisions: list[dict[str, Any]]

    def summary(self, ttft_s: float, itl_s: float) -> dict[str, Any]:
        done = [r for r in self.requests if r.done is not None]
        ttfts = [r.ttft for r in done]
        itls = [r.itl for r in done]
        peak = {role: max((p[role] for p in self.timeline), default=0) for role in ("prefill", "decode")}
        return {
            "label": self.label, "requests": len(self.requests), "finished": len(done),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "itl_mean_s": statistics.fmean(itls) if itls else 0.0, "itl_p90_s": percentile(itls, 90),
            "ttft_ok": sum(x <= ttft_s for x in ttfts) / len(done) if done else 0.0,
            "itl_ok": sum(x <= itl_s for x in itls) / len(done) if done else 0.0,
            "worker_seconds": round(sum(self.worker_seconds.values()), 1),
            "peak_prefill": peak["prefill"], "peak_decode": peak["decode"],
        }


def simulate(trace: list[tuple[float, int, int]], profile: Profile, cfg: PlannerConfig | None, model: str,
             *, prefill: int = 1, decode: int = 1, startup_s: float = 15.0, dt: float = 0.05,
             drain_s: float = 120.0, end_s: float | None = None, label: str = "") -> SimResult:
    """Replay `trace` rows (arrival s, isl, osl); with `cfg`, the real Planner re-plans every interval
    (None: the counts stay fixed, a static baseline). Runs until `end_s` (default: the last arrival),
    and then until every request finished, `drain_s` at most."""
    interval = cfg.interval_s if cfg else 10.0
    farm = SimFarm(profile, model, prefill, decode, startup_s, dt, cfg.window_s if cfg else 30.0)
    planner = None
    if cfg is not None:
        planner = Planner(cfg, farm, farm, [model], profiles={model: profile}, clock=lambda: farm.t)
    reqs = [SimRequest(float(t), int(i), int(o)) for t, i, o in sorted(trace)]
    until = end_s if end_s is not None else (reqs[-1].arrive if reqs else 0.0)
    end = until + drain_s
    timeline: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    k, next_plan = 0, 0.0
    while farm.t < end and (farm.t < until or k < len(reqs) or farm.inflight):
        if farm.t >= next_plan - 1e-9:
            if planner is not None:
                for d in planner.step():
                    if d.action != "hold":
                        decisions.append({"t": round(farm.t, 2), "role": d.role, "from": d.current, "to": d.target,
                                          "reason": d.reason, "held": d.held})
            timeline.append({"t": round(farm.t, 2), **{r: farm.replicas(model, r) for r in ("prefill", "decode")},
                             **{f"{r}_ready": farm.ready_count(r) for r in ("prefill", "decode")}})
            next_plan += interval
        while k < len(reqs) and reqs[k].arrive <= farm.t + farm.dt:
            farm.arrive(reqs[k])
            k += 1
        farm.tick()
    return SimResult(label, timeline, reqs, farm.worker_seconds, decisions)
