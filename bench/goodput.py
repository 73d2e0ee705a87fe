"""Routing judged as users judge it: goodput under a TTFT and an ITL target, at several Poisson arrival rates
(issue 27).

    .venv/bin/python -m bench.goodput                  # the farm's modes: kv, least-loaded, round-robin
    .venv/bin/python -m bench.goodput --peers          # + vllm-router (round_robin, cache_aware, kv_aware)
                                                       #   and Dynamo kv; the farm then runs vLLM workers
    .venv/bin/python -m bench.goodput --smoke          # tiny sizes, one round: proves it runs

Why this shape (bench/routing and bench/peers could flatter a mode, issue 27): two engines, one core each
(the built-in engine with `torch_threads` 1, vLLM bound to one core by bench/peers' contenders); every
contender from nothing (a fresh farm or peer set), warmed up, in alternating order (A B C, C B A, ...) over
`--rounds`; arrivals by a seeded Poisson process at each of `--rates` (requests per second; a multi-turn
conversation arrives at rate / turns and sends its turns one after another), not a closed loop; every
failed request counted, and a contender with any failure is marked FAILED, never scored on its successes.

Workloads (the same seeded texts for every contender; each rate gets texts of its own, so no rate reuses
another's cache):
- no-sharing: every request its own system prompt (kv can only balance load; it must not pack);
- shared-prefix: `--shared-prefixes` system prompts, drawn at random;
- eviction: `--eviction-prefixes` tenants' prompts of `--eviction-tokens` tokens, drawn with Zipf weights
  (1 / rank), together several times the two engines' KV caches (`--kv-mb` each, host and disk tiers off),
  so hot prefixes stay and cold ones are evicted: an index that guesses what is cached keeps sending
  requests where their prefix was;
- agentic: conversations opening with a long context (tools and a task) followed by short tool-result
  turns, each sent with the growing history.
Output: `--output-tokens` per request (greedy, `ignore_eos`, streamed). Headline: goodput = completed
requests per second whose TTFT <= `--ttft-slo-ms` and mean ITL <= `--itl-slo-ms`; beside it TTFT, ITL and
request latency p50/p90, throughput, the prefix-cache hit ratio (answers' usage), requests per worker, and
`moved`: the share of a prefix's later requests the router sent to another worker than the one before (the
farm names its worker in its answers; the peers do not), and `recomputed`: the share of them that reused none
of it (sent where it never was, or evicted there; every contender has it).
Figures pool both rounds; CPU seconds per request by process kind beside them (where the 2 cores went).
After the goals, what no router could beat in the run (bench/goodput_bound.py): the hit ceiling of the
seeded workload, the TTFT p90 floor its cold requests set, the goodput ceiling its arrivals set, and which
goals were within reach of any router.
Writes bench/out/goodput.json (smoke: goodput-smoke.json) and its figure beside it (.png: goodput and TTFT
p90 by offered load; `--replot JSON` redraws a saved run's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import OUT_DIR, alternating, finish, goal, load_average, percentile, table
from bench.cpu import cpu_by_kind
from bench.goodput_bound import BLOCK, bounds, goal_bounds, mean_itl_s, recomputed_requests, report
from bench.peers.load import RequestTiming, stream_chat, warm_up_http
from bench.routing import question, text_of

WORKLOADS = ("no-sharing", "shared-prefix", "eviction", "agentic")
FARM_MODES = ("kv", "least-loaded", "round-robin")
PEERS = ("router-round_robin", "router-cache_aware", "router-kv_aware", "dynamo-kv")
SHARED = ("shared-prefix", "eviction", "agentic")  # workloads where a prefix is reused


# -- workloads ----------------------------------------------------------------------------------------------
@dataclass
class Conversation:
    """One client's conversation: a system prompt and a user message per turn (single-turn: one)."""

    system: str
    users: list[str]
    label: str


def _zipf_choice(rng: random.Random, n: int) -> int:
    return rng.choices(range(n), weights=[1 / (k + 1) for k in range(n)])[0]


