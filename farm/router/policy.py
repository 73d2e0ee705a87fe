"""Choosing a worker: a cost per candidate, softmax over it; round-robin and random beside it.

Two costs (`router.cost`):
- `measured` (default): the predicted time to first token on the worker, in seconds, from the step costs
  the worker measured itself (farm.router.costs):
      prefill_step + prefill_per_block x (blocks queued there for prefill + this request's uncached blocks)
      + one decode step over the blocks decoding there (the step in progress; prefill steps go first)
  so a cached prefix is worth exactly the prefill time it saves, and load exactly the wait it causes: on a
  CPU worker, where a prefill block costs fifty times an active decode block, a request follows its cache
  until the holder's prefill queue costs more than recomputing elsewhere. For a decode-only placement,
  the decode step it would join.
- `dynamo`: Dynamo's `overlap_weight x (blocks still to prefill) + (blocks active)`, where the blocks still
  to prefill are the request's blocks beyond the cached overlap plus those queued for prefill, and the
  active blocks are the worker's decoding blocks plus this request's.
The choice is softmax over -cost / temperature (costs normalised to [0, 1] first, as Dynamo does);
temperature 0 is always the cheapest, with ties broken at random so equal workers share the load.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from farm.router.costs import WorkerCosts


@dataclass(slots=True)
class Candidate:
    worker: str
    overlap_blocks: float = 0  # leading request blocks cached on the worker, weighted by tier
    pending_prefill_blocks: float = 0.0  # prompt blocks queued for prefill there
    active_blocks: float = 0.0  # blocks of requests decoding there
    capacity_blocks: int = 0  # the worker's KV cache size
    costs: WorkerCosts | None = None  # its step costs (measured, or the prior)


def dynamo_costs(cands: list[Candidate], request_blocks: int, overlap_weight: float) -> list[float]:
    costs = []
    for c in cands:
        prefill = max(0, request_blocks - c.overlap_blocks) + c.pending_prefill_blocks
        active = c.active_blocks + request_blocks
        costs.append(overlap_weight * prefill + active)
    return costs


def predicted_ttft(c: Candidate, request_blocks: int) -> float:
    """Seconds until the worker would send this request's first token (prefill steps run before decode
    steps, so the wait is the prefill queued there, this request's uncached blocks, and the step in progress)."""
    k = c.costs
    assert k is not None, "a measured cost needs the worker's step costs"
    blocks = c.pending_prefill_blocks + max(0.0, request_blocks - c.overlap_blocks)
    ttft = k.prefill_step_s + k.prefill_s_per_block * blocks
    return ttft + (k.decode_step(c.active_blocks) if c.active_blocks > 0 else 0.0)


def has_queue(c: Candidate) -> bool:
    """Whether a request placed on the worker would wait behind other work (an idle worker never does)."""
    return c.pending_prefill_blocks > 0 or c.active_blocks > 0


def measured_costs(cands: list[Candidate], request_blocks: int, stage: str) -> list[float]:
    """Seconds: predicted TTFT (prefill and aggregated placements), or the decode step the request would join."""
    if stage == "decode":
        return [c.costs.decode_step(c.active_blocks + request_blocks) if c.costs else 0.0 for c in cands]
    return [predicted_ttft(c, request_blocks) for c in cands]


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
