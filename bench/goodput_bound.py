"""What no router could beat on a bench.goodput run: the ceilings its workload and its arrivals set.

A goal no router can reach on a run is a property of the run's size, not of the router. For each (workload,
rate) of a run this computes, from the seeded workload and what the contenders measured:

- **hit ceiling**: the share of prompt tokens any router could serve from cache with unlimited KV cache. A
  request reuses, in whole blocks, the longest token prefix it shares with a request that arrived before it
  (a conversation's later turn: its previous turn's prompt and answer). Real caches can only lower it.
- **prefill cut max**: the most any router could cut the uncached prompt tokens of the contender that reused
  the most, by reaching the hit ceiling.
- **cold share**: requests with not one block to reuse; each pays a whole prefill whatever the router does.
- **TTFT p90 floor**: when more than 10% of requests are cold, no router's p90 is below the fastest first token
  any contender of the run gave a cold request (on whatever engine was idlest at the time).
- **goodput ceiling**: requests / (the last conversation's arrival + its turns at the fastest latency any
  contender gave a request): no contender's span is shorter, so its goodput is not higher.

Each issue-27 goal against a peer then gets the best value any router could have shown in that run.

    .venv/bin/python -m bench.goodput_bound bench/out/goodput.json   # table, and <name>-bounds.json beside it

bench.goodput prints the same after its own goals.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.common import table, write_json
from bench.peers.contenders import Setup

BLOCK = Setup.block_size  # every contender's KV block size (bench.peers): prefix caching reuses whole blocks
COLD_P90 = 0.10  # more cold requests than this, and every p90 is at least a cold prefill


def reusable_blocks(prompts: Iterable[Sequence[int]], block: int = BLOCK) -> list[int]:
    """For prompts in arrival order: how many leading whole blocks of each an earlier prompt already holds,
    with an unlimited cache (block hashes chained over the prefix, as vLLM's prefix cache keys them)."""
    seen: set[int] = set()
    out = []
    for ids in prompts:
        chain, hit, hashes = 0, 0, []
        for start in range(0, len(ids) - block + 1, block):
            chain = hash((chain, tuple(ids[start:start + block])))
            hashes.append(chain)
        while hit < len(hashes) and hashes[hit] in seen:
            hit += 1
        seen.update(hashes)
        out.append(hit)
    return out


def reusable_tokens(raw: list[dict[str, Any]], first_turn_blocks: list[int], block: int = BLOCK) -> dict[
        tuple[int, int], int]:
    """(conversation, turn) -> tokens any router could serve from cache: a first turn's blocks shared with an
    earlier conversation, a later turn's previous prompt and answer in whole blocks; never the whole prompt
    (an engine computes at least the last token)."""
    by_key = {(r["conversation"], r["turn"]): r for r in raw if not r["error"]}
    out = {}
    for (conv, turn), r in by_key.items():
        if turn == 0:
            tokens = first_turn_blocks[conv] * block
        else:
            prev = by_key.get((conv, turn - 1))
            tokens = (prev["prompt_tokens"] + prev["completion_tokens"]) // block * block if prev else 0
        out[(conv, turn)] = max(0, min(tokens, r["prompt_tokens"] - 1))
    return out


def recomputed_requests(raw: list[dict[str, Any]], block: int = BLOCK) -> tuple[int, int]:
    """(recomputed, repeats) of one run: requests of a prefix (a tenant, or a conversation's later turns) that
    came after an earlier one of it, and those of them that reused less than one block of it: prefilled again
    because the router sent them where the prefix never was or the engine had evicted it. Unlike `moved`, it
    needs no worker names (every contender has it) and counts only moves that cost a prefill; with unlimited
    cache none of them would be (bench.goodput's `recomputed` column)."""
    seen: set[str] = set()
    recomputed = repeats = 0
    for r in sorted(raw, key=lambda r: r.get("sent", 0.0)):
        label = r.get("label")
        if r["error"] or label is None:
            continue
        if label in seen:
            repeats += 1
            recomputed += r["cached_tokens"] < block
        seen.add(label)
    return recomputed, repeats


def _ttft(r: dict[str, Any]) -> float:
    return r["first"] - r["sent"]


def mean_itl_s(r: dict[str, Any]) -> float | None:
    """A completed request's mean inter-token latency (the SLO's ITL), None with fewer than two tokens."""
    n = r["completion_tokens"]
    return (r["last"] - r["first"]) / (n - 1) if n > 1 else None


def workload_bound(runs: list[dict[str, Any]], first_turn_blocks: list[int], last_start_s: float,
                   turns: int, block: int = BLOCK) -> dict[str, Any]:
    """The ceilings of one (workload, rate) over every contender's runs of it (their `raw` records)."""
    hit_ceiling, cold, cold_share, fastest = 0.0, [], 0.0, None
    for run in runs:
        done = [r for r in run["raw"] if not r["error"]]
        if not done:
            continue
        reuse = reusable_tokens(done, first_turn_blocks, block)
        prompt = sum(r["prompt_tokens"] for r in done)
        hit_ceiling = max(hit_ceiling, sum(reuse.values()) / prompt if prompt else 0.0)
        mine = [r for r in done if reuse[(r["conversation"], r["turn"])] == 0]
        cold += [_ttft(r) for r in mine]
        cold_share = max(cold_share, len(mine) / len(done))
        quickest = min(r["last"] - r["sent"] for r in done)
        fastest = quickest if fastest is None else min(fastest, quickest)
    requests = max((len(run["raw"]) for run in runs), default=0)
    span = last_start_s + turns * (fastest or 0.0)
    return {
        "requests": requests, "hit_ceiling": hit_ceiling, "cold_share": cold_share,
        "ttft_p90_floor_ms": min(cold) * 1000 if cold and cold_share > COLD_P90 else None,
        "goodput_ceiling_rps": requests / span if span > 0 else None, "fastest_request_ms": (fastest or 0) * 1000,
    }


def bounds(records: list[dict[str, Any]], rows: list[dict[str, Any]], args: argparse.Namespace,
           tok: Any) -> list[dict[str, Any]]:
    """One row per (workload, rate) of a run's records; `rows`: bench.goodput's pooled rows (their hit ratios)."""
    from bench.goodput import conversations, poisson_starts
    from farm.models.tokenization import chat_prompt_ids

    out = []
    for wl in args.workloads:
        turns = args.turns if wl == "agentic" else 1
        for rate in args.rates:
            tag = f"{wl}-{rate:g}"
            runs = [r["runs"][tag] for r in records if tag in r.get("runs", {})]
            if not runs:
                continue
            convs = conversations(wl, args, tok, tag, args.requests)
            starts = poisson_starts(random.Random(f"{args.seed}-{tag}"), len(convs), rate / turns)
            first = reusable_blocks(chat_prompt_ids(tok, [{"role": "system", "content": c.system},
                                                          {"role": "user", "content": c.users[0]}])
                                    for c in convs)
            bound = workload_bound(runs, first, max(starts), turns)
            best = max((r for r in rows if r["workload"] == wl and r["rate"] == rate), key=lambda r: r["hit_ratio"])
            out.append({"workload": wl, "rate": rate, "block": BLOCK, **bound,
                        "best_hit": best["hit_ratio"], "best_hit_by": best["contender"],
                        # the most any router could cut the best contender's uncached prompt tokens by
                        "prefill_cut_max": 1 - (1 - bound["hit_ceiling"]) / (1 - best["hit_ratio"])
                        if best["hit_ratio"] < 1 else 0.0})
    return out


def goal_bounds(bound_rows: list[dict[str, Any]], rows: list[dict[str, Any]],
                goals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each goal `<workload>: kv goodput / <other>` or `<workload>: kv TTFT p90 / <other>`: the best value
    any router could have shown (the ceiling or floor over the other's measured figure, means over rates as
    bench.goodput's goals take them) and whether the target was within reach."""
    names = {"cache_aware": "router-cache_aware", "round-robin": "farm-round-robin",
             "least-loaded": "farm-least-loaded"}
    out = []
    for g in goals:
        wl, _, rest = g["name"].partition(": kv ")
        metric, _, other = rest.partition(" / ")
        key, best_key = {"goodput": ("goodput_rps", "goodput_ceiling_rps"),
                         "TTFT p90": ("ttft_p90_ms", "ttft_p90_floor_ms")}.get(metric, (None, None))
        if key is None:
            continue
        other = names.get(other, other)
        theirs = [r[key] for r in rows if r["workload"] == wl and r["contender"] == other and r[key]]
        best = [b[best_key] for b in bound_rows if b["workload"] == wl and b[best_key] is not None]
        if not theirs or not best:
            continue
        value = (sum(best) / len(best)) / (sum(theirs) / len(theirs))
        reachable = value >= g["target"] if g["op"] == ">=" else value <= g["target"]
        out.append({"goal": g["name"], "target": g["target"], "op": g["op"], "measured": g["value"],
                    "best_any_router": value, "reachable": reachable})
    return out


def report(bound_rows: list[dict[str, Any]], goal_rows: list[dict[str, Any]]) -> None:
    print("\nWhat no router could beat in this run (bench/goodput_bound.py): unlimited-cache hit ceiling, "
          "cold requests, TTFT p90 floor, goodput ceiling")
    print(table(["workload", "req/s", "requests", "hit ceiling", "best hit measured", "prefill cut max", "cold share",
                 "TTFT p90 floor ms", "goodput ceiling"],
                [[b["workload"], b["rate"], b["requests"], b["hit_ceiling"], f"{b['best_hit']:.2f} ({b['best_hit_by']})",
                  b["prefill_cut_max"], b["cold_share"], b["ttft_p90_floor_ms"], b["goodput_ceiling_rps"]] for b in bound_rows],
                digits=2))
    if goal_rows:
        print(table(["goal", "target", "measured", "best any router", "within reach"],
                    [[g["goal"], f"{g['op']} {g['target']:g}", g["measured"], g["best_any_router"],
                      "yes" if g["reachable"] else "NO"] for g in goal_rows], digits=2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a bench.goodput JSON")
    ap.add_argument("--out", help="JSON path (default: the run's, with -bounds)")
    opts = ap.parse_args(argv)
    from farm.config import load_config
    from farm.models.tokenization import get_tokenizer

    path = Path(opts.run)
    saved = json.loads(path.read_text())
    args = argparse.Namespace(**saved["args"])
    base = load_config(environ={})
    b = bounds(saved["records"], saved["rows"], args, get_tokenizer(base, base.default_model))
    g = goal_bounds(b, saved["rows"], saved.get("goals", []))
    report(b, g)
    out = write_json(opts.out or path.with_name(path.stem + "-bounds.json"),
                     {"benchmark": "goodput_bound", "run": str(path), "bounds": b, "goals": g})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
