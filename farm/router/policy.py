"""Choosing a worker: Dynamo's KV-aware cost function with softmax sampling, round-robin, random.

cost(w) = overlap_weight x (prefill blocks w would still compute) + (blocks active on w)
where the blocks still to compute are the request's blocks beyond w's cached overlap plus the prompt
blocks already queued on w for prefill, and the active blocks are w's decoding blocks plus this request's.
The choice is softmax over -cost / temperature (costs normalised to [0, 1] first, as Dynamo does);
temperature 0 is always the cheapest, with ties broken at random so equal workers share the load.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass


@dataclass
class Candidate:
    worker: str
    overlap_blocks: float = 0  # leading request blocks cached on the worker, weighted by tier
    pending_prefill_blocks: float = 0.0  # prompt blocks queued for prefill there
    active_blocks: float = 0.0  # blocks of requests decoding there
    capacity_blocks: int = 0  # the worker's KV cache size


def kv_costs(cands: list[Candidate], request_blocks: int, overlap_weight: float) -> list[float]:
    costs = []
    for c in cands:
        prefill = max(0, request_blocks - c.overlap_blocks) + c.pending_prefill_blocks
        active = c.active_blocks + request_blocks
        costs.append(overlap_weight * prefill + active)
    return costs


def softmax_pick(costs: list[float], temperature: float, rng: random.Random) -> int:
    lo = min(costs)
    if temperature <= 0:
        best = [i for i, c in enumerate(costs) if c == lo]
        return rng.choice(best)
    hi = max(costs)
    span = (hi - lo) or 1.0
    weights = [math.exp(-((c - lo) / span) / temperature) for c in costs]
    return rng.choices(range(len(costs)), weights=weights)[0]


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, n: int) -> int:
        return next(self._counter) % n
