"""bench/peers: the farm side by side with vLLM alone, vLLM's own router and NVIDIA Dynamo (issue 20, item 5).

    .venv/bin/python -m bench.peers            # the full run (about two hours on 2 quiet cores)
    .venv/bin/python -m bench.peers --smoke    # every contender starts, serves and is measured, briefly

One command, one run: every contender on the same model (SmolLM2-135M-Instruct, fp32, the prepared
directory), the same prompts, the same KV block size (32), KV cache size and compile mode, one after
another on the same cores (each is stopped before the next starts), all of them twice in alternating
order (A B ... B A), each after a warm-up. Ratios are computed within the run.

Single engine (the streamed-chat client of load.py; 1 and 16 concurrent clients, 64 output tokens,
`ignore_eos`, temperature 0): `vllm serve` alone; the farm with one `backend: vllm` worker; the farm with
one built-in worker; the built-in engine in this process (no farm, the same token ids).

Two engines (aiperf, bench/routing's shared-prefix multi-turn workload, seeded and shuffled): 2 `vllm
serve` behind vllm-router (round_robin, cache_aware, kv_aware); the farm with 2 `backend: vllm` workers
in `kv` and `round-robin` modes; Dynamo's frontend (`--router-mode kv`) over 2 `dynamo.vllm` workers.

Peers install into their own venvs under bench/.peers/ on first use (install.py). A contender that
cannot start is reported with its error and the run goes on. Prints tables and the goals, writes
bench/out/peers.json (smoke: peers-smoke.json) and a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from bench.common import OUT_DIR, alternating, finish, load_average, table
from bench.cpu import cpu_by_kind
from bench.peers import contenders as c
from bench.peers import install, report
from bench.peers.inprocess import inprocess_engine
from bench.peers.load import run_http_level, warm_up_http

SINGLE = ["vllm-serve", "farm-vllm", "farm-builtin", "inproc-builtin"]
MULTI = ["router-round_robin", "router-cache_aware", "router-kv_aware", "farm-kv", "farm-round-robin", "dynamo-kv"]
DOCS_FIGURE = Path(__file__).resolve().parents[2] / "docs" / "figures" / "peers.png"



def in_process_config(s: c.Setup) -> Any:
    """The configuration the farm's built-in worker gets (contenders.farm_overrides), for the in-process engine."""
    from farm.config import load_config

    state = Path(tempfile.mkdtemp(prefix="peers-inproc-"))
    path = state / "bench.yaml"
    path.write_text(yaml.safe_dump({"state_dir": str(state), **c.farm_overrides(s, "builtin", "kv")}))
    return load_config(path, environ={})


def http_contender(name: str, s: c.Setup) -> contextlib.AbstractContextManager[c.Endpoint]:
    starts: dict[str, Callable[[], contextlib.AbstractContextManager[c.Endpoint]]] = {
        "vllm-serve": lambda: c.vllm_serve(s),
        "farm-vllm": lambda: c.farm(s, "vllm", 1),
        "farm-builtin": lambda: c.farm(s, "builtin", 1),
        "router-round_robin": lambda: c.vllm_router(s, "round_robin"),
        "router-cache_aware": lambda: c.vllm_router(s, "cache_aware"),
        "router-kv_aware": lambda: c.vllm_router(s, "kv_aware"),
        "farm-kv": lambda: c.farm(s, "vllm", 2, "kv"),
        "farm-round-robin": lambda: c.farm(s, "vllm", 2, "round-robin"),
        "dynamo-kv": lambda: c.dynamo(s),
    }
    return starts[name]()


@contextlib.contextmanager
def recorded(record: dict[str, Any]) -> Iterator[None]:
    """Time the block into `record`; an exception becomes the record's `error` (the run goes on)."""
    t0 = time.monotonic()
    record["load_average_start"] = load_average()
    try:
        yield
    except Exception as e:  # noqa: BLE001 - one contender failing must not lose the others' numbers
        record["error"] = f"{type(e).__name__}: {e}"
        record["traceback"] = traceback.format_exc()
        print(f"  !! {record['contender']} (round {record['round']}) failed: {record['error'][:2000]}", flush=True)
    finally:
        record["total_s"] = time.monotonic() - t0


def run_single(args: argparse.Namespace, s: c.Setup) -> list[dict[str, Any]]:
    runs = []
    for rnd, name in alternating(args.single, args.rounds):
        rec: dict[str, Any] = {"phase": "single", "contender": name, "round": rnd, "levels": {}}
        runs.append(rec)
        print(f"[single] round {rnd + 1}/{args.rounds}: {name}", flush=True)
        with recorded(rec):
            if name == "inproc-builtin":
                t0 = time.monotonic()
                with inprocess_engine(in_process_config(s), c.MODEL) as eng:
                    rec["start_s"] = time.monotonic() - t0
                    rec["commands"] = ["(in this process) farm.backends.make_engine(<farm-builtin's config>)"]
                    eng.warm_up()
                    for clients in args.clients:
                        rec["levels"][clients] = eng.run_level(f"r{rnd}-c{clients}", clients,
                                                               _per_client(args, clients), args.max_tokens)
                        _print_level(name, clients, rec["levels"][clients])
            else:
                with http_contender(name, s) as ep:
                    rec["start_s"], rec["commands"] = ep.start_s, ep.commands
                    warm_up_http(ep.base_url, ep.model)
                    for clients in args.clients:
                        with cpu_by_kind("machine") as cpu:
                            lv = run_http_level(ep.base_url, ep.model, f"r{rnd}-c{clients}", clients,
                                                _per_client(args, clients), args.max_tokens)
                        rec["levels"][clients] = {**lv, "cpu_s": cpu}
                        _print_level(name, clients, rec["levels"][clients])
    return runs


