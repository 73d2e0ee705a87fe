"""Router at scale, no model: index update throughput and decision latency against a real Redis.

    python -m bench.router_scale [--workers 64] [--blocks 1000000] [--out bench/out/router_scale.json]

1. Index updates: `--workers` publishers (the workers' own KVEventPublisher) store `--blocks` blocks in
   batches, through Redis (stream + per-worker snapshot sets, one transaction per flush); a router's
   IndexFollower reads the stream into its local index. Reported: block events/s published into Redis,
   applied by the follower, and end to end (first publish until the follower holds every block).
2. Decisions, the headline: with every worker registered and the index full, the whole decision as the
   API makes it for 1,024-token prompts whose prefixes are cached on random workers: hashing, index
   lookup, load read, scheduling (Router.choose, measured cost). The load comes from the router's mirror,
   kept current by a running follower thread while a second process plays the rest of a busy farm (other
   API replicas placing and ending requests: `--churn` load changes/s through the load stream, and KV
   events of other workers). For comparison, the same decision with the load read from Redis (one
   HGETALL round trip each), as the router did before.
The process runs as an API process does (gunicorn's gevent worker): the standard library patched by gevent,
the follower a greenlet beside the decisions, never preempting one mid-way (a thread would, at the GIL's
switch interval).
Goals (issues 3 and 14): decision p99 <= 1 ms with the load read; index >= 100,000 block events/s.
"""

from __future__ import annotations

if __name__ == "__main__":  # as in the API process: gevent first, before anything opens a socket
    from gevent import monkey

    monkey.patch_all()

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench.common import finish, goal, percentile, table
from bench.farms import free_port
from farm.cluster import registry
from farm.config import load_config
from farm.infra import redis_server
from farm.protocol.keys import LOAD_EVENTS_STREAM
from farm.router.index import IndexFollower
from farm.router.kv_publisher import KVEventPublisher
from farm.router.load import LoadMirror, LoadTracker
from farm.router.router import Router

pct = percentile


def decide(router: Router, workers: list, rng: random.Random, n: int) -> dict:
    """`n` whole decisions (hashing included) for 1,024-token prompts whose first 0-48 blocks are cached on
    a random worker; per-stage and total microseconds."""
    stages: dict[str, list[float]] = {"hash": [], "index": [], "load": [], "schedule": []}
    total, holder = [], 0
    for _ in range(n):
        w = rng.choice(workers).worker_id
        prefix_blocks = rng.randint(0, 48)
        tokens = [rng.randrange(49152) for _ in range(1024)]
        if prefix_blocks:  # make the first `prefix_blocks` blocks of this prompt cached on worker w
            router.index.store(w, router.hashes(tokens)[:prefix_blocks])
        h0 = time.perf_counter()
        hashes = router.hashes(tokens)
        h1 = time.perf_counter()
        p = router.choose(workers, hashes, len(tokens), "both")
        t = time.perf_counter()
        stages["hash"].append((h1 - h0) * 1e6)
        for k in ("index", "load", "schedule"):
            stages[k].append(p.timings_us[k])
        total.append((t - h0) * 1e6)
        holder += p.worker.worker_id == w and prefix_blocks > 0
        if prefix_blocks:
            router.index.remove(w, hashes[:prefix_blocks])
        time.sleep(0)  # between requests the follower runs (as between an API process's requests)
    return {"stages": stages, "total": total, "prefix_holder_chosen": holder}


def busy_farm(url: str, workers: list[str], rate: float) -> None:
    """The rest of a busy farm, in a process of its own (`--churn-only`, until terminated): other API
    replicas placing requests on random workers and ending them (`rate` load changes/s), and other workers
    storing and evicting KV blocks."""
    r = redis.Redis.from_url(url)
    loads = LoadTracker(r)
    rng = random.Random(1)
    pubs = [KVEventPublisher(r, f"churn-w{i}") for i in range(4)]
    open_: list[tuple[str, str, str]] = []
    period = 4.0 / rate if rate > 0 else 1.0  # each round: two begins and two ends
    n = 0
    while True:
        t0 = time.perf_counter()
        rid = f"churn-{n}"
        n += 1
        w = rng.choice(workers)
        loads.begin("p", w, rid, rng.randrange(16, 2048))
        loads.begin("d", w, rid, rng.randrange(1, 128))
        open_.append(("p", w, rid))
        open_.append(("d", w, rid))
        while len(open_) > 64:
            kind, w2, r2 = open_.pop(rng.randrange(len(open_)))
            loads.end(kind, w2, r2)
        if n % 10 == 0:
            pub = rng.choice(pubs)
            pub("stored", [rng.getrandbits(63) for _ in range(16)], None)
            pub.flush()
        time.sleep(max(0.0, period - (time.perf_counter() - t0)))


