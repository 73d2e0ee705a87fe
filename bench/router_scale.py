"""Router at scale, no model: index update throughput and decision latency against a real Redis.

    python -m bench.router_scale [--workers 64] [--blocks 1000000] [--out bench/out/router_scale.json]

1. Index updates: `--workers` publishers (the workers' own KVEventPublisher) store `--blocks` blocks in
   batches, through Redis (stream + per-worker snapshot sets, one transaction per flush); a router's
   IndexFollower reads the stream into its local index. Reported: block events/s published into Redis,
   applied by the follower, and end to end (first publish until the follower holds every block).
2. Decisions: with every worker registered and the index full, Router.choose() for 1,024-token prompts
   whose prefixes are cached on random workers; per-stage latency (hashing, index lookup, load read
   from Redis, scheduling), p50/p99. The decision proper (index + scheduling) is local; the load read
   is one HGETALL round trip to Redis, reported separately.
Goals (issue 3): decision p99 <= 1 ms; index >= 100,000 block events/s.
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import tempfile
import time
from pathlib import Path

import redis

from bench.common import finish, goal, percentile, table
from farm import redis_server, registry
from farm.config import load_config
from farm.router.events import KVEventPublisher
from farm.router.index import IndexFollower
from farm.router.router import Router

pct = percentile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=512, help="blocks per published batch")
    ap.add_argument("--decisions", type=int, default=5000)
    ap.add_argument("--out", default="bench/out/router_scale.json")
    args = ap.parse_args()

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
        stages: dict[str, list[float]] = {"hash": [], "index": [], "load": [], "schedule": []}
        decision, overlap_hits = [], 0
        for _ in range(args.decisions):
            w = rng.choice(workers).worker_id
            prefix_blocks = rng.randint(0, 48)
            tokens = [rng.randrange(49152) for _ in range(1024)]
            hashes_full = router.hashes(tokens)
            # make the first `prefix_blocks` blocks of this prompt cached on worker w
            if prefix_blocks:
                router.index.store(w, hashes_full[:prefix_blocks])
            h0 = time.perf_counter()
            hashes = router.hashes(tokens)
            h1 = time.perf_counter()
            p = router.choose(workers, hashes, len(tokens), "both")
            stages["hash"].append((h1 - h0) * 1e6)
            for k in ("index", "load", "schedule"):
                stages[k].append(p.timings_us[k])
            decision.append(p.timings_us["index"] + p.timings_us["schedule"])
            overlap_hits += p.worker.worker_id == w and prefix_blocks > 0
            if prefix_blocks:
                router.index.remove(w, hashes_full[:prefix_blocks])
        rows = [[k, pct(v, 0.5), pct(v, 0.99), statistics.mean(v)] for k, v in stages.items()]
        rows.append(["decision (index+schedule)", pct(decision, 0.5), pct(decision, 0.99), statistics.mean(decision)])
        total = [a + b for a, b in zip(decision, stages["load"], strict=True)]
        rows.append(["decision + load read", pct(total, 0.5), pct(total, 0.99), statistics.mean(total)])

        goals = [
            goal("router decision p99 (us)", pct(decision, 0.99), 1000.0, higher_is_better=False),
            goal("index block events/s (end to end)", e2e_rate, 100_000.0),
        ]
        print(f"\nIndex updates: {args.workers} workers, {total_blocks:,} blocks in batches of {args.batch} "
              f"(indexed: {indexed:,}, resyncs: {follower.resyncs})")
        print(table(["path", "seconds", "block events/s"], [
            ["publish into Redis", t_pub, pub_rate], ["follower apply", t_apply, apply_rate],
            ["end to end", t_pub + t_apply, e2e_rate]], digits=1))
        print(f"\nDecisions: {args.decisions} x 1,024-token prompts over {args.workers} workers, "
              f"{indexed:,} indexed blocks (µs)")
        print(table(["stage", "p50 us", "p99 us", "mean us"], rows, digits=1))
        finish(args.out, {
            "args": vars(args),
            "index": {"blocks": total_blocks, "indexed": indexed, "publish_s": t_pub, "apply_s": t_apply,
                      "publish_rate": pub_rate, "apply_rate": apply_rate, "e2e_rate": e2e_rate},
            "decision_us": {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in
                            {**stages, "decision": decision, "decision_plus_load": total}.items()},
            "chose_prefix_holder": overlap_hits,
        }, goals, "{:,.1f}")
    finally:
        redis_server.stop(proc)


if __name__ == "__main__":
    main()
