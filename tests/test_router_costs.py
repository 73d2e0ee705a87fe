"""The measured cost: step costs fitted by the engine, published in heartbeats, read by the router, and the
placements and admissions they lead to (the predicted time to first token)."""

from __future__ import annotations

import pytest

from farm.cluster import registry
from farm.config import CostPrior, load_config
from farm.engine.step_costs import LinearFit, StepCosts
from farm.router.costs import CostBook, WorkerCosts
from farm.router.policy import Candidate, dynamo_costs, measured_costs, predicted_ttft
from farm.router.router import BusyError, Router

CPU = {"prefill_ms_per_block": 40.0, "prefill_step_ms": 50.0, "prefill_samples": 9,
       "decode_step_ms": 30.0, "decode_ms_per_block": 0.5, "decode_samples": 9}  # a prefill block: 80 active blocks
GPU = {"prefill_ms_per_block": 0.5, "prefill_step_ms": 5.0, "prefill_samples": 9,
       "decode_step_ms": 10.0, "decode_ms_per_block": 0.5, "decode_samples": 9}  # a prefill block: 1 active block


def test_linear_fit_separates_step_overhead_from_per_unit_cost():
    fit = LinearFit(alpha=0.2, warmup=2)
    fit.observe(10, 5.0)  # warm-up steps (first-call allocations) are left out
    fit.observe(10, 5.0)
    assert fit.fit() == ((0.0, 0.0), False) and fit.samples == 0
    for x in [16, 400, 48, 900, 160, 32, 640] * 4:
        fit.observe(x, 0.05 + 0.002 * x)
    (base, slope), separated = fit.fit()
    assert base == pytest.approx(0.05, rel=1e-6) and slope == pytest.approx(0.002, rel=1e-6)
    assert separated
    same = LinearFit(warmup=0)
    for _ in range(5):
        same.observe(64, 0.2)  # no spread: no way to split, so the whole step counts per unit
    assert same.fit() == ((0.0, pytest.approx(0.2 / 64)), False)


def test_step_costs_snapshot_is_in_milliseconds_per_block():
    costs = StepCosts(block_size=16)
    assert costs.snapshot()["prefill_samples"] == 0 and costs.snapshot()["decode_samples"] == 0
    for tokens in [0, 0, 64, 512, 128, 1024, 256]:  # two warm-up steps first
        costs.observe_prefill(tokens, 0.01 + 0.0025 * tokens)
    for blocks in [0, 0, 10, 80, 40, 160, 20]:
        costs.observe_decode(blocks, 0.03 + 0.0007 * blocks)
    snap = costs.snapshot()
    assert snap["prefill_ms_per_block"] == pytest.approx(40.0) and snap["prefill_step_ms"] == pytest.approx(10.0)
    assert snap["decode_ms_per_block"] == pytest.approx(0.7) and snap["decode_step_ms"] == pytest.approx(30.0)
    assert snap["prefill_samples"] == 5 and snap["decode_samples"] == 5


def test_cost_book_takes_own_figures_then_peers_then_the_prior():
    prior = CostPrior()
    book = CostBook(prior)
    book.update({"a": "m", "b": "m", "c": "m", "x": "other"},
                {"a": {"costs": CPU}, "b": {"costs": {**CPU, "prefill_ms_per_block": 60.0}},
                 "c": {"costs": {**CPU, "prefill_samples": 0, "decode_samples": 0}}, "x": {"ts": 1.0}})
    assert book.of("a") == WorkerCosts(0.040, 0.050, 0.030, 0.0005, measured=True)
    assert book.of("b").prefill_s_per_block == pytest.approx(0.060) and book.of("b").measured
    c = book.of("c")  # not measured yet: the median of its model's workers that are
    assert c.prefill_s_per_block == pytest.approx(0.050) and c.decode_step_s == pytest.approx(0.030)
    assert not c.measured
    assert book.of("x") == WorkerCosts.prior(prior) == book.of("unknown")


def test_snapshot_says_how_long_ago_each_kind_of_step_ran():
    now = [100.0]
    costs = StepCosts(block_size=16, clock=lambda: now[0])
    assert costs.snapshot()["prefill_idle_s"] is None and costs.snapshot()["decode_idle_s"] is None
    costs.observe_prefill(64, 0.1)
    now[0] = 103.0
    costs.observe_decode(10, 0.03)
    now[0] = 115.0
    snap = costs.snapshot()
    assert snap["prefill_idle_s"] == 15.0 and snap["decode_idle_s"] == 12.0


