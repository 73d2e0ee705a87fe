"""Helpers shared by the benchmarks: timing, summaries, goals, tables, machine info and JSON output.

Every benchmark prints a table for people and writes a JSON file with all raw numbers, so a later run
(or another machine) can be compared without re-parsing stdout. Machine info travels with the numbers
because on a small CPU box the thread count and the load at the time decide most of the result.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
OUT_DIR = BENCH_DIR / "out"  # git-ignored


def now() -> float:
    """Monotonic high-resolution clock used for every measurement (seconds)."""
    return time.perf_counter()


class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.s`: elapsed seconds of the block."""

    def __init__(self) -> None:
        self.start = 0.0
        self.s = 0.0

    def __enter__(self) -> Stopwatch:
        self.start = now()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = now() - self.start


def summarize(xs: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the raw values: medians resist the odd slow run on a shared machine."""
    xs = list(xs)
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "values": []}
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def goal(name: str, value: float, target: float, higher_is_better: bool = True) -> dict[str, Any]:
    """A goal check kept as data (name, value, target, reached) so JSON and tables agree."""
    reached = value >= target if higher_is_better else value <= target
    op = ">=" if higher_is_better else "<="
    return {"name": name, "value": value, "target": target, "op": op, "reached": bool(reached)}


def goal_line(g: dict[str, Any], fmt: str = "{:.2f}") -> str:
    mark = "REACHED" if g["reached"] else "NOT reached"
    return f"goal {g['name']}: {fmt.format(g['value'])} (target {g['op']} {fmt.format(g['target'])}) -> {mark}"


def fmt_num(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], digits: int = 2) -> str:
    """A plain-text table that is also valid Markdown (pipes), so it can be pasted into RESULTS.md."""
    cells = [[str(h) for h in headers]] + [[fmt_num(c, digits) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths,
                                                                                                 strict=True))) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _git_rev() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class CpuShare:
    """CPU seconds this process used over a span, and their share of the usable cores' wall time.

    `with CpuShare() as c: ...` then `c.cpu_s`, `c.wall_s`, `c.share`. On a shared box other work takes
    cores and inflates wall-clock timings; the share is recorded beside each figure so a noisy run can
    be recognised, and work per CPU-second gives a second, less load-sensitive comparison.
    """

    def __init__(self, cores: int | None = None) -> None:
        self.cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        self.share = 0.0
        self.cpu_s = 0.0
        self.wall_s = 0.0

    def __enter__(self) -> CpuShare:
        t = os.times()
        self._cpu, self._wall = t.user + t.system, now()
        return self

    def __exit__(self, *exc: object) -> None:
        t = os.times()
        self.wall_s = now() - self._wall
        self.cpu_s = t.user + t.system - self._cpu
        self.share = self.cpu_s / (self.wall_s * self.cores) if self.wall_s > 0 else 0.0


def load_average() -> list[float] | None:
    """1/5/15-minute load; a value near or above the core count means the numbers are noisy."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: cores usable by this process, torch and its threads, the date."""
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": load_average(),
        "git_rev": _git_rev(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write `data` as indented JSON, creating the folder; returns the path written."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    return p


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by rank, None for no data: enough for latency tails of a benchmark."""
    if not xs:
        return None
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def finish(out: str | Path, data: dict[str, Any], goals: list[dict[str, Any]], fmt: str = "{:.2f}") -> Path:
    """Print each goal's line and write the run's JSON (with machine info and goals) to `out`."""
    print()
    for g in goals:
        print(goal_line(g, fmt))
    path = write_json(out, {"machine": machine_info(), **data, "goals": goals})
    print(f"\nwrote {path}")
    return path


def alternating(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, contender) in A B ... then ... B A order, and so on for more rounds: the order every bench that
    compares contenders runs them in, so drift of the machine during a run favours none."""
    return [(r, n) for r in range(rounds) for n in (names if r % 2 == 0 else names[::-1])]


def threads_env(embedding_threads: int | None) -> dict[str, str]:
    """The configuration variable setting the semantic layer's encoder threads, when a bench is told a count."""
    return {} if embedding_threads is None else {"FARM_SEMANTIC__EMBEDDING_THREADS": str(embedding_threads)}
