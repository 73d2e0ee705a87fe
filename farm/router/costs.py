"""Each worker's step costs as the router knows them: measured by the worker, read from its heartbeat.

Workers publish `costs` in their heartbeat stats (farm.engine.step_costs: prefill ms per block and per
step, decode ms per step and per active block, and how many steps each figure rests on). A figure a
worker has not measured yet is taken from the live workers of its model that have (the same model on
the same kind of machine costs about the same), else from `router.cost_prior`. So is a line the worker could
not separate into a step's base and a slope (its steps all held about as much work: its line goes through the
origin, and its slope, the whole step per unit, would make each block a placement adds look several times
dearer than it is), when a peer has one. So is a figure gone stale:
a worker that has run no step of a kind for `STALE_AFTER_S` keeps what it measured last, perhaps in a
contended moment, and would lose every placement on it and never measure again; its model's workers with
fresh figures speak for it instead (their median), until it runs steps of its own again.

Beside the step costs, how long requests decode: the mean output tokens of the requests a model's workers
finished (`request_generation_tokens` in their heartbeat's histograms, the series vLLM exports), the horizon
over which the cost weighs a placement's effect on a worker's decode batch (farm.router.policy). And what its
prefix cache is worth: how many later prompt blocks an average cached block served before it was evicted (the
worker's prefix hits over its misses, `prefix_hit_tokens` / `prefix_query_tokens` in its heartbeat), and how
many of its blocks hold nothing yet (`blocks_total` - `cached_blocks`): a placement that prefills more blocks
than that evicts blocks worth the reuse they would have given.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from farm.config import CostPrior

STALE_AFTER_S = 10.0  # seconds without a step of a kind after which a worker's own figure yields to its peers'


@dataclass(frozen=True)
class WorkerCosts:
    """Seconds, per prefill block and step, per decode step and active decode block."""

    prefill_s_per_block: float
    prefill_step_s: float
    decode_step_s: float
    decode_s_per_block: float
    measured: bool = False  # both halves are this worker's own figures, and fresh
    decode_tokens: float = 0.0  # mean output tokens of its model's finished requests (0: none finished yet)
    block_reuse: float = 0.0  # later prompt blocks a cached block served on average (its hits / its misses)
    empty_blocks: float = math.inf  # cache blocks holding nothing: prefilling into them evicts nothing

    @classmethod
    def prior(cls, p: CostPrior) -> WorkerCosts:
        return cls(p.prefill_ms_per_block / 1000, p.prefill_step_ms / 1000, p.decode_step_ms / 1000,
                   p.decode_ms_per_block / 1000)

    def decode_step(self, active_blocks: float) -> float:
        """Seconds of one decode step over `active_blocks` KV blocks."""
        return self.decode_step_s + self.decode_s_per_block * active_blocks


_PREFILL = ("prefill_ms_per_block", "prefill_step_ms")
_DECODE = ("decode_step_ms", "decode_ms_per_block")


def _measured(costs: Any, half: tuple[str, str], samples: str) -> tuple[float, float] | None:
    """One half (prefill or decode) of a heartbeat's `costs`, in seconds, if the worker has measured it."""
    if not isinstance(costs, dict) or not costs.get(samples):
        return None
    try:
        a, b = (float(costs[k]) / 1000 for k in half)
    except (KeyError, TypeError, ValueError):
        return None
    if not (a >= 0 and b >= 0) or a + b <= 0:
        return None
    return a, b


def _generated(hb: Any) -> tuple[float, float]:
    """(output tokens, requests) the worker's engine finished generating, from its heartbeat's histograms."""
    try:
        h = hb["histograms"]["request_generation_tokens"]
        total, count = float(h["sum"]), float(h["count"])
    except (KeyError, TypeError, ValueError):
        return 0.0, 0.0
    return (total, count) if total >= 0 and count > 0 else (0.0, 0.0)


def _cache_value(hb: Any) -> tuple[float, float]:
    """(block_reuse, empty_blocks) from the worker's own heartbeat: prefix hits per miss since it started (each
    missed block is stored once, so that is what a stored block served before eviction, on average), and its
    cache blocks holding no prefix. (0, inf) when it reports neither: nothing is charged for eviction."""
    try:
        hits, queries = float(hb["prefix_hit_tokens"]), float(hb["prefix_query_tokens"])
        reuse = hits / max(queries - hits, 1.0) if 0 <= hits <= queries else 0.0
    except (KeyError, TypeError, ValueError):
        reuse = 0.0
    try:
        empty = max(0.0, float(hb["blocks_total"]) - float(hb["cached_blocks"]))
    except (KeyError, TypeError, ValueError):
        empty = math.inf
    return reuse, empty