def test_a_worker_idle_for_long_takes_its_peers_fresh_figures_until_it_steps_again():
    """A worker that measured itself slow in a contended moment and then got no work would keep losing
    every placement on those figures and never measure again: once they are stale, its busy peers speak."""
    book = CostBook(CostPrior())
    slow_and_idle = {**CPU, "prefill_ms_per_block": 120.0, "prefill_idle_s": 30.0, "decode_idle_s": 30.0}
    busy = {**CPU, "prefill_idle_s": 0.5, "decode_idle_s": 0.1}
    book.update({"a": "m", "b": "m"}, {"a": {"costs": slow_and_idle}, "b": {"costs": busy}})
    assert book.of("a").prefill_s_per_block == pytest.approx(0.040) and not book.of("a").measured
    assert book.of("b").measured
    book.update({"a": "m", "b": "m"}, {"a": {"costs": {**slow_and_idle, "prefill_idle_s": 1.0}},
                                       "b": {"costs": busy}})
    assert book.of("a").prefill_s_per_block == pytest.approx(0.120)  # it ran a prefill again: its own
    everyone_idle = {**busy, "prefill_idle_s": 60.0, "decode_idle_s": 60.0}
    book.update({"a": "m", "b": "m"}, {"a": {"costs": slow_and_idle}, "b": {"costs": everyone_idle}})
    assert book.of("a").prefill_s_per_block == pytest.approx(0.120)  # no one fresher: its own, not the prior


def test_a_line_through_the_origin_yields_to_a_peers_separated_line():
    """A worker whose decode batches all held about as many blocks cannot tell a step's base from its cost per
    block: its line goes through the origin, and its per-block slope (the whole step over the blocks) is what
    the router would charge each block a placement adds to its batch, several times the marginal cost. A peer of
    its model that measured a separated line speaks for it; with none, its own rough line stands."""
    rough = StepCosts(block_size=16)
    for _ in range(8):
        rough.observe_decode(50, 0.045)  # about 50 blocks in every step
        rough.observe_prefill(640, 0.1)
    snap = rough.snapshot()
    assert snap["decode_separated"] is False and snap["decode_step_ms"] == 0.0
    assert snap["decode_ms_per_block"] == pytest.approx(0.9)
    book = CostBook(CostPrior())
    book.update({"a": "m", "b": "m"}, {"a": {"costs": snap}, "b": {"costs": {**CPU, "decode_separated": True}}})
    a = book.of("a")
    assert (a.decode_step_s, a.decode_s_per_block) == (pytest.approx(0.030), pytest.approx(0.0005))
    assert not a.measured and book.of("b").measured
    book.update({"a": "m"}, {"a": {"costs": snap}})  # no peer with a line: its own
    assert book.of("a").decode_s_per_block == pytest.approx(0.0009) and book.of("a").measured
    # heartbeats without the flag (a worker of an earlier version) count as separated lines, as before
    book.update({"a": "m", "b": "m"}, {"a": {"costs": CPU}, "b": {"costs": {**CPU, "decode_ms_per_block": 0.7}}})
    assert book.of("a").decode_s_per_block == pytest.approx(0.0005) and book.of("a").measured


def test_measured_cost_is_the_predicted_time_to_first_token():
    k = WorkerCosts(0.040, 0.050, 0.030, 0.0005)
    idle = Candidate("idle", costs=k)
    busy = Candidate("busy", overlap_blocks=15, pending_prefill_blocks=10, active_blocks=200, costs=k)
    # idle: 50 ms + 20 blocks x 40 ms; busy: 50 ms + (10 queued + 5 uncached) x 40 ms + a step over 200 blocks
    assert predicted_ttft(idle, 20) == pytest.approx(0.050 + 0.800)
    assert predicted_ttft(busy, 20) == pytest.approx(0.050 + 0.600 + 0.030 + 0.100)
    assert measured_costs([idle, busy], 20, "both") == [predicted_ttft(idle, 20), predicted_ttft(busy, 20)]
    # a decode-only placement: the step the request would join
    assert measured_costs([idle, busy], 20, "decode") == [pytest.approx(0.040), pytest.approx(0.140)]


def workers(r, n, num_blocks=10_000, stats=None):
    out = []
    for i in range(n):
        info = registry.WorkerInfo(f"w{i}", "both", "m", "h", i, 16, num_blocks=num_blocks)
        registry.register(r, info)
        if stats is not None:
            registry.heartbeat(r, info.worker_id, {"costs": stats})
        out.append(info)
    return out


def make_router(r, **router):
    """A router without a follower; its own placements are not remembered as cached (each choice here is
    judged on the index and load the test sets up)."""
    router.setdefault("prediction_ttl_s", 1e-6)
    cfg = load_config(environ={})
    cfg = cfg.model_copy(update={"router": cfg.router.model_copy(update=router)})
    return Router(cfg, r, follow=False)


def test_step_costs_reach_the_router_through_redis(redis_client):
    ws = workers(redis_client, 2, stats=CPU)
    registry.heartbeat(redis_client, "w1", {"costs": GPU})
    router = make_router(redis_client)
    assert router.costs.of("w0") == router.costs.prior  # nothing read yet
    router.refresh_costs(registry.live_workers(redis_client))
    assert router.costs.of("w0") == WorkerCosts(0.040, 0.050, 0.030, 0.0005, measured=True)
    assert router.costs.of("w1").prefill_s_per_block == pytest.approx(0.0005)
    assert {w.worker_id for w in ws} == {"w0", "w1"}


