"""KV-aware routing with real worker processes: prefix reuse lands on the holder; vanished workers."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from farm.cluster import registry
from farm.config import load_config
from farm.gateway import Gateway
from farm.router.kv_publisher import KVEventPublisher
from tests.conftest import make_farm_env
from tests.procs import WorkerProc, wait_registered
from tests.test_workers import collect, request

LONG_SYSTEM = ("You are the support assistant of a bicycle shop. You answer questions about repairs, "
               "opening hours, prices and rentals. Always be short, precise and friendly. ") * 6


@pytest.fixture(scope="module")
def two_workers(redis_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing")
    url = redis_url.rsplit("/", 1)[0] + "/2"
    env = make_farm_env(url, tmp)
    r = redis.Redis.from_url(url)
    r.flushdb()
    procs = [WorkerProc(env, "both", f"agg-{i}", tmp) for i in range(2)]
    try:
        wait_registered(r, procs)
        yield load_config(environ=env), r, procs
    finally:
        for p in procs:
            p.stop()


def chat(cfg, user, system=LONG_SYSTEM, **kw):
    from farm.models.tokenization import chat_prompt_ids, get_tokenizer

    req = request(cfg, user, **kw)
    tok = get_tokenizer(cfg, cfg.default_model)
    req.prompt_token_ids = chat_prompt_ids(tok, [{"role": "system", "content": system},
                                                 {"role": "user", "content": user}])
    return req


def test_second_request_with_same_prefix_lands_on_holder_with_cached_tokens(two_workers):
    cfg, r, _ = two_workers
    gw = Gateway(cfg, r)
    gw.router.follower.synced.wait(10)
    first_req = chat(cfg, "When do you open on Sunday?", max_tokens=8)
    first, _ = collect(gw.submit(first_req))
    holder = first[-1].decode_worker
    assert first[-1].usage.cached_tokens == 0
    # wait until the holder's KV events reached this router's index
    hashes = gw.router.hashes(first_req.prompt_token_ids)
    deadline = time.time() + 10
    while gw.router.index.overlaps(hashes).get(holder, 0) < len(hashes) - 1 and time.time() < deadline:
        time.sleep(0.05)
    second_req = chat(cfg, "How much is a new chain?", max_tokens=8)
    sub = gw.submit(second_req)
    assert sub.predicted_overlap_tokens > 100
    second, _ = collect(sub)
    assert second[-1].decode_worker == holder
    assert second[-1].usage.cached_tokens >= sub.predicted_overlap_tokens - 16 > 0


def test_request_placed_on_vanished_worker_is_resent_and_completes(two_workers):
    cfg, r, procs = two_workers
    cfg = cfg.model_copy(update={"router": cfg.router.model_copy(update={"placement_timeout_s": 0.5})})
    gw = Gateway(cfg, r)
    gw.router.follower.synced.wait(10)
    req = chat(cfg, "Do you rent tandems?", max_tokens=8)
    # a ghost worker that claims to hold the whole prompt: the router will choose it
    ghost = registry.WorkerInfo("ghost@nowhere", "both", cfg.default_model, "nowhere", 1,
                                cfg.engine.block_size, num_blocks=10_000)
    registry.register(r, ghost)
    pub = KVEventPublisher(r, ghost.worker_id)
    pub.start()
    pub("stored", gw.router.hashes(req.prompt_token_ids), None)
    pub.flush()
    deadline = time.time() + 5
    while "ghost@nowhere" not in gw.router.index.overlaps(gw.router.hashes(req.prompt_token_ids)):
        assert time.time() < deadline
        time.sleep(0.05)
    # placements read the live workers from the follower's view, refreshed about every second
    while "ghost@nowhere" not in {w.worker_id for w in gw.router.live_workers() or []}:
        assert time.time() < deadline
        time.sleep(0.05)
    sub = gw.submit(req)
    assert sub.dispatch.worker_id == "ghost@nowhere"
    r.delete(registry.alive_key("ghost@nowhere"))  # it dies before consuming its queue
    events, text = collect(sub, timeout=60)
    assert events[-1].type == "done"
    assert events[-1].decode_worker in {p.name for p in procs}
    assert text


def test_concurrent_shared_prefix_requests_spread_and_complete(two_workers):
    cfg, r, procs = two_workers
    gw = Gateway(cfg, r)
    subs = [gw.submit(chat(cfg, f"Question number {i}: what do you sell?", max_tokens=6)) for i in range(8)]
    results = [None] * len(subs)

    def consume(i):
        results[i] = collect(subs[i])[0]

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(subs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(ev[-1].type == "done" for ev in results)
    from farm.router.load import empty_load

    deadline = time.monotonic() + 2  # a request's load ends with the batched writes of the next milliseconds
    while any(gw.router.loads.loads().get(p.name, empty_load()) != empty_load() for p in procs):
        assert time.monotonic() < deadline, {p.name: gw.router.loads.loads().get(p.name) for p in procs}
        time.sleep(0.02)


def test_workers_measured_step_costs_reach_the_router_through_redis(two_workers):
    """Each worker's engine times its own prefill and decode steps and publishes them in its heartbeat; the
    router's follower reads them, so the cost a placement uses is the worker's own, not a constant."""
    cfg, r, procs = two_workers
    gw = Gateway(cfg, r)
    try:
        for i in range(6):  # a few prefill and decode steps on every worker (each engine skips its first two)
            events, _ = collect(gw.submit(chat(cfg, f"Can I bring bike number {i} in on a weekday?",
                                               system=f"Shop note {i}. " + LONG_SYSTEM, max_tokens=4)))
            assert events[-1].type == "done"
        names = [p.name for p in procs]
        deadline = time.time() + 20
        agreed: dict[str, tuple] = {}
        while time.time() < deadline and not agreed:
            beats = registry.heartbeats(r, names)
            for name in names:
                costs = beats.get(name, {}).get("costs", {})
                k = gw.router.costs.of(name)
                # a half the router took from this worker's heartbeat (the other may be a peer's line, when
                # this worker's went through the origin: farm.router.costs)
                prefill = (costs.get("prefill_ms_per_block", 0) / 1000, costs.get("prefill_step_ms", 0) / 1000)
                decode = (costs.get("decode_step_ms", 0) / 1000, costs.get("decode_ms_per_block", 0) / 1000)
                if (costs.get("prefill_samples") and (k.prefill_s_per_block, k.prefill_step_s) == pytest.approx(prefill)
                        or costs.get("decode_samples")
                        and (k.decode_step_s, k.decode_s_per_block) == pytest.approx(decode)):
                    agreed[name] = (k, costs)
            time.sleep(0.2)
        assert agreed, "no worker's measured step costs reached the router"
        for k, costs in agreed.values():
            assert costs["prefill_samples"] >= 1 and costs["decode_samples"] >= 1
            assert k.prefill_s_per_block > 0 and k.decode_step(10) > k.decode_step(0) >= 0
            assert k != gw.router.costs.prior
    finally:
        gw.stop()
