"""Cost functions (measured and Dynamo's), softmax temperature, modes, shared load and its local mirror,
step costs from heartbeats, shedding (KV occupancy and predicted TTFT), block-size refusal, no herding; the
measured cost's trade between the new request's TTFT and the decode batch it joins (ITL), and the cache-blind
least-loaded baseline it must match where nothing is shared."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from farm.cluster import registry
from farm.config import load_config
from farm.router.costs import WorkerCosts
from farm.router.load import LoadTracker
from farm.router.policy import (
    Candidate,
    RoundRobin,
    dynamo_costs,
    least_loaded_pick,
    measured_costs,
    own_prefill,
    predicted_ttft,
    softmax_pick,
)
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


# -- the decode batch in the cost, and the least-loaded baseline ---------------------------------------------
CPU_COSTS = {"prefill_ms_per_block": 36.0, "prefill_step_ms": 85.0, "prefill_samples": 9,
             "decode_step_ms": 32.0, "decode_ms_per_block": 0.7, "decode_samples": 9}


def beat(r, worker_id: str, output_tokens: int = 16, finished: int = 10, cache: dict | None = None,
         **costs) -> None:
    """A heartbeat with measured step costs and `finished` requests of `output_tokens` each (`cache`: the
    prefix cache's stats, as engines report them)."""
    gen = {"le": [float("inf")], "counts": [finished], "sum": output_tokens * finished, "count": finished}
    registry.heartbeat(r, worker_id, {"costs": {**CPU_COSTS, **costs}, **(cache or {}),
                                      "histograms": {"request_generation_tokens": gen}})


def test_least_loaded_counts_requests_and_ignores_the_cache(redis_client):
    ws = workers(redis_client, 3)
    router = make_router(redis_client, mode="least-loaded")
    hashes = router.hashes(list(range(320)))
    router.index.store("w0", hashes)  # the whole prompt cached on w0: least-loaded does not look
    router.loads.begin_many([("p", "w0", "a", 16), ("d", "w0", "a", 1), ("d", "w1", "b", 1), ("d", "w1", "c", 1)])
    p = router.choose(ws, hashes, 320, "both")
    assert p.worker.worker_id == "w2" and p.mode == "least-loaded" and p.overlap_blocks == 0
    router.loads.begin("d", "w2", "d", 1)
    router.loads.begin("d", "w2", "e", 1)
    assert router.choose(ws, hashes, 320, "both").worker.worker_id == "w0"  # 1 request against 2 and 2
    k = WorkerCosts(0.036, 0.085, 0.032, 0.0007)  # equal counts: the smaller predicted load wins
    cands = [Candidate("a", active_blocks=90, costs=k, requests=1), Candidate("b", active_blocks=10, costs=k,
                                                                           requests=1)]
    assert least_loaded_pick(cands, 20, "both", random.Random(0)) == 1


def test_measured_horizon_is_the_models_mean_output_tokens(redis_client):
    ws = workers(redis_client, 2)
    beat(redis_client, "w0", output_tokens=10, finished=3)
    beat(redis_client, "w1", output_tokens=30, finished=1)
    router = make_router(redis_client)
    router.refresh_costs(ws)
    assert router.costs.of("w0").decode_tokens == router.costs.of("w1").decode_tokens == 15.0  # (30 + 30) / 4


def placements(cost: str, ws_costs: list[WorkerCosts], blocks: int, arrivals: int
               ) -> tuple[list[int], list[int], int]:
    """A no-sharing workload on workers whose measured costs differ a little (as on one host they do):
    requests of `blocks` uncached blocks arrive one by one, each stays decoding, every third arrival the
    oldest one ends. Returns the kv choices under `cost`, least-loaded's choices in the same states, and the
    largest difference in requests between two workers at any moment (packing)."""
    rng = random.Random(3)
    cands = [Candidate(f"w{i}", costs=k) for i, k in enumerate(ws_costs)]
    kv, ll, live = [], [], []
    spread = 0
    for n in range(arrivals):
        costs = ([predicted_ttft(c, blocks) for c in cands] if cost == "ttft"
                 else measured_costs(cands, blocks, "both"))
        i = softmax_pick(costs, 0, rng)
        kv.append(i)
        ll.append(least_loaded_pick(cands, blocks, "both", rng))
        cands[i].requests += 1
        cands[i].active_blocks += blocks
        live.append(i)
        spread = max(spread, max(c.requests for c in cands) - min(c.requests for c in cands))
        if n % 3 == 2:
            j = live.pop(0)
            cands[j].requests -= 1
            cands[j].active_blocks -= blocks
    return kv, ll, spread


def test_no_sharing_kv_chooses_as_least_loaded_does_and_does_not_pack():
    ws_costs = [WorkerCosts(0.036 * f, 0.085, 0.032, 0.0007, decode_tokens=16) for f in (1.0, 0.92, 1.05, 1.1)]
    kv, ll, spread = placements("measured", ws_costs, 15, 24)
    assert kv == ll and spread == 1
    # predicted TTFT alone (the former cost) packs decodes onto the worker that measured fastest
    ttft_only, ll, spread = placements("ttft", ws_costs, 15, 24)
    assert ttft_only != ll and spread >= 3 and Counter(ttft_only).most_common(1)[0][0] == 1


def test_shared_prefix_stays_with_its_holder_until_the_holders_batch_pays_more_than_the_prefill_saved(
        redis_client):
    """The holder has 36 of the request's 40 blocks; each request decoding there (40 blocks) makes the holder
    dearer by its stall (the new request's prefill) and by what the two slow each other's decode steps. The idle
    worker is not free either: half the pool's requests would wait out the prefill it does there (the next
    arrivals placed on it)."""
    ws = workers(redis_client, 2)
    for w in ws:
        beat(redis_client, w.worker_id, output_tokens=16)
    router = make_router(redis_client, prediction_ttl_s=1e-6)
    router.refresh_costs(ws)
    hashes = router.hashes(list(range(640)))  # 40 blocks of 16
    router.index.store("w0", hashes[:36])
    k = router.costs.of("w0")
    assert k.decode_tokens == 16
    other = Candidate("w1", 0, costs=k)

    def saved(n: int) -> float:  # what the holder's cached blocks save: the prefill, and the pool's stall of it
        return k.prefill_s_per_block * 36 + n / 2 * own_prefill(other, 40)

    def suffers(n: int) -> float:  # what placing on the holder costs its batch of n, beyond the other worker
        holder = Candidate("w0", 36, 0, 40 * n, costs=k, requests=n)
        return (k.decode_step(40 * n) if n else 0.0) + n * own_prefill(holder, 40) \
            + 16 * k.decode_s_per_block * (40 * n + n * 40)

    chosen = []
    for n in range(6):
        chosen.append(router.choose(ws, hashes, 640, "both").worker.worker_id)
        assert chosen[-1] == ("w0" if suffers(n) < saved(n) else "w1"), n
        router.loads.begin("d", "w0", f"decoding-{n}", 40)
    assert chosen[0] == "w0" and chosen[-1] == "w1"  # both sides of the trade are reached
    # without a decode batch on the holder, any cached prefix wins
    redis_client.delete(*redis_client.keys("farm:load*"), *redis_client.keys("farm:active*"))
    assert router.choose(ws, hashes, 640, "both").worker.worker_id == "w0"


def test_a_full_cache_keeps_a_prefix_on_its_holder_where_an_empty_one_lets_load_move_it(redis_client):
    """Once caches are full, each block a placement prefills evicts one worth the worker's measured reuse
    (prefix hits per miss): copying a held prefix onto another worker costs the prefills of what it evicts
    there, so the holder keeps it under a load that would move it while caches still have room. With the
    prefix nowhere, the worker whose cached blocks are reused least gives up its blocks."""
    ws = workers(redis_client, 2)
    router = make_router(redis_client, prediction_ttl_s=1e-6)
    hashes = router.hashes(list(range(640)))  # 40 blocks of 16
    router.index.store("w0", hashes[:36])
    router.loads.begin("d", "w0", "decoding", 40)  # the holder is busy: a request decoding, a prefill queued
    router.loads.begin("p", "w0", "queued", 30 * 16)

    def place(cached_blocks: int, hits: tuple[int, int]) -> str:
        for w, h in zip(ws, hits, strict=True):
            beat(redis_client, w.worker_id, cache={"blocks_total": 100, "cached_blocks": cached_blocks,
                                                    "prefix_hit_tokens": h, "prefix_query_tokens": 1000})
        router.refresh_costs(ws)
        return router.choose(ws, hashes, 640, "both").worker.worker_id

    assert place(0, (500, 500)) == "w1"  # room everywhere: the load moves it, as before
    assert router.costs.of("w1").block_reuse == 1.0 and router.costs.of("w1").empty_blocks == 100
    assert place(100, (500, 500)) == "w0"  # full caches, each block reused once: it stays
    assert place(100, (0, 0)) == "w1"  # full caches that nobody reuses: nothing to evict of worth
    router.index.clear_worker("w0")
    redis_client.delete(*redis_client.keys("farm:load*"), *redis_client.keys("farm:active*"))
    assert place(100, (900, 100)) == "w1" and place(100, (100, 900)) == "w0"


def test_soonest_model_by_cached_prefix_then_by_queue(redis_client):
    """Gateway.soonest (MoM among models that score alike, issue 29 item 5): the model whose workers would send
    the first token first, from the router's KV index and load, and why; None when the first model is as soon."""
    from farm.gateway.gateway import Gateway

    cfg = load_config(environ={})
    router = Router(cfg, redis_client, follow=False)
    gw = Gateway(cfg, redis_client, router=router)
    for i, model in enumerate(("m", "m2")):
        registry.register(redis_client, registry.WorkerInfo(f"{model}-w", "both", model, "h", i, 16,
                                                            num_blocks=1000))
    prompt = list(range(1600))  # 100 blocks
    assert gw.soonest({"m": prompt, "m2": prompt}) is None  # alike: the first stays
    router.index.store("m2-w", router.hashes(prompt, "m2")[:90])
    assert gw.soonest({"m": prompt, "m2": prompt}) == ("m2", "kv-cache")
    est = router.estimate(registry.live_workers(redis_client, model="m2"), router.hashes(prompt, "m2"), len(prompt))
    assert est is not None and est.worker == "m2-w" and est.overlap_blocks == 90
    # another tenant's salt: those blocks are not its prefix
    assert gw.soonest({"m": prompt, "m2": prompt}, cache_salt="t-other") is None
    router.index.drop_worker("m2-w")
    router.loads.begin("p", "m-w", "queued-1", 20_000)  # a long prefill queued on m's worker
    assert gw.soonest({"m": prompt, "m2": prompt}) == ("m2", "load")
    assert gw.soonest({"m2": prompt, "m": prompt}) is None
    assert gw.soonest({"gone": prompt, "m": prompt}) == ("m", "load")  # the first has no worker at all
