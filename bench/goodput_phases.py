"""When a bench.goodput contender missed its SLO: in the run's cold start, or after it.

Every contender starts each (workload, rate) with empty KV caches, so the first arrivals are all prefills and
the engines are at their busiest; later, the caches hold the hot prefixes and a router's placements decide how
much is prefilled again. A run of a few dozen requests is mostly its cold start. This splits each contender's
requests (pooled over rounds) by arrival: before `--cold-s` seconds from the run's first request, and after;
for each part, the requests and those that missed the TTFT target, the mean-ITL target, or either (the
goodput's complement).

    .venv/bin/python -m bench.goodput_phases bench/out/goodput.json --cold-s 30   # table, <name>-phases.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.common import table, write_json
from bench.goodput_bound import mean_itl_s


def phase_misses(raw: list[dict[str, Any]], cold_s: float, ttft_slo_s: float, itl_slo_s: float
                 ) -> dict[str, dict[str, int]]:
    """{"cold": ..., "after": ...} of one run's completed requests: how many, and how many missed the TTFT
    target, the mean-ITL target, and either. A request's phase is its arrival's offset from the first."""
    done = [r for r in raw if not r["error"]]
    out = {p: {"requests": 0, "ttft_missed": 0, "itl_missed": 0, "missed": 0} for p in ("cold", "after")}
    if not done:
        return out
    t0 = min(r["sent"] for r in done)
    for r in done:
        part = out["cold" if r["sent"] - t0 < cold_s else "after"]
        slow_first, slow_tokens = r["first"] - r["sent"] > ttft_slo_s, (mean_itl_s(r) or 0.0) > itl_slo_s
        part["requests"] += 1
        part["ttft_missed"] += slow_first
        part["itl_missed"] += slow_tokens
        part["missed"] += slow_first or slow_tokens
    return out


def phases(records: list[dict[str, Any]], cold_s: float, ttft_slo_s: float, itl_slo_s: float
           ) -> list[dict[str, Any]]:
    """One row per (workload-rate, contender), pooled over its rounds, in the records' order."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in records:
        for key, run in rec["runs"].items():
            row = rows.setdefault((key, rec["contender"]), {"run": key, "contender": rec["contender"], "rounds": 0,
                                                            "cold": None, "after": None})
            row["rounds"] += 1
            for part, counts in phase_misses(run["raw"], cold_s, ttft_slo_s, itl_slo_s).items():
                row[part] = counts if row[part] is None else {k: row[part][k] + v for k, v in counts.items()}
    return list(rows.values())


def _share(c: dict[str, int]) -> str:
    return f"{c['missed']}/{c['requests']} ({c['ttft_missed']} TTFT, {c['itl_missed']} ITL)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a bench.goodput JSON")
    ap.add_argument("--cold-s", type=float, default=30.0, help="seconds of arrivals counted as the cold start")
    ap.add_argument("--out", help="JSON path (default: the run's, with -phases)")
    opts = ap.parse_args(argv)
    path = Path(opts.run)
    saved = json.loads(path.read_text())
    args = saved["args"]
    ttft_s, itl_s = args["ttft_slo_ms"] / 1000, args["itl_slo_ms"] / 1000
    rows = phases(saved["records"], opts.cold_s, ttft_s, itl_s)
    print(f"SLO misses (TTFT > {ttft_s:g} s or mean ITL > {itl_s * 1000:g} ms) among requests arriving in the "
          f"first {opts.cold_s:g} s of each run (cold start) and after, pooled over rounds")
    print(table(["run", "contender", "rounds", "missed in cold start", "missed after"],
                [[r["run"], r["contender"], r["rounds"], _share(r["cold"]), _share(r["after"])] for r in rows]))
    out = write_json(opts.out or path.with_name(path.stem + "-phases.json"),
                     {"benchmark": "goodput_phases", "run": str(path), "cold_s": opts.cold_s, "rows": rows})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
