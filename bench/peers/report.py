"""What bench/peers prints and draws: per-contender means over the rounds, the issue's goals as ratios
within this run, and one figure."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.common import goal, table

SINGLE_METRICS = ["output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
MULTI_METRICS = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "output_tok_s", "request_s", "hit_ratio"]


def _mean(xs: list[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return statistics.fmean(ys) if ys else None


def single_means(runs: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """contender -> clients -> metric -> mean over the rounds (plus `rounds`: the per-round values)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        for clients, lv in (r.get("levels") or {}).items():
            slot = out.setdefault(r["contender"], {}).setdefault(int(clients), {"rounds": []})
            slot["rounds"].append({m: lv.get(m) for m in SINGLE_METRICS})
    for by_level in out.values():
        for slot in by_level.values():
            for m in SINGLE_METRICS:
                slot[m] = _mean([x[m] for x in slot["rounds"]])
    return out


def multi_means(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        if r.get("metrics"):
            out.setdefault(r["contender"], {"rounds": []})["rounds"].append(r["metrics"])
    for slot in out.values():
        for m in MULTI_METRICS:
            slot[m] = _mean([x.get(m) for x in slot["rounds"]])
    return out


def single_table(means: dict[str, dict[int, dict[str, Any]]]) -> str:
    rows = []
    for name, by_level in means.items():
        for clients, m in sorted(by_level.items()):
            tok_rounds = " / ".join(f"{x['output_tok_s']:.1f}" for x in m["rounds"] if x["output_tok_s"] is not None)
            rows.append([name, clients, m["output_tok_s"], tok_rounds, m["ttft_p50_ms"], m["ttft_p99_ms"],
                         m["itl_p50_ms"], m["itl_p99_ms"]])
    return table(["contender", "clients", "out tok/s", "tok/s per round", "TTFT p50 ms", "TTFT p99 ms",
                  "ITL p50 ms", "ITL p99 ms"], rows, digits=1)


def multi_table(means: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, m in means.items():
        ttft_rounds = " / ".join(f"{x['ttft_p50_ms']:.0f}" for x in m["rounds"] if x.get("ttft_p50_ms") is not None)
        rows.append([name, m["ttft_p50_ms"], ttft_rounds, m["ttft_p99_ms"], m["itl_p50_ms"], m["output_tok_s"],
                     m["request_s"], m["hit_ratio"]])
    return table(["contender", "TTFT p50 ms", "TTFT p50 per round", "TTFT p99 ms", "ITL p50 ms", "out tok/s",
                  "req/s", "hit ratio"], rows, digits=2)


def _cpu_rows(per: dict[str, list[dict[str, float]]]) -> tuple[list[str], list[list[Any]]]:
    kinds = sorted({k for rounds in per.values() for x in rounds for k in x})
    return kinds, [[name, *[_mean([x.get(k) for x in rounds]) or 0.0 for k in kinds]] for name, rounds in per.items()]


def single_cpu_table(runs: list[dict[str, Any]], clients: int) -> str:
    """CPU seconds per request by kind of process at `clients` concurrent clients (bench/cpu.py)."""
    per: dict[str, list[dict[str, float]]] = {}
    for r in runs:
        lv = (r.get("levels") or {}).get(clients) or (r.get("levels") or {}).get(str(clients))
        if lv and lv.get("cpu_s") and lv.get("requests"):
            per.setdefault(r["contender"], []).append({k: v / lv["requests"] for k, v in lv["cpu_s"].items()})
    kinds, rows = _cpu_rows(per)
    return table([f"contender (CPU s per request, {clients} clients)", *kinds], rows, digits=3)


def cpu_table(runs: list[dict[str, Any]]) -> str:
    """CPU seconds per request by kind of process during the measured windows (bench/cpu.py), mean over
    rounds: where the time of each contender goes on the machine's 2 cores."""
    per: dict[str, list[dict[str, float]]] = {}
    for r in runs:
        if r.get("cpu_s") and r.get("metrics"):
            n = r.get("requests") or 1
            per.setdefault(r["contender"], []).append({k: v / n for k, v in r["cpu_s"].items()})
    kinds, rows = _cpu_rows(per)
    return table(["contender (CPU s per request)", *kinds], rows, digits=3)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goals(single: dict[str, dict[int, dict[str, Any]]], multi: dict[str, dict[str, Any]]) -> tuple[list, list]:
    """The issue's goals as bench.common goals, and the ones that could not be computed (a contender missing)."""
    out, missing = [], []

    def add(name: str, value: float | None, target: float, higher: bool = True) -> None:
        if value is None:
            missing.append(name)
        else:
            out.append(goal(name, value, target, higher_is_better=higher))

    def s(name: str, clients: int, metric: str) -> float | None:
        return (single.get(name, {}).get(clients) or {}).get(metric)

    def m(name: str, metric: str) -> float | None:
        return (multi.get(name) or {}).get(metric)

    add("farm 1 vLLM worker / vllm serve: out tok/s at 16 clients",
        _ratio(s("farm-vllm", 16, "output_tok_s"), s("vllm-serve", 16, "output_tok_s")), 0.95)
    add("farm 1 vLLM worker / vllm serve: TTFT p50 at 1 client",
        _ratio(s("farm-vllm", 1, "ttft_p50_ms"), s("vllm-serve", 1, "ttft_p50_ms")), 1.10, higher=False)
    for clients in (1, 16):
        add(f"farm built-in worker / built-in in-process: out tok/s at {clients} client(s)",
            _ratio(s("farm-builtin", clients, "output_tok_s"), s("inproc-builtin", clients, "output_tok_s")), 0.90)
    for clients in (1, 16):
        add(f"(stretch) built-in in-process / vllm serve: out tok/s at {clients} client(s)",
            _ratio(s("inproc-builtin", clients, "output_tok_s"), s("vllm-serve", clients, "output_tok_s")), 1.0)
    for peer, ttft_target in (("dynamo-kv", 1.0), ("router-cache_aware", 0.7), ("router-kv_aware", 1.0)):
        add(f"farm kv / {peer}: TTFT p50 (shared prefix)", _ratio(m("farm-kv", "ttft_p50_ms"), m(peer, "ttft_p50_ms")),
            ttft_target, higher=False)
        add(f"farm kv / {peer}: out tok/s (shared prefix)",
            _ratio(m("farm-kv", "output_tok_s"), m(peer, "output_tok_s")), 1.0)
    return out, missing


def plot(single: dict[str, dict[int, dict[str, Any]]], multi: dict[str, dict[str, Any]], path: Path,
         title: str) -> Path:
    """Three panels: single-engine tok/s and TTFT p50 at each client count, and the shared-prefix runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    names = list(single)
    levels = sorted({c for by in single.values() for c in by})
    width = 0.8 / max(1, len(levels))
    for panel, metric, label in ((0, "output_tok_s", "output tok/s"), (1, "ttft_p50_ms", "TTFT p50 (ms)")):
        ax = axes[panel]
        for j, clients in enumerate(levels):
            vals = [(single[n].get(clients) or {}).get(metric) or 0.0 for n in names]
            ax.bar([i + j * width for i in range(len(names))], vals, width, label=f"{clients} client(s)")
        ax.set_xticks([i + width * (len(levels) - 1) / 2 for i in range(len(names))], names, rotation=20, ha="right")
        ax.set_ylabel(label)
        if metric.startswith("ttft"):
            ax.set_yscale("log")  # 16 clients queue for seconds where 1 client waits milliseconds
        ax.set_title(f"one engine: {label}")
        if levels:
            ax.legend()
    ax = axes[2]
    mnames = list(multi)
    ax.bar(range(len(mnames)), [multi[n]["ttft_p50_ms"] or 0.0 for n in mnames], color="tab:orange")
    ax.set_xticks(range(len(mnames)), mnames, rotation=20, ha="right")
    ax.set_ylabel("TTFT p50 (ms)", color="tab:orange")
    twin = ax.twinx()
    twin.plot(range(len(mnames)), [multi[n]["output_tok_s"] or 0.0 for n in mnames], "o", color="tab:blue")
    twin.set_ylabel("output tok/s (dots)", color="tab:blue")
    twin.set_ylim(bottom=0)
    ax.set_title("2 engines, shared-prefix multi-turn (aiperf)")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