def conversations(workload: str, args: argparse.Namespace, tok: Any, tag: str, requests: int) -> list[Conversation]:
    """`requests` requests of `workload` as conversations in arrival order; `tag` makes the texts of one
    (workload, rate) their own (seeded: every contender gets the same)."""
    rng = random.Random(f"{args.seed}-{workload}-{tag}")
    q = args.question_tokens
    if workload == "no-sharing":
        return [Conversation(f"Chat {tag}-{i}. " + text_of(rng, tok, args.prefix_tokens), [question(rng, tok, q)],
                             f"chat {i}") for i in range(requests)]
    if workload in ("shared-prefix", "eviction"):
        n, tokens = ((args.shared_prefixes, args.prefix_tokens) if workload == "shared-prefix"
                     else (args.eviction_prefixes, args.eviction_tokens))
        systems = [f"You are assistant {tag}-{p} of tenant {p}. " + text_of(rng, tok, tokens) for p in range(n)]
        picks = [rng.randrange(n) if workload == "shared-prefix" else _zipf_choice(rng, n) for _ in range(requests)]
        return [Conversation(systems[p], [question(rng, tok, q)], f"prefix {p}") for p in picks]
    if workload == "agentic":
        turns = args.turns
        return [Conversation(f"Agent {tag}-{c}. Tools: search, read, write. Task and context: "
                             + text_of(rng, tok, args.context_tokens),
                             [question(rng, tok, q)] + [f"Tool result: {text_of(rng, tok, args.tool_tokens)}"
                                                        for _ in range(turns - 1)], f"agent {c}")
                for c in range(max(1, requests // turns))]
    raise ValueError(f"unknown workload {workload!r}")


def poisson_starts(rng: random.Random, n: int, rate: float) -> list[float]:
    """Offsets (s) of `n` arrivals of a Poisson process of `rate` per second, the first at 0."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# -- the open-loop client -----------------------------------------------------------------------------------
@dataclass
class Sent:
    conversation: int
    turn: int
    timing: RequestTiming | None = None
    error: str = ""


async def _serve(url: str, model: str, convs: list[Conversation], starts: list[float], max_tokens: int,
                 timeout_s: float) -> tuple[list[Sent], float]:
    """Each conversation starts at its arrival offset whatever the others are doing (an open loop); its turns
    go one after another. Returns every request sent and the span from the first arrival to the last end."""
    sent: list[Sent] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     headers={"Cache-Control": "no-cache"},
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()

        async def one(i: int, c: Conversation) -> None:
            await asyncio.sleep(max(0.0, t0 + starts[i] - time.perf_counter()))
            history = [{"role": "system", "content": c.system}]
            for turn, user in enumerate(c.users):
                history.append({"role": "user", "content": user})
                rec = Sent(i, turn)
                sent.append(rec)
                try:
                    rec.timing = await stream_chat(http, url, model, history, max_tokens)
                except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as e:
                    rec.error = f"{type(e).__name__}: {e}"[:500]
                    return
                history.append({"role": "assistant", "content": rec.timing.text})

        await asyncio.gather(*(one(i, c) for i, c in enumerate(convs)))
        span = time.perf_counter() - t0
    return sent, span


def run_rate(base_url: str, model: str, convs: list[Conversation], rate: float, turns: int, seed: str,
             args: argparse.Namespace) -> dict[str, Any]:
    """One (workload, rate) against a running contender: its raw requests and span."""
    starts = poisson_starts(random.Random(seed), len(convs), rate / turns)
    with cpu_by_kind("machine") as cpu:
        sent, span = asyncio.run(_serve(base_url.rstrip("/") + "/v1/chat/completions", model, convs, starts,
                                        args.output_tokens, args.timeout))
    return {"span_s": span, "errors": [s.error for s in sent if s.error], "cpu_s": cpu,
            "raw": [{"conversation": s.conversation, "label": convs[s.conversation].label, "turn": s.turn,
                     "error": s.error,
                     **({k: v for k, v in asdict(s.timing).items() if k != "text"} if s.timing else {})}
                    for s in sent]}


# -- figures ------------------------------------------------------------------------------------------------
def _moves(raw: list[dict[str, Any]]) -> tuple[int, int]:
    """(moved, repeats) of one run: requests of a prefix (a tenant, or a conversation's later turns) that came
    after an earlier one of it, and those of them placed on another worker than the one before. Only where the
    contender names the worker (the farm); a moved prefix is prefilled again, and then cached twice, unless the
    other worker held it too."""
    last: dict[str, str] = {}
    moved = repeats = 0
    for r in sorted(raw, key=lambda r: r.get("sent", 0.0)):
        worker, label = r.get("worker"), r.get("label")
        if r["error"] or not worker or label is None:
            continue
        if label in last:
            repeats += 1
            moved += last[label] != worker
        last[label] = worker
    return moved, repeats


def summarize(runs: list[dict[str, Any]], ttft_slo_s: float, itl_slo_s: float) -> dict[str, Any]:
    """Pooled over `runs` (one per round): goodput = requests meeting both targets / the runs' summed span."""
    done = [r for run in runs for r in run["raw"] if not r["error"]]
    errors = sum(len(run["errors"]) for run in runs)
    span = sum(run["span_s"] for run in runs)
    ttft = [(r["first"] - r["sent"]) * 1000 for r in done]
    itl = [x * 1000 for r in done if (x := mean_itl_s(r)) is not None]
    latency = [(r["last"] - r["sent"]) * 1000 for r in done]
    good = sum(1 for r in done if r["first"] - r["sent"] <= ttft_slo_s and (mean_itl_s(r) or 0.0) <= itl_slo_s)
    prompt = sum(r["prompt_tokens"] for r in done)
    cpu: Counter[str] = Counter()
    moved = repeats = recomputed = returns = 0
    for run in runs:
        cpu.update(run.get("cpu_s", {}))
        m, n = _moves(run["raw"])
        moved, repeats = moved + m, repeats + n
        m, n = recomputed_requests(run["raw"], BLOCK)
        recomputed, returns = recomputed + m, returns + n
    return {
        "requests": sum(len(run["raw"]) for run in runs), "completed": len(done), "errors": errors,
        "failed": errors > 0 or any(run.get("error") for run in runs), "span_s": span,
        "goodput_rps": good / span if span else 0.0, "slo_met": good / len(done) if done else 0.0,
        "throughput_rps": len(done) / span if span else 0.0,
        "output_tok_s": sum(r["completion_tokens"] for r in done) / span if span else 0.0,
        "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p90_ms": percentile(ttft, 0.9),
        "itl_p50_ms": percentile(itl, 0.5), "itl_p90_ms": percentile(itl, 0.9),
        "latency_p50_ms": percentile(latency, 0.5), "latency_p90_ms": percentile(latency, 0.9),
        "hit_ratio": sum(r["cached_tokens"] for r in done) / prompt if prompt else 0.0,
        "per_worker": dict(sorted(Counter(r["worker"] for r in done if r.get("worker")).items())),
        "moved": moved / repeats if repeats else None,  # share of a prefix's later requests sent elsewhere
        "recomputed": recomputed / returns if returns else None,  # ... that reused none of it
        # where the 2 cores went (bench/cpu.py's kinds): CPU seconds per completed request
        "cpu_s_per_request": {k: round(v / len(done), 3) for k, v in sorted(cpu.items())} if done else {},
    }


# -- contenders ---------------------------------------------------------------------------------------------
def contender(name: str, args: argparse.Namespace, setup: Any) -> Any:
    """A context manager yielding the contender's bench.peers Endpoint: a farm of 2 workers in one router
    mode (the built-in engine with one torch thread each, or vLLM workers bound one core each), or a peer."""
    from bench.peers import contenders as c

    if name.startswith("farm-"):
        mode, _, variant = name.removeprefix("farm-").partition(":")
        extra: dict[str, Any] = {"engine": {"torch_threads": 1}, "router": {"cost": "measured"}}
        if variant.startswith("nice") and args.backend == "vllm":  # "kv:nice0": the engines at this nice
            extra["models"] = [{**m, "vllm": {**m.get("vllm", {}), "engine_nice": int(variant[4:])}}
                               for m in c.farm_overrides(setup, args.backend, mode)["models"]]
        elif variant == "float" and args.backend == "vllm":  # "kv:float": vLLM's engine cores left to float
            extra["models"] = [{**m, "vllm": {**m.get("vllm", {}), "pin_engine_core": False}}
                               for m in c.farm_overrides(setup, args.backend, mode)["models"]]
        elif variant.startswith("busy"):  # "kv:busy1": router.busy_threshold (1 = no worker busy by its KV)
            extra["router"]["busy_threshold"] = float(variant[4:])
        elif variant:
            raise ValueError(f"contender {name!r}: a mode's variant is nice<N> or float (vLLM workers), "
                             "or busy<share>")
        return c.farm(setup, args.backend, 2, mode, extra)
    from bench.peers.run import http_contender

    return http_contender(name, setup)


def run_contender(name: str, rnd: int, args: argparse.Namespace, setup: Any, tok: Any) -> dict[str, Any]:
    """Start `name`, warm it up, run every workload at every rate, stop it; an error is kept in the record."""
    from bench.peers.run import recorded

    rec: dict[str, Any] = {"contender": name, "round": rnd, "runs": {}}
    print(f"round {rnd + 1}/{args.rounds}: {name} (load {load_average()})", flush=True)
    with recorded(rec), contender(name, args, setup) as ep:
        rec["start_s"], rec["commands"] = ep.start_s, ep.commands
        warm_up_http(ep.base_url, ep.model)
        time.sleep(3.0)  # the workers' heartbeats carry their first measured step costs to the router
        for wl in args.workloads:
            turns = args.turns if wl == "agentic" else 1
            for rate in args.rates:
                tag = f"{wl}-{rate:g}"
                convs = conversations(wl, args, tok, tag, args.requests)
                run = run_rate(ep.base_url, ep.model, convs, rate, turns, f"{args.seed}-{tag}", args)
                rec["runs"][tag] = run
                s = summarize([run], args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000)
                print(f"    {wl} at {rate:g} req/s: goodput {s['goodput_rps']:.3f} req/s, TTFT p90 "
                      f"{s['ttft_p90_ms'] or 0:.0f} ms, ITL p90 {s['itl_p90_ms'] or 0:.0f} ms, "
                      f"{s['errors']} errors, per worker {s['per_worker']}", flush=True)
    return rec


def pooled(records: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (workload, rate, contender), pooled over rounds; a contender that failed to run is FAILED."""
    rows = []
    for wl in args.workloads:
        for rate in args.rates:
            tag = f"{wl}-{rate:g}"
            for name in args.contenders:
                mine = [r for r in records if r["contender"] == name]
                runs = [{**r["runs"][tag], "error": r.get("error")} for r in mine if tag in r["runs"]]
                runs += [{"raw": [], "errors": [], "span_s": 0.0, "error": r["error"]}
                         for r in mine if tag not in r["runs"] and r.get("error")]
                rows.append({"workload": wl, "rate": rate, "contender": name,
                             **summarize(runs, args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000)})
    return rows


def _mean_over_rates(rows: list[dict[str, Any]], wl: str, name: str, key: str) -> float | None:
    xs = [r[key] for r in rows if r["workload"] == wl and r["contender"] == name and r[key] is not None]
    return sum(xs) / len(xs) if xs else None


def goals(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Issue 27's goals, each over the mean of the rates, where both contenders ran."""
    out = []

    def ratio(wl: str, a: str, b: str, key: str) -> float | None:
        x, y = _mean_over_rates(rows, wl, a, key), _mean_over_rates(rows, wl, b, key)
        return x / y if x is not None and y else None

    def add(name: str, value: float | None, target: float, higher: bool = True) -> None:
        if value is not None:
            out.append(goal(name, value, target, higher))

    add("eviction: kv TTFT p90 / cache_aware", ratio("eviction", "farm-kv", "router-cache_aware", "ttft_p90_ms"),
        0.5, higher=False)
    add("eviction: kv goodput / cache_aware", ratio("eviction", "farm-kv", "router-cache_aware", "goodput_rps"), 1.2)
    for wl in args.workloads:
        for peer in ("dynamo-kv", "router-kv_aware"):
            add(f"{wl}: kv goodput / {peer}", ratio(wl, "farm-kv", peer, "goodput_rps"), 1.0)
        if wl in SHARED:
            add(f"{wl}: kv goodput / round-robin", ratio(wl, "farm-kv", "farm-round-robin", "goodput_rps"), 1.3)
    add("no-sharing: kv goodput / least-loaded", ratio("no-sharing", "farm-kv", "farm-least-loaded", "goodput_rps"),
        0.95)
    add("no-sharing: kv latency p50 / least-loaded",
        ratio("no-sharing", "farm-kv", "farm-least-loaded", "latency_p50_ms"), 1.05, higher=False)
    add("failed requests, every contender", float(sum(r["errors"] for r in rows)), 0.0, higher=False)
    return out


# -- the figure ---------------------------------------------------------------------------------------------
def plot(path: Path, rows: list[dict[str, Any]], ceilings: list[dict[str, Any]] | None = None) -> None:
    """Goodput (top) and TTFT p90 (bottom), one panel per workload: against the offered rate with a line per
    contender, or as bars when the run had one rate; a FAILED row (any failed request) is marked with an x.
    With `ceilings` (bench/goodput_bound.py's rows), what no router could beat: a dashed line (one rate) or
    dashed curve (several) at the goodput ceiling and the TTFT p90 floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    colours = {name: f"C{i}" for i, name in enumerate(contenders)}
    one_rate = len({r["rate"] for r in rows}) == 1
    fig, axes = plt.subplots(2, len(workloads), figsize=(max(5.6, 4.2 * len(workloads)), 7.4), squeeze=False)
    for col, wl in enumerate(workloads):
        for i, name in enumerate(contenders):
            mine = sorted((r for r in rows if r["workload"] == wl and r["contender"] == name), key=lambda r: r["rate"])
            for ax, key, scale in ((axes[0][col], "goodput_rps", 1.0), (axes[1][col], "ttft_p90_ms", 1e-3)):
                ys = [(r[key] or 0.0) * scale for r in mine]
                xs = [i] * len(mine) if one_rate else [r["rate"] for r in mine]
                if one_rate:
                    ax.bar(xs, ys, color=colours[name], label=name)
                else:
                    ax.plot(xs, ys, "o-", color=colours[name], label=name, linewidth=2.5 if name == "farm-kv" else 1.2)
                bad = [(x, y) for x, y, r in zip(xs, ys, mine, strict=True) if r["failed"]]
                if bad:
                    ax.plot(*zip(*bad, strict=True), "x", color="black", markersize=11)
        mine = sorted((b for b in ceilings or [] if b["workload"] == wl), key=lambda b: b["rate"])
        for ax, key, scale in ((axes[0][col], "goodput_ceiling_rps", 1.0), (axes[1][col], "ttft_p90_floor_ms", 1e-3)):
            pts = [(b["rate"], b[key] * scale) for b in mine if b[key] is not None]
            if pts and one_rate:
                ax.axhline(pts[0][1], color="black", linestyle="--", linewidth=1, label="no router beyond")
            elif pts:
                ax.plot(*zip(*pts, strict=True), "k--", linewidth=1, label="no router beyond")
        axes[0][col].set_title(wl + (f" at {rows[0]['rate']:g} requests/s" if one_rate else ""))
        axes[0][col].set_ylabel("goodput (requests/s)")
        axes[1][col].set_ylabel("TTFT p90 (s)")
        for ax in axes[:, col]:
            if one_rate:
                ax.set_xticks(range(len(contenders)), contenders, rotation=60, ha="right", fontsize=7)
            else:
                ax.set_xlabel("offered load (requests/s)")
    if not one_rate:
        axes[0][0].legend(fontsize=7)
    fig.suptitle("bench.goodput: goodput and TTFT p90\n(x: the contender failed requests;\ndashed: the goodput "
                 "ceiling and TTFT p90 floor\nno router could pass in this run)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def draw(figure: Path, rows: list[dict[str, Any]], ceilings: list[dict[str, Any]] | None = None) -> None:
    """`plot`, or a line saying why there is no figure (matplotlib comes with the `bench` extra)."""
    try:
        plot(figure, rows, ceilings)
        print(f"wrote {figure}")
    except ImportError:
        print("no figure: matplotlib is missing (pip install -e '.[bench]')")


# -- main ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round, one rate: proves it runs")
    ap.add_argument("--peers", nargs="?", const=",".join(PEERS), default="",
                    help="add vllm-router and Dynamo (installed under bench/.peers on first use), all of them or "
                         f"those named ({', '.join(PEERS)}); the farm's workers then run vLLM, as the peers do")
    ap.add_argument("--modes", default=",".join(FARM_MODES),
                    help="the farm's router modes; mode:nice<N> runs its vLLM engines at nice N (default 19 on CPU), "
                         "mode:float leaves vLLM's engine cores unpinned (models[].vllm.pin_engine_core: false), "
                         "mode:busy<share> sets router.busy_threshold")
    ap.add_argument("--backend", choices=("builtin", "vllm"), help="the farm's engine (default: vllm with --peers)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rates", help="Poisson arrival rates, requests/s (default 0.3,0.6,1.2; smoke 1)")
    ap.add_argument("--rounds", type=int, help="rounds in alternating order (default 2, smoke 1)")
    ap.add_argument("--requests", type=int, help="requests per workload and rate (default 32, smoke 4)")
    ap.add_argument("--ttft-slo-ms", type=float, default=4000.0)
    ap.add_argument("--itl-slo-ms", type=float, default=250.0)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--prefix-tokens", type=int, help="no-sharing and shared-prefix system prompts (default 900)")
    ap.add_argument("--shared-prefixes", type=int, default=4)
    ap.add_argument("--eviction-prefixes", type=int, help="tenants of the eviction workload (default 48)")
    ap.add_argument("--eviction-tokens", type=int, help="their prompts' tokens (default 1500)")
    ap.add_argument("--turns", type=int, help="agentic turns per conversation (default 4)")
    ap.add_argument("--context-tokens", type=int, help="agentic opening context (default 1200)")
    ap.add_argument("--tool-tokens", type=int, default=60, help="agentic tool-result turns")
    ap.add_argument("--kv-mb", type=int, help="KV cache per engine, MiB (default 512: about 11k tokens of the "
                                               "default model in fp32, 7 eviction prompts; 48 of them are 3.3x "
                                               "the two engines' caches)")
    ap.add_argument("--eager", action="store_true", help="vLLM --enforce-eager (fast starts)")
    ap.add_argument("--seed", type=int, default=27)
    ap.add_argument("--timeout", type=float, default=1800, help="per (workload, rate), seconds")
    ap.add_argument("--out", help="JSON path (default bench/out/goodput.json, smoke: goodput-smoke.json)")
    ap.add_argument("--plot", help="figure path (default: the JSON's path with .png)")
    ap.add_argument("--replot", metavar="JSON", help="only draw the figure of a saved run's JSON")
    args = ap.parse_args(argv)
    full = {"rates": "0.3,0.6,1.2", "rounds": 2, "requests": 32, "prefix_tokens": 900, "eviction_prefixes": 48,
            "eviction_tokens": 1500, "turns": 4, "context_tokens": 1200, "kv_mb": 512}
    smoke = {"rates": "1", "rounds": 1, "requests": 4, "prefix_tokens": 200, "eviction_prefixes": 8,
             "eviction_tokens": 400, "turns": 2, "context_tokens": 200, "kv_mb": 64}
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke:
        args.output_tokens = min(args.output_tokens, 8)
    args.backend = args.backend or ("vllm" if args.peers else "builtin")
    args.rates = [float(x) for x in args.rates.split(",") if x]
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        ap.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    peers = [p for p in args.peers.split(",") if p]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        ap.error(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    args.contenders = [f"farm-{m}" for m in args.modes.split(",") if m] + peers
    args.out = args.out or str(OUT_DIR / ("goodput-smoke.json" if args.smoke else "goodput.json"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        saved = Path(args.replot)
        run = json.loads(saved.read_text())
        beside = saved.with_name(saved.stem + "-bounds.json")  # bench.goodput_bound's, for a run without its own
        ceilings = run.get("bounds") or (json.loads(beside.read_text())["bounds"] if beside.exists() else None)
        draw(Path(args.plot) if args.plot else saved.with_suffix(".png"), run["rows"], ceilings)
        return 0
    from bench.peers import contenders as c
    from bench.peers import install
    from farm.config import load_config
    from farm.models.directories import model_dir
    from farm.models.tokenization import get_tokenizer

    os.environ.setdefault("FARM_SECRET", secrets.token_hex(16))
    tools = install.all_peers() if args.peers else {}
    base = load_config(environ={})
    mdir = model_dir(base, base.model(base.default_model))
    tok = get_tokenizer(base, base.default_model)
    logs = install.PEERS_DIR / "logs" / time.strftime("goodput-%Y%m%d-%H%M%S")
    setup = c.Setup(mdir, logs, kv_bytes=args.kv_mb * 2**20, enforce_eager=args.eager or args.smoke)
    load0 = load_average()
    print(f"contenders {args.contenders}; workloads {args.workloads}; rates {args.rates} req/s; "
          f"{args.rounds} round(s); load {load0}", flush=True)
    t0 = time.monotonic()
    records = [run_contender(name, rnd, args, setup, tok) for rnd, name in alternating(args.contenders, args.rounds)]
    rows = pooled(records, args)
    print(f"\nGoodput = requests/s with TTFT <= {args.ttft_slo_ms:.0f} ms AND mean ITL <= {args.itl_slo_ms:.0f} ms; "
          f"{args.output_tokens} output tokens; 2 engines, one core each ({args.backend}); pooled over "
          f"{args.rounds} round(s)")
    print(table(["workload", "req/s", "contender", "status", "goodput", "SLO met", "TTFT p50", "p90", "ITL p50",
                 "p90", "latency p50", "p90", "done/s", "tok/s", "hit", "moved", "recomputed", "errors"],
                [[r["workload"], r["rate"], r["contender"], "FAILED" if r["failed"] else "ok", r["goodput_rps"],
                  r["slo_met"], r["ttft_p50_ms"], r["ttft_p90_ms"], r["itl_p50_ms"], r["itl_p90_ms"],
                  r["latency_p50_ms"], r["latency_p90_ms"], r["throughput_rps"], r["output_tok_s"], r["hit_ratio"],
                  r.get("moved"), r.get("recomputed"), r["errors"]] for r in rows], digits=2))
    kinds = sorted({k for r in rows for k in r["cpu_s_per_request"]})
    print("\nCPU seconds per completed request, by process kind (bench/cpu.py)")
    print(table(["workload", "req/s", "contender", *kinds],
                [[r["workload"], r["rate"], r["contender"], *(r["cpu_s_per_request"].get(k) for k in kinds)]
                 for r in rows], digits=3))
    reached = goals(rows, args)
    ceilings = bounds(records, rows, args, tok)
    within_reach = goal_bounds(ceilings, rows, reached)
    report(ceilings, within_reach)
    failed = [r for r in records if r.get("error")]
    for r in failed:
        print(f"FAILED: {r['contender']} round {r['round']}: {r['error'].splitlines()[0][:200]}")
    finish(args.out, {"benchmark": "goodput", "args": vars(args), "tools": tools, "model_dir": str(mdir),
                      "logs": str(logs), "load_average_start": load0, "load_average_end": load_average(),
                      "wall_s": time.monotonic() - t0, "rows": rows, "records": records, "bounds": ceilings,
                      "goals_within_reach": within_reach}, reached)
    draw(Path(args.plot) if args.plot else Path(args.out).with_suffix(".png"), rows, ceilings)
    return 1 if failed or any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
