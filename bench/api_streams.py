"""How many concurrent open streams one API process holds, and what each costs.

    python -m bench.api_streams [--n 500 1000 2000 5000] [--max-tokens 4] [--semantic] [--out FILE]

Per N, a fresh farm on this machine (its own redis-server, one aggregated worker with the default model,
the API under gunicorn exactly as `farm up` starts it) and N streaming clients on one asyncio loop in this
process (bench/stream_load.py: raw HTTP/1.1, one connection each, open-files limit raised; each a text
completion of a few-token prompt, so the farm's own work per stream stays small). While the clients
connect, the worker takes no task (Celery's cancel_consumer): every request stays queued and its stream
open at the API until the API holds all N at once (its read leases in Redis) or the hold times out. Then
the API worker process's memory, threads, descriptors and CPU are read, the worker is let go, and every
stream is read to its end (`--max-tokens` tokens each, ignore_eos).

Columns: held = most streams the API held open at once, and after how long (admission of the burst);
ok / refused (no connection, or 503/429 up front) / broken (anything else: an error, a stream without
[DONE], a timeout); RSS of the API worker process before (after a warm-up) and while all were held, and
the difference per held stream; its threads, open descriptors and CPU (% of one core, over 5 s) while
holding them; TTFT at the client and at the API (from submit to the first token read from Redis,
farm:obs); overhead = mean client TTFT - mean API TTFT over the burst: what the API adds beyond the farm's
own queueing and prefill (accepting, parsing, the semantic layer when on, tokenizing, placing, delivering;
in a burst mostly the wait for the requests admitted before); idle overhead = the same for 20 streams sent
one at a time to the idle farm.

Settings the bench changes, and why: `router.busy_threshold: 0` (the router would refuse requests beyond
the worker's KV capacity with 503; the API's capacity is measured here, not the engine's),
`reliability.probe_failures: 1000` (the consumer watchdog would take the paused consumer for a stall),
`api.worker_connections` = N + 1000, `api.first_event_timeout_s: 600` (thousands of requests queue for
minutes on one worker), and `semantic.enabled` false unless --semantic.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from typing import Any

import psutil
import redis

from bench.common import finish, goal, percentile, table
from bench.farms import bench_farm
from bench.stream_load import hold_streams, run_streams, stream_body
from farm.infra.redis_client import connect
from farm.protocol.keys import OBS_STREAM

DEFAULT_NS = [500, 1000, 2000, 5000]
GOAL_STREAMS = 2000
GOAL_KB_PER_STREAM = 50.0
WARMUP_STREAMS = 8
IDLE_STREAMS = 20  # one at a time, for the overhead without a queue
HOLD_CPU_WINDOW_S = 5.0  # the API's CPU is sampled this long while every stream is held
# A burst of thousands queues for minutes on one worker; a request that never starts ends in a 504 by then.
FIRST_EVENT_TIMEOUT_S = 600


def api_worker(farm) -> psutil.Process:  # noqa: ANN001 - farm.supervisor.Farm
    """The gunicorn worker process (the master only supervises it)."""
    master = psutil.Process(next(p.pid for p in farm.procs if p.role == "api"))
    kids = master.children()
    if len(kids) != 1:
        raise RuntimeError(f"expected one gunicorn worker, found {len(kids)}")
    return kids[0]


def api_ttfts(r: redis.Redis, since: float) -> list[float]:
    """TTFT as the API measured it (submit -> first token read), for requests finished after `since`."""
    out = []
    for _id, fields in r.xrange(OBS_STREAM):
        obs = json.loads(fields[b"o"])
        if obs["ts"] >= since and obs.get("ttft"):
            out.append(float(obs["ttft"]))
    return out


def overhead_ms(client: list[float], api: list[float]) -> float | None:
    """Mean client TTFT minus mean API TTFT over the same requests (means subtract exactly)."""
    return (statistics.fmean(client) - statistics.fmean(api)) * 1000 if client and api else None


def idle_overhead(r: redis.Redis, host: str, port: int, model: str, max_tokens: int) -> float | None:
    """The API's TTFT overhead for one stream at a time on an idle farm (no queue, no burst)."""
    since = time.time()
    client = []
    for i in range(IDLE_STREAMS):
        [out] = run_streams(host, port, [stream_body(model, -100 - i, max_tokens)], 300)
        if out.ok and out.ttft_s is not None:
            client.append(out.ttft_s)
    time.sleep(1.0)  # the last observation lands in farm:obs
    return overhead_ms(client, api_ttfts(r, since))


