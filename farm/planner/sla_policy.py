"""SLA-based policy: how many prefill and decode workers keep TTFT and ITL within their targets.

From the engine profile (per-worker cost, interpolated) and the predicted traffic of the next interval:

- prefill: each worker serves prompts of the predicted length L in `ttft(L)` seconds. Treating one
  worker's share of the arrivals as an M/D/1 queue, a prompt waits `rho*S / (2(1-rho))` on top, with
  rho = rate*S/n. The fewest workers whose predicted TTFT (service + wait) meets the target, with rho
  never above `max_prefill_util`. Batched prefill of short prompts makes this conservative.
- decode: the largest batch whose step time still meets the ITL target (and whose KV fits a worker) is
  the operating point b; by Little's law the farm decodes rate*osl*itl(b) sequences at once, i.e. needs
  rate*osl / (b/itl(b)) workers, plus the share of time decode workers spend prefilling locally.

Traffic is predicted per model from the last window's observations: the last value, or an EMA that
follows a rise at once and smooths a fall (scale up fast, down slowly). Prompts already waiting for a
prefill worker are added as extra rate, to be drained within one interval, so a backlog built while
workers were starting is cleared rather than carried. A scale-down is proposed only when
`scale_down_margin` times the predicted load would still fit the smaller count (hysteresis).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from farm.config.planner import SlaPolicyConfig
from farm.planner.load_policy import Proposal
from farm.planner.profile import Profile
from farm.planner.signals import RoleSignals, Traffic

MAX_REPLICAS = 10_000


@dataclass
class Predicted:
    """The load planned for: arrival rate (req/s), prompt and output lengths, the remote-prefill share."""

    rate: float
    isl: float
    osl: float
    remote_fraction: float = 1.0
    remote_isl: float = 0.0
    local_isl: float = 0.0


def prefill_replicas(profile: Profile, rate: float, isl: float, ttft_s: float, max_util: float = 0.85) -> tuple[int, str]:
    """Fewest prefill workers whose predicted TTFT at `rate` req/s of `isl`-token prompts meets `ttft_s`."""
    if rate <= 0 or isl <= 0:
        return 0, "no prefill load"
    s = profile.ttft(isl)
    n = max(1, math.ceil(rate * s / max_util))
    if s > ttft_s:
        return n, f"TTFT target {ttft_s * 1000:.0f} ms unreachable: one {isl:.0f}-token prefill takes {s * 1000:.0f} ms"
    while n < MAX_REPLICAS:
        rho = rate * s / n
        ttft = s + rho * s / (2 * (1 - rho))
        if rho <= max_util and ttft <= ttft_s:
            return n, f"{rate:.2f} req/s x {isl:.0f} tok: predicted TTFT {ttft * 1000:.0f} ms at util {rho:.2f}"
        n += 1
    return n, "prefill load beyond any replica count"


def decode_batch(profile: Profile, isl: float, osl: float, itl_s: float) -> int:
    """The operating point: the largest batch within the ITL target whose KV fits one worker (at least 1)."""
    return max(1, min(profile.max_batch_for_itl(itl_s), profile.kv_max_batch(isl + osl)))


def decode_replicas(profile: Profile, rate: float, isl: float, osl: float, itl_s: float,
                    local_rate: float = 0.0, local_isl: float = 0.0, inflight: int = 0) -> tuple[int, str]:
    """Fewest decode workers that decode `rate` req/s of `osl` tokens at an ITL within `itl_s`.

    `local_rate` requests/s of `local_isl` tokens are prefilled on the decode workers themselves;
    `inflight` requests already placed must fit at the operating batch too (a burst already admitted)."""
    b_itl = profile.max_batch_for_itl(itl_s)
    b_kv = profile.kv_max_batch(isl + osl)
    b = decode_batch(profile, isl, osl, itl_s)
    now = math.ceil(inflight / b) if inflight > 0 else 0
    if rate <= 0 or osl <= 0:
        return now, f"{inflight} requests in flight at batch {b}" if now else "no decode load"
    decode_work = rate * osl / profile.decode_tokens_per_s(b)  # worker-seconds per second
    prefill_work = local_rate * profile.ttft(local_isl) if local_rate > 0 and local_isl > 0 else 0.0
    n = max(1, math.ceil(decode_work + prefill_work - 1e-9))
    why = f"{rate:.2f} req/s x {osl:.0f} tok at batch {b} (itl {profile.itl(b) * 1000:.0f} ms)"
    if b_itl == 0:
        why = f"ITL target {itl_s * 1000:.0f} ms unreachable: batch 1 takes {profile.itl(1) * 1000:.0f} ms; " + why
    elif b_kv < b_itl:
        why += f", KV-bound ({b_kv} seqs of {isl + osl:.0f} tok fit)"
    if prefill_work:
        why += f", +{prefill_work:.2f} workers of local prefill"
    if now > n:
        n, why = now, f"{inflight} requests in flight need {now} workers at batch {b}; " + why
    return n, why


class SlaPolicy:
    def __init__(self, cfg: SlaPolicyConfig, profile: Profile):
        self.cfg = cfg
        self.profile = profile
        self._pred: dict[str, Predicted] = {}

    def predict(self, model: str, t: Traffic) -> Predicted | None:
        """The next interval's load; None when there is too little evidence to change anything."""
        prev = self._pred.get(model)
        idle = t.requests == 0 and t.inflight == 0 and t.rate == 0
        if t.requests < self.cfg.min_requests and not idle:
            if prev is None:
                return None
            cur = Predicted(t.rate, prev.isl, prev.osl, prev.remote_fraction, prev.remote_isl, prev.local_isl)
        elif idle:
            cur = Predicted(0.0, prev.isl if prev else 0.0, prev.osl if prev else 0.0)
        else:
            cur = Predicted(t.rate, t.isl, t.osl, t.remote_fraction, t.remote_isl, t.local_isl)
        if prev is not None and self.cfg.predictor == "ema" and cur.rate < prev.rate:
            a = self.cfg.ema_alpha
            cur = Predicted(*(a * c + (1 - a) * p for c, p in zip(
                (cur.rate, cur.isl, cur.osl, cur.remote_fraction, cur.remote_isl, cur.local_isl),
                (prev.rate, prev.isl, prev.osl, prev.remote_fraction, prev.remote_isl, prev.local_isl),
                strict=True)))
            if idle and cur.rate < 0.01:
                cur.rate = 0.0
        self._pred[model] = cur
        return cur

    def predicted(self, model: str) -> Predicted | None:
        """The load the last plan was made for."""
        return self._pred.get(model)

    def plan(self, model: str, t: Traffic, current: dict[str, int], roles: dict[str, RoleSignals] | None = None,
             drain_s: float = 0.0) -> dict[str, Proposal]:
        """A proposal per role in `current` (role -> replicas now); `roles` (the load now) adds the prefill
        backlog, to be drained within `drain_s` seconds."""
        pred = self.predict(model, t)
        if pred is None:
            return {role: Proposal(n, f"too few observations ({t.requests} < {self.cfg.min_requests})")
                    for role, n in current.items()}
        backlog = 0.0
        inflight = sum(r.decoding for r in (roles or {}).values())
        pre = (roles or {}).get("prefill")
        if pre is not None and drain_s > 0:
            backlog = max(0, pre.pending_requests - pre.workers) / drain_s
        out: dict[str, Proposal] = {}
        for role, p in self._plan(pred, self.cfg.headroom, current, backlog, inflight).items():
            n = current[role]
            if p.desired < n:  # hysteresis: the smaller count must also carry a margin more load
                p2 = self._plan(pred, self.cfg.headroom * self.cfg.scale_down_margin, current, backlog, inflight)[role]
                if p2.desired > p.desired:
                    p = Proposal(min(n, p2.desired), p.reason + f"; {p2.desired} needed at "
                                 f"x{self.cfg.scale_down_margin} load")
            out[role] = p
        return out

    def _plan(self, pred: Predicted, headroom: float, current: dict[str, int], backlog: float,
              inflight: int = 0) -> dict[str, Proposal]:
        rate = pred.rate * headroom
        ttft_s, itl_s = self.cfg.ttft_ms / 1000, self.cfg.itl_ms / 1000
        p = self.profile
        out: dict[str, Proposal] = {}
        has_prefill = "prefill" in current
        remote = pred.remote_fraction if has_prefill else 0.0
        if has_prefill:
            n, why = prefill_replicas(p, rate * remote + backlog, pred.remote_isl or pred.isl, ttft_s,
                                      self.cfg.max_prefill_util)
            out["prefill"] = Proposal(n, why + (f" (incl. backlog {backlog:.2f} req/s)" if backlog else ""))
        for role in ("decode", "both"):
            if role in current:
                local_isl = pred.local_isl if has_prefill else pred.isl
                n, why = decode_replicas(p, rate, pred.isl, pred.osl, itl_s, rate * (1 - remote), local_isl,
                                         inflight)
                if role == "both" and not has_prefill:
                    n_pf, why_pf = prefill_replicas(p, rate, pred.isl, ttft_s, self.cfg.max_prefill_util)
                    if n_pf > n:
                        n, why = n_pf, why_pf
                out[role] = Proposal(n, why)
        return out