def _per_client(args: argparse.Namespace, clients: int) -> int:
    return args.requests_1 if clients == 1 else args.requests_n


def _print_level(name: str, clients: int, lv: dict[str, Any]) -> None:
    print(f"    {name} at {clients:2d} client(s): {lv['output_tok_s']:6.1f} tok/s, TTFT p50 {lv['ttft_p50_ms']:.0f} ms, "
          f"ITL p50 {lv['itl_p50_ms']:.0f} ms ({lv['requests']} requests, {lv['output_tokens']} tokens)", flush=True)


def aiperf_metrics(summary: dict[str, Any]) -> dict[str, float | None]:
    from bench.routing import metric

    return {"ttft_p50_ms": metric(summary, "time_to_first_token", "p50"),
            "ttft_p99_ms": metric(summary, "time_to_first_token", "p99"),
            "itl_p50_ms": metric(summary, "inter_token_latency", "p50"),
            "output_tok_s": metric(summary, "output_token_throughput", "avg"),
            "request_s": metric(summary, "request_throughput", "avg"),
            "output_tokens_per_request": metric(summary, "output_sequence_length", "avg")}


def run_multi(args: argparse.Namespace, s: c.Setup, aiperf: Path) -> list[dict[str, Any]]:
    from bench.routing import aiperf_profile

    work = SimpleNamespace(requests=args.multi_requests, concurrency=args.multi_concurrency, prefixes=args.prefixes,
                           prefix_tokens=args.prefix_tokens, output_tokens=args.multi_output_tokens,
                           turns=args.turns)
    runs = []
    for rnd, name in alternating(args.multi, args.rounds):
        rec: dict[str, Any] = {"phase": "multi", "contender": name, "round": rnd}
        runs.append(rec)
        print(f"[multi] round {rnd + 1}/{args.rounds}: {name}", flush=True)
        with recorded(rec), http_contender(name, s) as ep:
            rec["start_s"], rec["commands"] = ep.start_s, ep.commands
            warm_up_http(ep.base_url, ep.model)
            before = ep.counters() if ep.counters else None
            art = OUT_DIR / f"peers-aiperf{'-smoke' if args.smoke else ''}" / f"{name}-r{rnd}"
            with cpu_by_kind("machine") as cpu:
                summary, _, wall = aiperf_profile(aiperf, ep.model, ep.base_url, s.model_dir, art, work, args.timeout)
            after = ep.counters() if ep.counters else None
            m = aiperf_metrics(summary)
            if before is not None and after is not None:
                queried = after["queried"] - before["queried"]
                m["hit_ratio"] = (after["hit"] - before["hit"]) / queried if queried else None
            rec.update(metrics=m, aiperf_wall_s=wall, artifacts=str(art), cpu_s=cpu, requests=work.requests)
            print(f"    {name}: TTFT p50 {m['ttft_p50_ms']:.0f} ms, {m['output_tok_s']:.1f} tok/s, "
                  f"hit ratio {m.get('hit_ratio')}; CPU s in the window: {cpu}", flush=True)
    return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="one round, few requests, --enforce-eager (fast starts): proves every contender runs")
    ap.add_argument("--rounds", type=int, help="rounds in alternating order (default 2, smoke 1)")
    ap.add_argument("--single", default=",".join(SINGLE), help="single-engine contenders ('' for none)")
    ap.add_argument("--multi", default=",".join(MULTI), help="two-engine contenders ('' for none)")
    ap.add_argument("--clients", default="1,16", help="concurrent clients of the single-engine phase")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-1", type=int, help="requests of the single client (default 8, smoke 2)")
    ap.add_argument("--requests-n", type=int, help="requests per client at 16 clients (default 2, smoke 1)")
    ap.add_argument("--kv-mb", type=int, default=1024, help="KV cache per engine, single-engine phase")
    ap.add_argument("--multi-kv-mb", type=int, default=256,
                    help="KV cache per engine, two-engine phase (small, so placement decides reuse)")
    ap.add_argument("--multi-requests", type=int, help="aiperf requests (default 96, smoke 16)")
    ap.add_argument("--multi-concurrency", type=int, help="aiperf concurrency (default 8, smoke 4)")
    ap.add_argument("--prefixes", type=int, help="aiperf prefix pool (default 8, smoke 2)")
    ap.add_argument("--prefix-tokens", type=int, default=640)
    ap.add_argument("--multi-output-tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                    help="vLLM --enforce-eager and the built-in engine's enforce_eager, for every contender "
                         "(default: off, on with --smoke)")
    ap.add_argument("--timeout", type=float, default=1800, help="aiperf timeout per contender (s)")
    ap.add_argument("--out", help="JSON path (default bench/out/peers.json, smoke: peers-smoke.json)")
    ap.add_argument("--plot", help="figure path (default docs/figures/peers.png, smoke: bench/out/peers-smoke.png)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    for key, full, quick in (("rounds", 2, 1), ("requests_1", 8, 2), ("requests_n", 2, 1), ("multi_requests", 96, 16),
                             ("multi_concurrency", 8, 4), ("prefixes", 8, 2), ("eager", False, True)):
        if getattr(args, key) is None:
            setattr(args, key, quick if smoke else full)
    args.single = [x for x in args.single.split(",") if x]
    args.multi = [x for x in args.multi.split(",") if x]
    unknown = sorted(set(args.single) - set(SINGLE)) + sorted(set(args.multi) - set(MULTI))
    if unknown:
        ap.error(f"unknown contenders {unknown}; single: {SINGLE}, multi: {MULTI}")
    args.clients = [int(x) for x in args.clients.split(",") if x]
    args.out = args.out or str(OUT_DIR / ("peers-smoke.json" if smoke else "peers.json"))
    args.plot = args.plot or str(OUT_DIR / "peers-smoke.png" if smoke else DOCS_FIGURE)
    return args


