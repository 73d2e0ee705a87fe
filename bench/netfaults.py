"""Network faults across hosts at full length, with the farm's default timeouts and the real default model.

    python -m bench.netfaults [--tokens 200] [--long-s 30] [--load-requests 24] [--sentinel on|off|only]
                              [--sentinel-tokens 200] [--out bench/out/netfaults.json]

Needs root (network namespaces, TAP devices). The farm of tests/test_netfaults.py: Redis, the API, a prefill host
and two decode hosts, each in a network namespace of its own behind the test switch (tests/netns.py), the processes
started as on real machines. The scenarios are the tests' own (tests/netfarm.py), here at full length:
- a decode host cut from Redis mid-stream for 5 s, and for `--long-s` (past the heartbeat TTL of 6 s, the reader
  lease of 10 s, redis.socket.timeout_s and kombu's BRPOP check): rejoin timed until its consumer answers a ping;
- the API host cut from Redis mid-stream for `--long-s`;
- the decode hosts cut from the prefill host (KV pulls time out after transfer.pull_timeout_s: local prefill);
- `--load-requests` streams with 50 ms round trips and 1% frame loss on every link;
- the same with Redis's host answering 200 ms late;
- then (`--sentinel on`, the default; `only` runs just this) a second farm with Redis Sentinel across hosts
  (tests/netfarm.py `NetFarm(ha=True)`: data nodes and sentinels on "redis", "redis2", "redis3", the default
  redis.ha settings: down_after_ms 2000, min_replicas_max_lag_s 5): the primary's host cut from every other host
  for `--long-s` while streams are open and two writers append sequence numbers (the test process through the
  sentinels; one on the primary's host, writing to it directly). Its extra columns: failover (s after the cut until
  the majority's sentinels named a new primary), refused (s until the cut-off primary refused a write, NOREPLICAS),
  demoted (s after healing until it replicated from the new primary), primaries after healing (must be 1), and
  per writer the writes acknowledged and those lost (the majority side's must be 0; the co-located writer's are
  the ones acknowledged within min-replicas-max-lag of the cut).
Columns: requests, completed (every token, the unfaulted greedy text), failed cleanly (an error after a prefix of
the answer), lost or repeated (must be 0), the longest request (s), recovery (s after healing until the host
served again), TTFT and ITL percentiles (ms).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from bench.common import finish, goal, table
from farm.config import load_config
from farm.models.directories import require_model_dir
from tests import netns
from tests.netfarm import (
    HA_HOSTS,
    Host,
    NetFarm,
    api_partitioned,
    kv_pull_cut,
    sentinel_primary_partitioned,
    under_link,
    worker_partitioned,
)

PRE, D1, D2 = Host("pre", "prefill"), Host("d1", "decode"), Host("d2", "decode")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=200, help="greedy tokens per faulted stream (ignore_eos)")
    ap.add_argument("--long-s", type=float, default=30, help="the long partitions, seconds")
    ap.add_argument("--load-requests", type=int, default=24, help="streams per link condition")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sentinel", choices=("on", "off", "only"), default="on",
                    help="the Redis Sentinel farm's scenario (the primary's host partitioned) after the others")
    ap.add_argument("--sentinel-tokens", type=int, default=200,
                    help="greedy tokens per stream open across the Sentinel partition")
    ap.add_argument("--out", default="bench/out/netfaults.json")
    args = ap.parse_args()
    reason = netns.unavailable()
    if reason:
        raise SystemExit(f"bench.netfaults: {reason}")
    cfg = load_config()
    model_dir = require_model_dir(cfg, cfg.model(cfg.default_model))
    tmp = Path(tempfile.mkdtemp(prefix="farm-netfaults-"))
    refs: dict = {}
    rows: list[dict[str, Any]] = []
    prompts = [f"Request {i}: explain how a network partition affects a distributed system."
               for i in range(args.load_requests)]
    if args.sentinel != "only":
        with netns.Net(["redis", "api", PRE.name, D1.name, D2.name], log_dir=tmp) as net:
            farm = NetFarm(net, model_dir, tmp, [PRE, D1, D2], {"FARM_DISAGGREGATION__MODE": "always"})
            try:
                farm.start(timeout=300)
                for run in (lambda: worker_partitioned(farm, 5, args.tokens, refs),
                            lambda: worker_partitioned(farm, args.long_s, args.tokens, refs),
                            lambda: api_partitioned(farm, args.long_s, args.tokens, refs),
                            lambda: kv_pull_cut(farm, 32, refs, PRE.name, [D1.name, D2.name]),
                            lambda: under_link(farm, "50 ms RTT, 1% loss", prompts, 64, args.concurrency, refs,
                                               delay_ms=25, loss=0.01),
                            lambda: under_link(farm, "Redis +200 ms", prompts, 64, args.concurrency, refs,
                                               src="redis", delay_ms=200)):
                    rows.append(run().row())
                    print(rows[-1], flush=True)
            finally:
                net.heal()
                farm.stop()
    sentinel: dict[str, Any] | None = None
    if args.sentinel != "off":
        ha_tmp = tmp / "sentinel"
        ha_tmp.mkdir()
        with netns.Net([*HA_HOSTS, "api", PRE.name, D1.name, D2.name], log_dir=ha_tmp) as net:
            farm = NetFarm(net, model_dir, ha_tmp, [PRE, D1, D2], {"FARM_DISAGGREGATION__MODE": "always"}, ha=True)
            try:
                farm.start(timeout=300)
                sentinel = sentinel_primary_partitioned(farm, args.long_s, args.sentinel_tokens, {}).row()
                rows.append(sentinel)
                print(rows[-1], flush=True)
            finally:
                net.heal()
                farm.stop()
    cols = ["fault", "requests", "completed", "failed_cleanly", "lost_or_repeated", "longest_s", "recovery_s",
            "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms"]
    print(table(cols, [[r[c] for c in cols] for r in rows], digits=1))
    for r in rows:
        if r["note"]:
            print(f"{r['fault']}: {r['note']}")
    print(f"logs: {tmp}")
    if sentinel is not None:
        scols = ["failover_s", "refused_s", "last_minority_ack_s", "demoted_s", "primaries", "majority_acked",
                 "majority_lost", "colocated_acked", "colocated_lost"]
        print(table(["fault", *scols], [[sentinel["fault"], *(sentinel[c] for c in scols)]], digits=1))
    lost = sum(r["lost_or_repeated"] for r in rows)
    goals = [goal("requests lost or repeated over every fault", lost, 0, higher_is_better=False)]
    if sentinel is not None:
        goals += [goal("primaries after the Sentinel partition healed, other than one", abs(sentinel["primaries"] - 1),
                       0, higher_is_better=False),
                  goal("majority-side acknowledged writes lost", sentinel["majority_lost"], 0, higher_is_better=False)]
    finish(args.out, {"config": vars(args), "rows": rows}, goals)


if __name__ == "__main__":
    main()