def mirror_lag(r: redis.Redis, mirror: LoadMirror) -> int:
    """Load stream entries the mirror has not applied yet, right after the decisions."""
    pos = "{}-{}".format(*(mirror.position or (0, 0)))
    return int(r.xlen(LOAD_EVENTS_STREAM)) if mirror.position is None else len(
        r.xrange(LOAD_EVENTS_STREAM, min="(" + pos, max="+"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=512, help="blocks per published batch")
    ap.add_argument("--decisions", type=int, default=5000)
    ap.add_argument("--churn", type=float, default=2000, help="load changes/s from the rest of the farm")
    ap.add_argument("--out", default="bench/out/router_scale.json")
    ap.add_argument("--churn-only", metavar="URL", help=argparse.SUPPRESS)  # the busy farm's own process
    args = ap.parse_args()
    if args.churn_only:
        busy_farm(args.churn_only, [f"bench-w{i}" for i in range(args.workers)], args.churn)
        return

    tmp = Path(tempfile.mkdtemp(prefix="farm-bench-redis-"))
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = redis_server.start_managed(url, tmp, tmp / "redis.log", appendonly=True)
    try:
        r = redis.Redis.from_url(url)
        cfg = load_config(environ={})
        workers = []
        for i in range(args.workers):
            info = registry.WorkerInfo(f"bench-w{i}", "both", "m", "h", i, cfg.engine.block_size,
                                       num_blocks=1_000_000)
            registry.register(r, info)
            workers.append(info)
        router = Router(cfg, r, follow=False)
        follower = IndexFollower(r, router.index)
        follower.snapshot()

        # -- 1. index update throughput ------------------------------------------------------------
        rng = random.Random(0)
        per_worker = args.blocks // args.workers
        pubs = [KVEventPublisher(r, w.worker_id) for w in workers]
        t0 = time.perf_counter()
        owned: dict[str, list[int]] = {}
        for pub in pubs:
            hs = [rng.getrandbits(63) for _ in range(per_worker)]
            owned[pub.worker_id] = hs
            for s in range(0, per_worker, args.batch):
                pub("stored", hs[s:s + args.batch], None)
            pub.flush()
        t_pub = time.perf_counter() - t0
        t1 = time.perf_counter()
        applied = 0
        while True:
            n = follower.poll(block_ms=100)
            if n == 0 and follower.index.num_blocks() >= per_worker * args.workers:
                break
            applied += n
            if n == 0 and time.perf_counter() - t1 > 120:
                break
        t_apply = time.perf_counter() - t1
        total_blocks = per_worker * args.workers
        indexed = follower.index.num_blocks()
        pub_rate = total_blocks / t_pub
        apply_rate = total_blocks / t_apply
        e2e_rate = total_blocks / (t_pub + t_apply)

        # -- 2. decision latency ------------------------------------------------------------------
        router.costs.update({w.worker_id: "m" for w in workers}, {})  # every worker on the prior
        mirror = LoadMirror()
        router.loads.mirror = mirror
        live = IndexFollower(r, router.index, load_mirror=mirror)  # as an API process starts: from snapshots
        live.snapshot()
        churn = subprocess.Popen([sys.executable, "-m", "bench.router_scale", "--churn-only", url,
                                  "--workers", str(args.workers), "--churn", str(args.churn)])
        live.start()
        time.sleep(1.0)  # the churn is under way
        try:
            mirrored = decide(router, workers, rng, args.decisions)
            behind = mirror_lag(r, mirror)
            router.loads.mirror = None  # the same decisions, reading the load from Redis each time
            from_redis = decide(router, workers, rng, args.decisions)
            router.loads.mirror = mirror
        finally:
            churn.terminate()
            churn.wait(10)
            live.stop()
        stages = mirrored["stages"]
        decision = mirrored["total"]
        rows = [[k, pct(v, 0.5), pct(v, 0.99), statistics.mean(v)] for k, v in stages.items()]
        rows.append(["whole decision (load from the mirror)", pct(decision, 0.5), pct(decision, 0.99),
                     statistics.mean(decision)])
        rows.append(["  load read from Redis instead", pct(from_redis["stages"]["load"], 0.5),
                     pct(from_redis["stages"]["load"], 0.99), statistics.mean(from_redis["stages"]["load"])])
        rows.append(["  whole decision, load from Redis", pct(from_redis["total"], 0.5),
                     pct(from_redis["total"], 0.99), statistics.mean(from_redis["total"])])
        overlap_hits = mirrored["prefix_holder_chosen"]

        goals = [
            goal("router decision p99 with the load read (us)", pct(decision, 0.99), 1000.0, higher_is_better=False),
            goal("index block events/s (end to end)", e2e_rate, 100_000.0),
        ]
        print(f"\nIndex updates: {args.workers} workers, {total_blocks:,} blocks in batches of {args.batch} "
              f"(indexed: {indexed:,}, resyncs: {follower.resyncs})")
        print(table(["path", "seconds", "block events/s"], [
            ["publish into Redis", t_pub, pub_rate], ["follower apply", t_apply, apply_rate],
            ["end to end", t_pub + t_apply, e2e_rate]], digits=1))
        print(f"\nDecisions: {args.decisions} x 1,024-token prompts over {args.workers} workers, "
              f"{indexed:,} indexed blocks, {args.churn} load changes/s from the rest of the farm (µs)")
        print(table(["stage", "p50 us", "p99 us", "mean us"], rows, digits=1))
        print(f"load stream entries the mirror had not applied when the decisions ended: {behind}")
        finish(args.out, {
            "args": vars(args),
            "index": {"blocks": total_blocks, "indexed": indexed, "publish_s": t_pub, "apply_s": t_apply,
                      "publish_rate": pub_rate, "apply_rate": apply_rate, "e2e_rate": e2e_rate},
            "decision_us": {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in
                            {**stages, "decision": decision, "load_from_redis": from_redis["stages"]["load"],
                             "decision_load_from_redis": from_redis["total"]}.items()},
            "chose_prefix_holder": overlap_hits, "mirror_entries_behind": behind,
        }, goals, "{:,.1f}")
    finally:
        redis_server.stop(proc)


if __name__ == "__main__":
    main()