def test_holder_wins_while_recomputing_elsewhere_is_slower_than_queueing_behind_it(redis_client):
    ws = workers(redis_client, 2, stats=CPU)
    router = make_router(redis_client)
    router.refresh_costs(ws)
    hashes = router.hashes(list(range(320)))  # 20 blocks, 18 of them cached on w0
    router.index.store("w0", hashes[:18])
    router.loads.begin("p", "w0", "queued-1", 10 * 16)  # 10 blocks queued for prefill on w0
    p = router.choose(ws, hashes, 320, "both")
    # w0: 50 + (10 + 2) x 40 = 530 ms; w1: 50 + 20 x 40 = 850 ms
    assert p.worker.worker_id == "w0" and p.predicted_ttft_s == pytest.approx(0.530)
    router.loads.begin("p", "w0", "queued-2", 10 * 16)  # now 20 blocks queued: 930 ms > 850 ms
    p = router.choose(ws, hashes, 320, "both")
    assert p.worker.worker_id == "w1" and p.predicted_ttft_s == pytest.approx(0.850)


def test_the_same_prefix_is_worth_what_the_worker_measured(redis_client):
    """Identical index and load, different measured costs: on CPU workers the cached prefix wins over a
    decode load of 400 blocks; on GPU-like workers (a prefill block costs one active block) it does not."""
    for stats, winner in ((CPU, "w0"), (GPU, "w1")):
        redis_client.flushdb()
        ws = workers(redis_client, 2, stats=stats)
        router = make_router(redis_client)
        router.refresh_costs(ws)
        hashes = router.hashes(list(range(320)))
        router.index.store("w0", hashes[:18])
        router.loads.begin("d", "w0", "decoding", 400)
        assert router.choose(ws, hashes, 320, "both").worker.worker_id == winner, stats


def test_idle_worker_wins_when_the_cached_prefix_is_short(redis_client):
    ws = workers(redis_client, 2, stats=CPU)
    router = make_router(redis_client)
    router.refresh_costs(ws)
    hashes = router.hashes(list(range(320)))
    router.index.store("w0", hashes[:2])  # 2 blocks saved = 80 ms
    router.loads.begin("d", "w0", "decoding", 200)  # a step over 200 blocks = 130 ms
    assert router.choose(ws, hashes, 320, "both").worker.worker_id == "w1"
    # 6 blocks saved = 240 ms of its TTFT, but the request decoding on w0 would wait out its prefill of the
    # other 14 (50 + 560 ms): w0 0.74 + 0.61 s against w1 0.85 s, + half a request's stall there (the pool holds
    # 0.5 requests per worker: the next arrival placed on w1 waits out that prefill too) = 1.275 s
    router.index.store("w0", hashes[:6])
    assert router.choose(ws, hashes, 320, "both").worker.worker_id == "w1"
    router.index.store("w0", hashes[:10])  # 10 saved: w0 0.58 + 0.45 = 1.03 s against 1.275 s
    assert router.choose(ws, hashes, 320, "both").worker.worker_id == "w0"


def test_dynamo_mode_reproduces_dynamos_formula(redis_client):
    ws = workers(redis_client, 3, stats=CPU)
    router = make_router(redis_client, cost="dynamo", overlap_weight=2.0)
    router.refresh_costs(ws)
    hashes = router.hashes(list(range(160)))  # 10 blocks
    router.index.store("w0", hashes[:8])
    router.loads.begin("d", "w0", "a", 4)
    router.loads.begin("p", "w2", "b", 5 * 16)
    # w0: 2 x 2 + (4 + 10) = 18; w1: 2 x 10 + 10 = 30; w2: 2 x 15 + 10 = 40 (the measured costs play no part)
    p = router.choose(ws, hashes, 160, "both")
    assert p.worker.worker_id == "w0" and p.cost == 18
    cands = [Candidate("w0", 8, 0, 4), Candidate("w1"), Candidate("w2", pending_prefill_blocks=5)]
    assert dynamo_costs(cands, 10, 2.0) == [18, 30, 40]


def test_ttft_target_refuses_only_when_every_worker_would_queue_past_it(redis_client):
    ws = workers(redis_client, 2, stats=CPU)
    router = make_router(redis_client, ttft_target_ms=1000, retry_after_s=4)
    router.refresh_costs(ws)
    # an idle farm takes a prompt whose own prefill exceeds the target: refusing would not make it faster
    assert router.choose(ws, [], 100 * 16, "both").predicted_ttft_s > 1.0
    router.loads.begin("p", "w0", "q0", 30 * 16)  # 30 blocks queued: 50 + (30 + 1) x 40 = 1,290 ms
    assert router.choose(ws, [], 16, "both").worker.worker_id == "w1"  # w1 is still idle
    router.loads.begin("p", "w1", "q1", 30 * 16)
    with pytest.raises(BusyError) as e:
        router.choose(ws, [], 16, "both")
    assert e.value.retry_after_s == 4 and "ttft_target_ms" in str(e.value)
    router.loads.end("p", "w1", "q1")
    assert router.choose(ws, [], 16, "both").worker.worker_id == "w1"
    off = make_router(redis_client, ttft_target_ms=0)  # 0: occupancy alone decides
    off.refresh_costs(ws)
    off.loads.begin("p", "w1", "q1", 30 * 16)
    assert off.choose(ws, [], 16, "both") is not None