def check_quiet() -> list[float] | None:
    """Warn when the machine is busy: the contenders share its cores with whatever else runs."""
    load = load_average()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if load and load[0] > 0.5 * cores:
        print(f"WARNING: load average {load} on {cores} cores: something else is running, the numbers will be "
              "noisy (ratios within this run still compare like with like only if the load stays even)", flush=True)
    return load


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load0 = check_quiet()
    t_run = time.monotonic()
    tools = install.all_peers() if args.multi else {}
    from farm.config import load_config
    from farm.models.directories import model_dir

    base = load_config(environ={})
    mdir = model_dir(base, base.model(base.default_model))
    logs = install.PEERS_DIR / "logs" / time.strftime("%Y%m%d-%H%M%S")
    print(f"model {mdir}; logs in {logs}; rounds {args.rounds}; eager {args.eager}", flush=True)
    phases: dict[str, float] = {}
    single_runs: list[dict[str, Any]] = []
    multi_runs: list[dict[str, Any]] = []
    if args.single:
        t0 = time.monotonic()
        single_runs = run_single(args, c.Setup(mdir, logs, kv_bytes=args.kv_mb * 2**20, enforce_eager=args.eager))
        phases["single"] = time.monotonic() - t0
    if args.multi:
        t0 = time.monotonic()
        multi_runs = run_multi(args, c.Setup(mdir, logs, kv_bytes=args.multi_kv_mb * 2**20,
                                             enforce_eager=args.eager), Path(tools["aiperf"]))
        phases["multi"] = time.monotonic() - t0
    phases["total"] = time.monotonic() - t_run

    single, multi = report.single_means(single_runs), report.multi_means(multi_runs)
    if single:
        print(f"\nOne engine: {args.max_tokens} output tokens, greedy, ignore_eos, streamed; means over "
              f"{args.rounds} round(s)")
        print(report.single_table(single))
        print(report.single_cpu_table(single_runs, max(args.clients)))
    if multi:
        print(f"\nTwo engines: aiperf shared-prefix multi-turn ({args.multi_requests} requests, concurrency "
              f"{args.multi_concurrency}, {args.prefixes} prefixes x {args.prefix_tokens} tokens, {args.turns} turns)")
        print(report.multi_table(multi))
        if any(r.get("cpu_s") for r in multi_runs):
            print(report.cpu_table(multi_runs))
    failed = [r for r in single_runs + multi_runs if r.get("error")]
    if failed:
        print()
        print(table(["contender", "round", "error"],
                    [[r["contender"], r["round"], r["error"].splitlines()[0][:160]] for r in failed]))
    print()
    print(table(["phase", "seconds"], [[k, v] for k, v in phases.items()], digits=0))
    goals, missing = report.goals(single, multi)
    for name in missing:
        print(f"goal {name}: not measured (a contender is missing or failed)")
    title = (f"bench/peers{' --smoke' if args.smoke else ''}: SmolLM2-135M fp32, 2 CPU cores, "
             f"{args.rounds} round(s), load at start {load0}")
    finish(args.out, {"benchmark": "peers", "args": vars(args), "tools": tools, "model_dir": str(mdir),
                      "logs": str(logs), "load_average_start": load0, "load_average_end": load_average(),
                      "phases_s": phases, "single_runs": single_runs, "multi_runs": multi_runs,
                      "single_means": single, "multi_means": multi, "goals_not_measured": missing}, goals)
    try:  # after the JSON, so a run is never lost to the figure
        print(f"figure: {report.plot(single, multi, Path(args.plot), title)}")
    except ImportError as e:
        print(f"no figure ({e}): install the bench extra, `.venv/bin/pip install -e '.[bench]'`")
    return 1 if failed else 0