def _stale(costs: Any, idle: str) -> bool:
    """Whether the worker has run no step of this kind for STALE_AFTER_S (no age published: fresh)."""
    try:
        return float(costs[idle]) > STALE_AFTER_S
    except (KeyError, TypeError, ValueError):
        return False


Figures = dict[str, tuple[float, float]]  # worker id -> one half of its costs, in seconds


def _figures(heartbeats: dict[str, dict[str, Any]], kind: str, half: tuple[str, str]
             ) -> tuple[Figures, Figures, Figures]:
    """(fresh, unseparated, stale): the workers' measured figures of one kind ("prefill" or "decode"); fresh
    ones whose line went through the origin (`<kind>_separated` false: too little spread in the amounts to
    tell the step's base from the per-unit slope) apart, since their slope overstates a marginal block."""
    fresh: Figures = {}
    unseparated: Figures = {}
    stale: Figures = {}
    for wid, hb in heartbeats.items():
        costs = hb.get("costs") if isinstance(hb, dict) else None
        if (pair := _measured(costs, half, f"{kind}_samples")) is not None:
            if _stale(costs, f"{kind}_idle_s"):
                stale[wid] = pair
            else:
                (fresh if costs.get(f"{kind}_separated", True) else unseparated)[wid] = pair
    return fresh, unseparated, stale


class CostBook:
    """worker id -> WorkerCosts, refreshed from heartbeats (IndexFollower's maintenance, about every second)."""

    def __init__(self, prior: CostPrior):
        self.prior = WorkerCosts.prior(prior)
        self._by_worker: dict[str, WorkerCosts] = {}

    def update(self, models: dict[str, str], heartbeats: dict[str, dict[str, Any]]) -> None:
        """`models`: live worker id -> model; `heartbeats`: worker id -> its heartbeat (stats included)."""
        prefill, rough_prefill, old_prefill = _figures(heartbeats, "prefill", _PREFILL)
        decode, rough_decode, old_decode = _figures(heartbeats, "decode", _DECODE)
        by_model: dict[str, list[str]] = {}
        for wid, model in models.items():
            by_model.setdefault(model, []).append(wid)
        horizon = {model: _mean_tokens(heartbeats, peers) for model, peers in by_model.items()}
        book = {}
        for wid, model in models.items():
            peers = by_model[model]
            p, own_p = _pick(wid, peers, prefill, rough_prefill, old_prefill)
            d, own_d = _pick(wid, peers, decode, rough_decode, old_decode)
            pr = self.prior
            reuse, empty = _cache_value(heartbeats.get(wid))
            book[wid] = WorkerCosts(*(p or (pr.prefill_s_per_block, pr.prefill_step_s)),
                                    *(d or (pr.decode_step_s, pr.decode_s_per_block)),
                                    measured=own_p and own_d, decode_tokens=horizon[model],
                                    block_reuse=reuse, empty_blocks=empty)
        self._by_worker = book

    def of(self, worker_id: str) -> WorkerCosts:
        return self._by_worker.get(worker_id, self.prior)


def _mean_tokens(heartbeats: dict[str, dict[str, Any]], workers: list[str]) -> float:
    """Mean output tokens per finished request over `workers` (one model's), 0 when none finished."""
    total = count = 0.0
    for w in workers:
        t, n = _generated(heartbeats.get(w))
        total, count = total + t, count + n
    return total / count if count else 0.0


def _pick(wid: str, peers: list[str], fresh: Figures, unseparated: Figures, stale: Figures
          ) -> tuple[tuple[float, float] | None, bool]:
    """The worker's own fresh line, else its peers' fresh lines, else the same for fresh lines through the
    origin, else its own stale figure, else its peers'; and whether it is the worker's own fresh figure."""
    for figures in (fresh, unseparated, stale):
        if (own := figures.get(wid)) is not None:
            return own, figures is not stale
        if (theirs := _median([figures[w] for w in peers if w in figures])) is not None:
            return theirs, False
    return None, False


def _median(pairs: list[tuple[float, float]]) -> tuple[float, float] | None:
    if not pairs:
        return None
    return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