def run_one(n: int, max_tokens: int, semantic: bool) -> dict[str, Any]:
    overrides = {"router": {"busy_threshold": 0}, "reliability": {"probe_failures": 1000},
                 "api": {"worker_connections": n + 1000, "first_event_timeout_s": FIRST_EVENT_TIMEOUT_S},
                 "semantic": {"enabled": semantic}}
    with bench_farm(both=1, api=True, overrides=overrides) as farm:
        cfg, host, port = farm.cfg, "127.0.0.1", farm.api_port
        r = connect(cfg.redis)
        model = cfg.default_model
        warm = run_streams(host, port, [stream_body(model, -i, max_tokens) for i in range(1, WARMUP_STREAMS + 1)], 300)
        if not all(o.ok for o in warm):
            raise RuntimeError(f"warm-up failed: {[o.error for o in warm if not o.ok]}")
        idle_ms = idle_overhead(r, host, port, model, max_tokens)
        proc = api_worker(farm)
        rss0 = proc.memory_info().rss

        def measure() -> dict[str, Any]:
            """Memory, threads and descriptors with every stream held, and the CPU that holding them costs."""
            cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
            time.sleep(HOLD_CPU_WINDOW_S)
            cpu = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0)
            return {"rss": proc.memory_info().rss, "threads": proc.num_threads(), "fds": proc.num_fds(),
                    "redis_clients": r.info("clients")["connected_clients"], "hold_cpu": cpu}

        since = time.time()
        t0 = time.monotonic()
        hold = hold_streams(cfg, r, host, port, [stream_body(model, i, max_tokens) for i in range(n)],
                            hold_timeout_s=120 + n * 0.03, timeout_s=FIRST_EVENT_TIMEOUT_S + 300, measure=measure)
        wall = time.monotonic() - t0
        time.sleep(1.0)  # the last observations land in farm:obs
        api = api_ttfts(r, since)
        r.close()
    outs = hold.outcomes
    client = [o.ttft_s for o in outs if o.ok and o.ttft_s is not None]
    m = hold.measured
    return {
        "n": n, "held": hold.held, "held_after_s": round(hold.held_after_s, 2),
        "ok": sum(o.ok for o in outs), "refused": sum(o.refused for o in outs), "broken": sum(o.broken for o in outs),
        "errors": sorted({o.error for o in outs if o.error})[:10],
        "rss_before_mb": rss0 / 2**20, "rss_held_mb": m["rss"] / 2**20,
        "kb_per_stream": (m["rss"] - rss0) / 1024 / hold.held if hold.held else None,
        "threads_held": m["threads"], "fds_held": m["fds"], "redis_clients_held": m["redis_clients"],
        "hold_cpu_pct": m["hold_cpu"] * 100,
        "client_ttft_p50_s": percentile(client, 0.5), "client_ttft_mean_s": statistics.fmean(client) if client else None,
        "api_ttft_p50_s": percentile(api, 0.5), "api_ttft_mean_s": statistics.fmean(api) if api else None,
        "api_ttft_n": len(api), "ttft_overhead_mean_ms": overhead_ms(client, api), "idle_overhead_ms": idle_ms,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=DEFAULT_NS, help="concurrent streams per run")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per stream once released")
    p.add_argument("--semantic", action="store_true", help="keep the semantic layer on (embedding per request)")
    p.add_argument("--out", default="bench/out/api_streams.json")
    args = p.parse_args(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C, so the farm of the run in progress is stopped, not orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    for n in args.n:
        print(f"== {n} streams", flush=True)
        row = run_one(n, args.max_tokens, args.semantic)
        print(json.dumps({k: v for k, v in row.items() if k != "errors"}, default=str), flush=True)
        rows.append(row)
    print()
    print(table(["N", "held", "held after s", "ok", "refused", "broken", "RSS before MB", "RSS held MB", "KB/stream",
                 "threads", "fds", "hold CPU %", "TTFT p50 s", "API TTFT p50 s", "overhead ms", "idle overhead ms",
                 "wall s"],
                [[r["n"], r["held"], r["held_after_s"], r["ok"], r["refused"], r["broken"], r["rss_before_mb"],
                  r["rss_held_mb"], r["kb_per_stream"], r["threads_held"], r["fds_held"], r["hold_cpu_pct"],
                  r["client_ttft_p50_s"], r["api_ttft_p50_s"], r["ttft_overhead_mean_ms"], r["idle_overhead_ms"],
                  r["wall_s"]] for r in rows], digits=1))
    at_goal = [r for r in rows if r["n"] >= GOAL_STREAMS]
    goals = []
    if at_goal:
        g = min(at_goal, key=lambda r: r["n"])
        clean = g["held"] >= g["n"] and g["refused"] == 0 and g["broken"] == 0
        goals.append(goal(f"{g['n']} streams held, 0 refused or broken", float(clean), 1.0))
        if g["kb_per_stream"] is not None:
            goals.append(goal("KB per open stream", g["kb_per_stream"], GOAL_KB_PER_STREAM, higher_is_better=False))
    finish(args.out, {"max_tokens": args.max_tokens, "semantic": args.semantic, "runs": rows}, goals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
