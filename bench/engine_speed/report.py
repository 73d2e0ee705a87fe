"""What the bench prints and the goals it checks: per contender and level the medians over rounds, CPU by
kind of process per 1,000 output tokens, and the ratios within the run (median over rounds, and each
round's own value: round r of one contender against round r of the other)."""

from __future__ import annotations

import statistics
from typing import Any

from bench.common import goal, table
from bench.cpu import CLIENT, MACHINE_OTHERS, REAPED, SERVER_KINDS, server_cpu

METRICS = ["wall_s", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "gap_p50_ms", "gap_p99_ms", "itl_p50_ms",
           "latency_p50_ms", "tokens_per_chunk"]


def median(xs: list[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return statistics.median(ys) if ys else None


def levels_of(runs: list[dict[str, Any]]) -> dict[str, dict[int, list[tuple[int, dict[str, Any]]]]]:
    """contender -> streams -> [(round, level dict)] in round order."""
    out: dict[str, dict[int, list[tuple[int, dict[str, Any]]]]] = {}
    for r in runs:
        for streams, lv in (r.get("levels") or {}).items():
            out.setdefault(r["contender"], {}).setdefault(int(streams), []).append((r["round"], lv))
    return out


def cpu_per_1k(lv: dict[str, Any], in_process: bool = False) -> dict[str, float]:
    """CPU ms per 1,000 output tokens, by kind, plus 'server total' (the contender's own processes; for the
    in-process engine this process, which is engine and client at once)."""
    tokens = lv.get("output_tokens") or 0
    cpu = lv.get("cpu_s") or {}
    if not tokens:
        return {}
    out = {k: v * 1e6 / tokens for k, v in cpu.items() if k != MACHINE_OTHERS}
    out["server total"] = (cpu.get(CLIENT, 0.0) if in_process else server_cpu(cpu)) * 1e6 / tokens
    return out


def main_table(agg: dict[str, dict[int, list[tuple[int, dict[str, Any]]]]]) -> str:
    rows = []
    for name, by_level in agg.items():
        for streams, rounds in sorted(by_level.items()):
            lvs = [lv for _, lv in rounds]
            m = {k: median([lv.get(k) for lv in lvs]) for k in METRICS}
            failed = any(lv.get("failed") for lv in lvs)
            rows.append([name, streams, "FAILED" if failed else "ok", m["wall_s"], m["output_tok_s"],
                         " / ".join(f"{lv['output_tok_s']:.0f}" for lv in lvs), lvs[0]["requests"],
                         sum(lv["errors"] for lv in lvs), m["ttft_p50_ms"], m["ttft_p99_ms"], m["gap_p50_ms"],
                         m["gap_p99_ms"], m["itl_p50_ms"], m["latency_p50_ms"], m["tokens_per_chunk"],
                         " / ".join(f"{x:.2f}" for lv in lvs if (x := others_cores(lv)) is not None)])
    return table(["contender", "streams", "status", "wall s", "out tok/s", "tok/s by round", "requests",
                  "errors", "TTFT p50 ms", "TTFT p99 ms", "gap p50 ms", "gap p99 ms", "ITL p50 ms",
                  "latency p50 ms", "tok/chunk", "others' cores"], rows, digits=1) + (
        "\n(others' cores: CPU the rest of the machine used during the level, per round, in cores: the noise)")


def others_cores(lv: dict[str, Any]) -> float | None:
    """Cores' worth of CPU that processes outside this bench used during the level."""
    x = (lv.get("cpu_s") or {}).get(MACHINE_OTHERS)
    return x / lv["wall_s"] if x is not None and lv.get("wall_s") else None


def cpu_table(agg: dict[str, dict[int, list[tuple[int, dict[str, Any]]]]]) -> str:
    """CPU ms per 1,000 output tokens by kind (median over rounds); the client apart from the server total."""
    per: list[tuple[str, int, dict[str, float | None]]] = []
    kinds: set[str] = set()
    for name, by_level in agg.items():
        for streams, rounds in sorted(by_level.items()):
            vals = [cpu_per_1k(lv, name == "inproc-builtin") for _, lv in rounds]
            ks = {k for v in vals for k in v}
            kinds |= ks
            per.append((name, streams, {k: median([v.get(k) for v in vals]) for k in ks}))
    server = [k for k in SERVER_KINDS if k in kinds]
    rest = sorted(kinds - set(server) - {"server total", CLIENT, REAPED})
    cols = [*server, "server total", CLIENT, *rest, *([REAPED] if REAPED in kinds else [])]
    rows = [[name, streams, *[v.get(k) for k in cols]] for name, streams, v in per]
    return table(["contender (CPU ms per 1,000 output tokens)", "streams", *cols], rows, digits=0) + (
        "\n(inproc-builtin: engine and client share this process, so its server total is that process)"
        if any(name == "inproc-builtin" for name, _, _ in per) else "")


def error_table(agg: dict[str, dict[int, list[tuple[int, dict[str, Any]]]]]) -> str | None:
    rows = []
    for name, by_level in agg.items():
        for streams, rounds in sorted(by_level.items()):
            for rnd, lv in rounds:
                if lv.get("errors"):
                    rows.append([name, streams, rnd + 1, lv["errors"], str(lv.get("error_kinds")),
                                 "; ".join(lv.get("error_examples") or [])[:200]])
    return table(["contender", "streams", "round", "errors", "kinds", "examples"], rows) if rows else None


def _round_ratio(agg: dict[str, dict[int, list[tuple[int, dict[str, Any]]]]], a: str, b: str, streams: int,
                 value: Any) -> dict[str, Any] | None:
    """Per round value(a's level) / value(b's level), and their median; None when either is missing."""
    ra = dict(agg.get(a, {}).get(streams, []))
    rb = dict(agg.get(b, {}).get(streams, []))
    rounds = sorted(set(ra) & set(rb))
    vals = []
    for r in rounds:
        x, y = value(ra[r]), value(rb[r])
        vals.append(x / y if x is not None and y else None)
    med = median(vals)
    if med is None:
        return None
    failed = any(ra[r].get("failed") or rb[r].get("failed") for r in rounds)
    return {"median": med, "rounds": vals, "failed": failed}


def _tok_s(lv: dict[str, Any]) -> float | None:
    return lv.get("output_tok_s")


def _ttft(lv: dict[str, Any]) -> float | None:
    return lv.get("ttft_p50_ms")


def _server_cpu_per_token(lv: dict[str, Any]) -> float | None:
    tokens = lv.get("output_tokens")
    return server_cpu(lv.get("cpu_s") or {}) / tokens if tokens else None


def ratios(agg: dict[str, dict[int, list[tuple[int, dict[str, Any]]]]], levels: list[int],
           semantic_level: int) -> list[dict[str, Any]]:
    """The run's ratios; `target` and `higher` where the brief sets a goal, None for the informative ones."""
    specs: list[tuple[str, str, str, int, Any, float | None, bool]] = []
    for n in levels:
        specs += [("farm-vllm / vllm-serve: output tok/s", "farm-vllm", "vllm-serve", n, _tok_s, 0.90, True),
                  ("farm-vllm / vllm-serve: TTFT p50", "farm-vllm", "vllm-serve", n, _ttft, 1.5, False),
                  ("farm-vllm / vllm-serve: server CPU per output token", "farm-vllm", "vllm-serve", n,
                   _server_cpu_per_token, 1.3, False)]
    specs.append(("farm-builtin / inproc-builtin: output tok/s", "farm-builtin", "inproc-builtin", levels[0], _tok_s,
                  0.90, True))
    for n in levels[1:]:
        specs.append(("farm-builtin / inproc-builtin: output tok/s", "farm-builtin", "inproc-builtin", n, _tok_s,
                      None, True))
    specs += [("farm-vllm-semantic / farm-vllm: output tok/s", "farm-vllm-semantic", "farm-vllm", semantic_level,
               _tok_s, None, True),
              ("farm-vllm-semantic / farm-vllm: TTFT p50", "farm-vllm-semantic", "farm-vllm", semantic_level, _ttft,
               None, False),
              ("farm-vllm-semantic / farm-vllm: server CPU per output token", "farm-vllm-semantic", "farm-vllm",
               semantic_level, _server_cpu_per_token, None, False)]
    out = []
    for name, a, b, n, fn, target, higher in specs:
        r = _round_ratio(agg, a, b, n, fn)
        if r is not None:
            out.append({"name": f"{name} at {n} streams", "streams": n, "target": target, "higher": higher, **r})
    return out


def ratio_table(rs: list[dict[str, Any]]) -> str:
    rows = []
    for r in rs:
        op = (">=" if r["higher"] else "<=") if r["target"] is not None else ""
        rows.append([r["name"], r["median"], " / ".join("-" if v is None else f"{v:.2f}" for v in r["rounds"]),
                     f"{op} {r['target']}" if r["target"] is not None else "(info)",
                     "level FAILED" if r["failed"] else ""])
    return table(["ratio (within this run)", "median", "by round", "goal", "note"], rows)


def goals_of(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """bench.common goals for the ratios that have a target; a ratio over a FAILED level is not reached."""
    out = []
    for r in rs:
        if r["target"] is None:
            continue
        g = goal(r["name"] + (" (a level FAILED)" if r["failed"] else ""), r["median"], r["target"], r["higher"])
        if r["failed"]:
            g["reached"] = False
        out.append(g)
    return out


def expected_goals(levels: list[int]) -> list[str]:
    """Goal names that should exist for a full set of contenders (to say which could not be computed)."""
    names = []
    for n in levels:
        names += [f"farm-vllm / vllm-serve: output tok/s at {n} streams", f"farm-vllm / vllm-serve: TTFT p50 at {n} streams",
                  f"farm-vllm / vllm-serve: server CPU per output token at {n} streams"]
    names.append(f"farm-builtin / inproc-builtin: output tok/s at {levels[0]} streams")
    return names
