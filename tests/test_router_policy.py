"""Cost functions (measured and Dynamo's), softmax temperature, modes, shared load and its local mirror,
step costs from heartbeats, shedding (KV occupancy and predicted TTFT), block-size refusal, no herding."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from farm.cluster import registry
from farm.config import load_config
from farm.router.load import LoadTracker
from farm.router.policy import Candidate, RoundRobin, dynamo_costs, softmax_pick
from farm.router.router import BusyError, Router


def test_dynamo_cost_is_weighted_prefill_blocks_plus_active_blocks():
    cands = [Candidate("cached", overlap_blocks=8, active_blocks=4),
             Candidate("cold", overlap_blocks=0, active_blocks=0),
             Candidate("queued", overlap_blocks=0, pending_prefill_blocks=5)]
    # request of 10 blocks, weight 2: cached 2*2 + 4+10 = 18; cold 2*10 + 10 = 30; queued 2*15 + 10 = 40
    assert dynamo_costs(cands, 10, 2.0) == [18, 30, 40]
    assert dynamo_costs(cands, 10, 0.0) == [14, 10, 10]


def test_temperature_zero_is_cheapest_and_ties_are_fair():
    rng = random.Random(0)
    assert {softmax_pick([3, 1, 2], 0, rng) for _ in range(50)} == {1}
    picks = Counter(softmax_pick([1, 1, 5], 0, rng) for _ in range(3000))
    assert set(picks) == {0, 1} and abs(picks[0] - picks[1]) < 300


def test_temperature_spreads_choices_in_cost_order():
    rng = random.Random(1)
    picks = Counter(softmax_pick([0, 5, 10], 1.0, rng) for _ in range(6000))
    assert picks[0] > picks[1] > picks[2] > 0
    cold = Counter(softmax_pick([0, 5, 10], 0.05, rng) for _ in range(2000))
    assert cold[0] > 1990


def test_round_robin_cycles():
    rr = RoundRobin()
    assert [rr.pick(3) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_load_is_shared_idempotent_and_reaped(redis_client):
    a, b = LoadTracker(redis_client, max_request_s=60), LoadTracker(redis_client, max_request_s=60)
    a.begin("p", "w1", "r1", 100)
    a.begin("p", "w1", "r1", 100)  # placing twice counts once
    a.begin("d", "w1", "r1", 7)
    assert b.loads() == {"w1": {"p": 100, "pn": 1, "d": 7, "dn": 1}}  # another replica sees it
    assert b.end("p", "w1", "r1") and not a.end("p", "w1", "r1")
    assert a.loads()["w1"] == {"p": 0, "pn": 0, "d": 7, "dn": 1}
    assert a.reap(now=time.time() + 3600) == 1  # the API that placed r1 died: the deadline ends it
    assert a.loads()["w1"] == {"p": 0, "pn": 0, "d": 0, "dn": 0}


def workers(r, n, block_size=16, num_blocks=100):
    out = []
    for i in range(n):
        info = registry.WorkerInfo(f"w{i}", "both", "m", "h", i, block_size, num_blocks=num_blocks)
        registry.register(r, info)
        out.append(info)
    return out


def make_router(redis_client, **router):
    cfg = load_config(environ={})
    cfg = cfg.model_copy(update={"router": cfg.router.model_copy(update=router)})
    return Router(cfg, redis_client, follow=False)


def test_modes_distribute_as_named(redis_client):
    ws = workers(redis_client, 4)
    rr = make_router(redis_client, mode="round-robin")
    assert [rr.choose(ws, [], 32, "both").worker.worker_id for _ in range(8)] == ["w0", "w1", "w2", "w3"] * 2
    rnd = make_router(redis_client, mode="random")
    counts = Counter(rnd.choose(ws, [], 32, "both").worker.worker_id for _ in range(2000))
    assert set(counts) == {"w0", "w1", "w2", "w3"} and min(counts.values()) > 380


def test_kv_mode_prefers_the_worker_holding_the_prefix(redis_client):
    ws = workers(redis_client, 4)
    router = make_router(redis_client, mode="kv")
    hashes = router.hashes(list(range(320)))  # 20 blocks
    router.index.store("w2", hashes[:15])
    p = router.choose(ws, hashes, 320, "both")
    assert p.worker.worker_id == "w2" and p.overlap_blocks == 15
    assert set(p.timings_us) == {"hash", "index", "load", "schedule"}


def test_dynamo_cost_stops_herding_once_the_holder_is_loaded(redis_client):
    """Dynamo's cost: requests sharing a system prompt go to its holder until its decode load outweighs
    the reuse (overlap_weight 1: one cached block is worth one active block)."""
    ws = workers(redis_client, 4, num_blocks=100_000)
    router = make_router(redis_client, mode="kv", cost="dynamo", busy_threshold=0)
    hashes = router.hashes(list(range(160)))  # 10 shared blocks
    router.index.store("w0", hashes)
    chosen = []
    for i in range(40):
        p = router.choose(ws, hashes, 160, "both")
        router.loads.begin("d", p.worker.worker_id, f"req{i}", 10)  # the request keeps decoding
        chosen.append(p.worker.worker_id)
    counts = Counter(chosen)
    assert chosen[0] == "w0"
    assert len(counts) == 4  # spread out instead of piling onto w0
    assert counts["w0"] == max(counts.values())  # but the holder still gets the largest share


def test_all_workers_busy_sheds_with_retry_after(redis_client):
    ws = workers(redis_client, 2, num_blocks=10)
    router = make_router(redis_client, busy_threshold=0.5, retry_after_s=3)
    for w in ws:
        router.loads.begin("d", w.worker_id, "big", 9)
    with pytest.raises(BusyError) as e:
        router.choose(ws, [], 16, "both")
    assert e.value.retry_after_s == 3
    router.loads.end("d", "w1", "big")
    assert router.choose(ws, [], 16, "both").worker.worker_id == "w1"


def test_worker_with_other_block_size_is_refused(redis_client, caplog):
    ws = workers(redis_client, 1) + [registry.WorkerInfo("odd", "both", "m", "h", 9, 32, num_blocks=100)]
    router = make_router(redis_client, mode="round-robin")
    picked = {router.choose(ws, [], 16, "both").worker.worker_id for _ in range(6)}
    assert picked == {"w0"}
    assert any("REFUSING worker odd" in rec.message for rec in caplog.records)
    with pytest.raises(LookupError):
        router.choose(ws[1:], [], 16, "both")


def test_approximate_mode_predicts_from_own_placements_with_ttl(redis_client):
    ws = workers(redis_client, 3)
    router = make_router(redis_client, mode="kv", use_kv_events=False, approx_ttl_s=0.3)
    hashes = router.hashes(list(range(64)))
    first = router.choose(ws, hashes, 64, "both").worker.worker_id
    again = router.choose(ws, hashes, 64, "both")
    assert again.worker.worker_id == first and again.overlap_blocks == 4
    time.sleep(0.35)
    assert router.choose(ws, [], 0, "both") is not None
    router.index.expire()
    assert router.index.overlaps(hashes) == {}
