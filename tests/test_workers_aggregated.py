"""An aggregated (`both`) worker: same answers as the disaggregated layout; warm shutdown drains."""

from __future__ import annotations

import threading

import pytest
import redis

from farm.config import load_config
from farm.gateway import Gateway
from tests.conftest import make_farm_env
from tests.procs import WorkerProc, wait_registered
from tests.test_workers import collect, request


@pytest.fixture(scope="module")
def both_farm(redis_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("both")
    env = make_farm_env(redis_url, tmp)
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    procs = [WorkerProc(env, "both", "both-t1", tmp)]
    try:
        wait_registered(r, procs)
        yield load_config(environ=env), r, procs[0], env, tmp
    finally:
        for p in procs:
            p.stop()


def test_aggregated_worker_serves_prefill_and_decode(both_farm):
    cfg, r, worker, _, _ = both_farm
    gw = Gateway(cfg, r)
    assert gw.layout(cfg.default_model) == "aggregated"
    events, text = collect(gw.submit(request(cfg, "What is 2+2?")))
    done = events[-1]
    assert done.type == "done" and "4" in text
    assert done.prefill_worker == done.decode_worker == worker.name
    assert done.prefill == "local"


def test_warm_shutdown_finishes_in_flight_requests(redis_url, tmp_path):
    """SIGTERM is Celery's warm shutdown: the worker stops taking work but finishes what it runs."""
    url = redis_url.rsplit("/", 1)[0] + "/1"  # a database of its own: this worker is alone there
    env = make_farm_env(url, tmp_path)
    r = redis.Redis.from_url(url)
    r.flushdb()
    worker = WorkerProc(env, "both", "both-drain", tmp_path)
    try:
        wait_registered(r, [worker])
        cfg = load_config(environ=env)
        gw = Gateway(cfg, r)
        subs = [gw.submit(request(cfg, f"Write a story number {i}.", max_tokens=60, ignore_eos=True))
                for i in range(3)]
        results: dict[int, list] = {}
        first_tokens = threading.Barrier(4)

        def consume(i, sub):
            events = []
            for ev in sub.events(first_timeout_s=120, idle_timeout_s=120):
                events.append(ev)
                if ev.type == "delta" and sum(e.type == "delta" for e in events) == 1:
                    first_tokens.wait(120)
            results[i] = events

        threads = [threading.Thread(target=consume, args=(i, s)) for i, s in enumerate(subs)]
        for t in threads:
            t.start()
        first_tokens.wait(120)  # every request is generating now
        worker.stop(timeout=120)
        for t in threads:
            t.join(180)
        assert worker.proc.returncode == 0
        for events in results.values():
            assert events[-1].type == "done"
            assert events[-1].finish_reason == "length"
            assert events[-1].usage.completion_tokens == 60
        assert len(results) == 3
    finally:
        worker.kill()


def test_batch_lines_keep_within_their_owners_token_quota(both_farm):
    """Batch lines spend their owner's token quota, as interactive requests do, and like them reserve the most
    they can use before they run. Before, the quota was checked only when the batch was created and lines were
    charged after they ran: one key's 40-line batch spent 10.5 times its quota (the audit's measure). Now the
    lines that fit run (the last one capped to what is left), the others wait for the next window, and the key's
    usage never passes its quota."""
    import json
    import time

    from farm.batch.driver import BatchDriver
    from farm.batch.file_store import FileStore
    from farm.batch.store import BatchStore

    base, r, _, env, _ = both_farm
    quota = 200
    cfg = load_config(environ={**env, "FARM_API__LIMITS__TOKEN_QUOTA": str(quota), "FARM_SEMANTIC__ENABLED": "false"})
    owner = "quota-owner"
    rows = [{"custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": cfg.default_model, "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
                      "max_tokens": 24, "ignore_eos": True, "temperature": 0}} for i in range(8)]
    f = FileStore.from_config(r, cfg).create("".join(json.dumps(x) + "\n" for x in rows).encode(), "q.jsonl",
                                             "batch", owner)
    store = BatchStore(r)
    bid = store.create(f["id"], "/v1/chat/completions", "24h", 86400, None, owner)["id"]
    driver = BatchDriver(cfg, r=r)
    ran = threading.Thread(target=driver.drive, args=(bid,), daemon=True)
    ran.start()
    try:
        done, since = -1, time.monotonic()
        while done < 1 or time.monotonic() - since < 8:  # until no more line completes for 8 s: the rest wait
            now = (store.get(bid) or {}).get("completed", 0)
            if now != done:
                done, since = now, time.monotonic()
            assert time.monotonic() - since < 120
            time.sleep(0.5)
        used = driver.results.limiter.used_tokens(owner)
        assert 2 <= done < len(rows), done
        assert used <= quota, f"{used} tokens charged against a quota of {quota}"
        ok, _ = store.transition(bid, ("in_progress",), "cancelling", cancelling_at=int(time.time()))
        assert ok
        ran.join(60)
        assert store.status(bid) == "cancelled"
        assert driver.results.limiter.used_tokens(owner) == used  # the waiting lines' reservations went back
    finally:
        driver.stop()
