"""Choosing a worker: a cost per candidate, softmax over it; least-loaded, round-robin and random beside it.

Two costs (`router.cost`):
- `measured` (default): the seconds of user-visible latency a placement adds, summed over the requests it
  touches, from the step costs the worker measured itself (farm.router.costs). For a request of R prompt
  blocks, O of them cached on the worker, n requests already there (decoding, or queued ahead of it and
  decoding by the time it prefills), A blocks of theirs, D = the model's mean output tokens (measured):
      TTFT   = prefill_step + prefill_per_block x (blocks queued for prefill + R - O) + one decode step over A
      stall  = max(n, L) x (prefill_step + prefill_per_block x (R - O))   each of them waits out its prefill
      decode = D x (decode_step(A + R) + n x decode_per_block x R)  its own tokens, and every step of
               theirs longer by its blocks while it decodes
      evict  = prefill_per_block x reuse x (R - O - E)+   the later prefills of the blocks it evicts
      cost   = TTFT + stall + decode + evict
  where L is the mean of n over the candidates: under load a worker with fewer requests than that does not stay
  so, the router places the next arrivals there and they wait out this prefill too (an idle worker of a busy
  pool is not free; without this, a tenant held by a busy worker moves to an idle one and is prefilled twice).
  E is the worker's cache blocks holding nothing and reuse its prefix hits per miss (what a stored
  block served, on average, before it was evicted): once a cache is full, each block a placement prefills
  evicts one that would have saved `reuse` prefills of a block later. That is what keeps a tenant's prefix
  on one worker under load instead of copied onto both, each copy evicting other tenants' (an LRU's oldest
  block is worth less than the average one, so this errs towards staying). A cached prefix is worth the
  prefill it saves on TTFT and on the stall, and the eviction it spares; a worker's decode batch weighs
  what joining it costs the batch. A prefill-only placement has no decode there (TTFT + stall + evict); a
  decode-only one only the decode term, over at least the one step it joins. Before any request has
  finished, D = 0: TTFT + stall + evict.
- `dynamo`: Dynamo's `overlap_weight x (blocks still to prefill) + (blocks active)`, where the blocks still
  to prefill are the request's blocks beyond the cached overlap plus those queued for prefill, and the
  active blocks are the worker's decoding blocks plus this request's.
The choice is softmax over -cost / temperature (costs normalised to [0, 1] first, as Dynamo does);
temperature 0 is always the cheapest, with ties broken at random so equal workers share the load.

`least-loaded` is the cache-blind baseline: the fewest requests outstanding on the worker, ties by the
predicted load (the measured TTFT or decode step with no cached prefix), then at random.
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
    requests: int = 0  # requests holding decode load there (decoding, or prefilling before they decode)
    pending_requests: int = 0  # requests queued for prefill there


def dynamo_costs(cands: list[Candidate], request_blocks: int, overlap_weight: float) -> list[float]:
    costs = []
    for c in cands:
        prefill = max(0, request_blocks - c.overlap_blocks) + c.pending_prefill_blocks
        active = c.active_blocks + request_blocks
        costs.append(overlap_weight * prefill + active)
    return costs


def _costs(c: Candidate) -> WorkerCosts:
    assert c.costs is not None, "a measured cost needs the worker's step costs"
    return c.costs


def own_prefill(c: Candidate, request_blocks: int) -> float:
    """Seconds of this request's own prefill on the worker (its uncached blocks)."""
    k = _costs(c)
    return k.prefill_step_s + k.prefill_s_per_block * max(0.0, request_blocks - c.overlap_blocks)


def predicted_ttft(c: Candidate, request_blocks: int) -> float:
    """Seconds until the worker would send this request's first token (prefill steps run before decode
    steps, so the wait is the prefill queued there, this request's uncached blocks, and the step in progress)."""
    k = _costs(c)
    ttft = own_prefill(c, request_blocks) + k.prefill_s_per_block * c.pending_prefill_blocks
    return ttft + (k.decode_step(c.active_blocks) if c.active_blocks > 0 else 0.0)


def decode_cost(c: Candidate, request_blocks: int, decode_tokens: float) -> float:
    """Seconds its decoding adds: its own `decode_tokens` steps over the worker's batch, and each of them
    longer, for every request there, by its blocks (each step reads every active block)."""
    k = _costs(c)
    return decode_tokens * (k.decode_step(c.active_blocks + request_blocks)
                            + c.requests * k.decode_s_per_block * request_blocks)


def eviction_cost(c: Candidate, request_blocks: int) -> float:
    """Seconds of later prefill the placement causes by evicting cached blocks: its uncached blocks beyond the
    worker's empty ones, each worth the worker's measured reuse of a cached block."""
    k = _costs(c)
    evicted = max(0.0, request_blocks - c.overlap_blocks - k.empty_blocks)
    return k.prefill_s_per_block * k.block_reuse * evicted


def placement_cost(c: Candidate, request_blocks: int, stage: str, decode_tokens: float | None = None,
                   ttft: float | None = None, pool_requests: float = 0.0) -> float:
    """The `measured` cost (module docstring): seconds of latency the placement adds, summed over the new
    request and those its prefill stalls: the worker's requests, or `pool_requests` (the candidates' mean) when
    more. `decode_tokens` None: the model's measured mean."""
    k = _costs(c)
    d = k.decode_tokens if decode_tokens is None else decode_tokens
    if stage == "decode":
        return decode_cost(c, request_blocks, max(d, 1.0))
    if ttft is None:
        ttft = predicted_ttft(c, request_blocks)
    stalled = max(c.requests, pool_requests)
    cost = ttft + stalled * own_prefill(c, request_blocks) + eviction_cost(c, request_blocks)
    return cost if stage == "prefill" else cost + decode_cost(c, request_blocks, d)


def has_queue(c: Candidate) -> bool:
    """Whether a request placed on the worker would wait behind other work (an idle worker never does)."""
    return c.pending_prefill_blocks > 0 or c.active_blocks > 0


def measured_costs(cands: list[Candidate], request_blocks: int, stage: str, decode_tokens: float | None = None,
                   ttfts: list[float] | None = None) -> list[float]:
    """`placement_cost` per candidate (`ttfts`: their predicted TTFTs, when computed already)."""
    pool = sum(c.requests for c in cands) / len(cands) if cands else 0.0
    return [placement_cost(c, request_blocks, stage, decode_tokens, ttfts[i] if ttfts else None, pool)
            for i, c in enumerate(cands)]


def outstanding(c: Candidate, stage: str) -> int:
    """Requests on the worker that a new one of `stage` competes with: queued prefills on a prefill worker,
    requests holding decode load elsewhere (an aggregated request holds both, so it is counted once)."""
    if stage == "prefill":
        return c.pending_requests
    return c.requests if stage == "decode" else max(c.requests, c.pending_requests)


def least_loaded_pick(cands: list[Candidate], request_blocks: int, stage: str, rng: random.Random) -> int:
    """The cache-blind baseline: fewest outstanding requests, ties by the predicted load with nothing cached
    (the measured TTFT, or the decode step it joins), then at random."""
    def load(c: Candidate) -> float:
        if c.costs is None:
            return c.pending_prefill_blocks + c.active_blocks
        if stage == "decode":
            return c.costs.decode_step(c.active_blocks + request_blocks)
        blind = Candidate(c.worker, 0, c.pending_prefill_blocks, c.active_blocks, costs=c.costs)
        return predicted_ttft(blind, request_blocks)

    keys = [(outstanding(c, stage), load(c)) for c in cands]
    lo = min(keys)
    return rng.choice([i for i, k in enumerate(keys) if k == lo])


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
