"""Load-based policy: replica counts from queue depths, in-flight requests and KV-cache use.

Each role's utilisation is the largest of its load signals per ready worker, each divided by what one
worker counts as fully loaded. Above `scale_up_util` for `up_intervals` consecutive readings the role
grows to the count that brings utilisation back to the middle of the band; below `scale_down_util` for
`down_intervals` readings it shrinks by one, and only if the remaining workers would still sit below
`scale_up_util` (the band between the two thresholds is the hysteresis that prevents flapping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from farm.config.planner import LoadPolicyConfig
from farm.planner.signals import RoleSignals


@dataclass
class Proposal:
    desired: int
    reason: str
    util: float = 0.0


class LoadPolicy:
    def __init__(self, cfg: LoadPolicyConfig):
        self.cfg = cfg
        self._high: dict[tuple[str, str], int] = {}  # consecutive readings above the band
        self._low: dict[tuple[str, str], int] = {}  # consecutive readings below it

    def components(self, s: RoleSignals) -> dict[str, float]:
        """Load per ready worker, by signal, as a fraction of one fully loaded worker."""
        n = max(1, s.workers)
        c = self.cfg
        out = {"queue": s.queued / (n * c.queued_per_worker)}
        if s.role in ("prefill", "both"):
            out["prefill"] = s.pending_tokens / (n * c.prefill_tokens_per_worker)
        if s.role in ("decode", "both"):
            out["decode"] = s.decoding / (n * c.decode_requests_per_worker)
            out["kv"] = s.kv_util * c.kv_util_weight
        return out

    def utilisation(self, s: RoleSignals) -> tuple[float, str]:
        comps = self.components(s)
        name = max(comps, key=lambda k: comps[k])
        return comps[name], name

    def propose(self, key: tuple[str, str], s: RoleSignals, current: int) -> Proposal:
        """How many workers `key` = (model, role) should have, from this reading and the ones before."""
        c = self.cfg
        util, what = self.utilisation(s)
        ready = s.workers
        if ready == 0 and (s.queued or s.pending_requests or s.decoding):
            self._high[key], self._low[key] = self._high.get(key, 0) + 1, 0
            return Proposal(max(current, 1), f"work waiting ({s.queued} queued) and no ready worker", util)
        if util > c.scale_up_util:
            self._high[key], self._low[key] = self._high.get(key, 0) + 1, 0
            if self._high[key] < c.up_intervals:
                return Proposal(current, f"{what} util {util:.2f} > {c.scale_up_util} "
                                         f"({self._high[key]}/{c.up_intervals} readings)", util)
            middle = (c.scale_up_util + c.scale_down_util) / 2
            want = max(current + 1, math.ceil(ready * util / middle))
            return Proposal(want, f"{what} util {util:.2f} > {c.scale_up_util}", util)
        if util < c.scale_down_util and current > 0:
            self._low[key], self._high[key] = self._low.get(key, 0) + 1, 0
            if current > 1:
                after = util * ready / (current - 1)
            else:
                after = 0.0 if util == 0 else math.inf  # the last worker goes only when idle
            if after >= c.scale_up_util:
                return Proposal(current, f"{what} util {util:.2f} low, but {after:.2f} with one fewer", util)
            if self._low[key] < c.down_intervals:
                return Proposal(current, f"{what} util {util:.2f} < {c.scale_down_util} "
                                         f"({self._low[key]}/{c.down_intervals} readings)", util)
            return Proposal(current - 1, f"{what} util {util:.2f} < {c.scale_down_util}", util)
        self._high[key] = self._low[key] = 0
        return Proposal(current, f"{what} util {util:.2f} within [{c.scale_down_util}, {c.scale_up_util}]", util)

    def reset(self, key: tuple[str, str]) -> None:
        """Forget the streaks of `key` (after a change: the next readings describe a new farm)."""
        self._high.pop(key, None)
        self._low.pop(key, None)
