"""Planner simulation: replay a recorded load trace (ramp up, burst, ramp down) on a simulated farm whose
per-worker costs come from the profile measured on the real engine, with the real Planner deciding.

    python -m bench.planner_sim --out bench/out/planner_sim.png
    python -m bench.planner_sim --make-trace      # regenerate bench/traces/ramp_burst.json (seeded)

Runs the SLA policy, the load policy and two static farms (the minimum, and the SLA run's peak) over the
same trace; prints a table, writes the raw numbers as JSON next to the figure, and plots replica
counts, TTFT and ITL against their targets.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, goal, goal_line, machine_info, table, write_json
from farm.config.planner import Bounds, LoadPolicyConfig, PlannerConfig, SlaPolicyConfig
from farm.planner.planner import profile_path
from farm.planner.profile import Profile
from farm.planner.signals import percentile
from farm.planner.simulate import SimResult, simulate

TRACES = Path(__file__).resolve().parent / "traces"
DEFAULT_TRACE = TRACES / "ramp_burst.json"
MODEL = "SmolLM2-135M-Instruct"

# The rate schedule of the recorded trace: (time s, requests/s), linear in between; a burst on top.
SCHEDULE = [(0, 0.3), (60, 0.3), (300, 2.0), (420, 2.0), (600, 0.3), (840, 0.3)]
BURST = (360, 420, 2.0)  # from, to, multiplier of the scheduled rate


def rate_at(t: float, schedule=SCHEDULE, burst=BURST) -> float:
    pts = list(schedule)
    r = pts[-1][1]
    for (t0, r0), (t1, r1) in zip(pts, pts[1:], strict=False):
        if t0 <= t < t1:
            r = r0 + (r1 - r0) * (t - t0) / (t1 - t0)
            break
    return r * (burst[2] if burst[0] <= t < burst[1] else 1.0)


def make_trace(seed: int = 7) -> dict[str, Any]:
    """A non-homogeneous Poisson arrival process (thinning) with log-normal prompt and output lengths."""
    rng = random.Random(seed)
    end = SCHEDULE[-1][0]
    peak = max(r for _t, r in SCHEDULE) * BURST[2]
    rows, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= end:
            break
        if rng.random() * peak <= rate_at(t):
            isl = int(min(2048, max(32, rng.lognormvariate(math.log(256), 0.6))))
            osl = int(min(256, max(8, rng.lognormvariate(math.log(64), 0.5))))
            rows.append([round(t, 3), isl, osl])
    return {"name": "ramp_burst", "seed": seed, "duration_s": end,
            "description": "ramp up 0.3 -> 2.0 req/s, a 2x burst for 60 s, ramp down to 0.3 req/s; "
                           "log-normal prompt (median 256) and output (median 64) tokens",
            "schedule": SCHEDULE, "burst": list(BURST), "columns": ["t_s", "isl", "osl"], "requests": rows}


def planner_cfg(mode: str, profile: Profile, ttft_ms: float, itl_ms: float) -> PlannerConfig:
    """The planner as it would be configured for this model: load thresholds derived from the targets."""
    b = max(1, profile.max_batch_for_itl(itl_ms / 1000))
    return PlannerConfig(
        mode=mode, interval_s=10, window_s=10, cooldown_up_s=10, cooldown_down_s=60, max_step_up=2,
        roles=["prefill", "decode"],
        bounds={"prefill": Bounds(min=1, max=8), "decode": Bounds(min=1, max=8)},
        load=LoadPolicyConfig(scale_up_util=0.8, scale_down_util=0.35, up_intervals=1, down_intervals=3,
                              # a prefill worker is full with one TTFT target's worth of prompt tokens
                              prefill_tokens_per_worker=int(profile.prefill_tokens_per_s(256) * ttft_ms / 1000),
                              decode_requests_per_worker=b, queued_per_worker=4),
        sla=SlaPolicyConfig(ttft_ms=ttft_ms, itl_ms=itl_ms, predictor="ema", ema_alpha=0.6, headroom=1.1),
    )


def windows(res: SimResult, step: float = 10.0) -> list[dict[str, Any]]:
    """Per `step` seconds of arrival time: arrivals/s, TTFT p90 and mean ITL of those requests."""
    out: dict[int, list] = {}
    for r in res.requests:
        if r.done is not None:
            out.setdefault(int(r.arrive // step), []).append(r)
    return [{"t": k * step, "rate": len(rs) / step, "ttft_p90": percentile([r.ttft for r in rs], 90),
             "itl_mean": statistics.fmean(r.itl for r in rs)} for k, rs in sorted(out.items())]


def plot(path: Path, trace: dict[str, Any], runs: dict[str, SimResult], ttft_ms: float, itl_ms: float,
         profile: Profile) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(5, 1, figsize=(11, 14), sharex=True,
                           gridspec_kw={"height_ratios": [1, 1, 1, 1.2, 1.2]})
    w = windows(runs["sla"])
    ax[0].plot([x["t"] for x in w], [x["rate"] for x in w], color="black", label="arrivals (req/s, 10 s bins)")
    ax[0].set_ylabel("req/s")
    ax[0].set_title(f"Planner simulation: trace '{trace['name']}', per-worker costs measured on {profile.model} "
                    f"({profile.device})\ntargets TTFT {ttft_ms:.0f} ms, ITL {itl_ms:.0f} ms; shaded: 2x burst")
    ax[0].legend(loc="upper left")
    colors = {"sla": "tab:green", "load": "tab:purple", "static-min": "tab:red"}
    for i, role in ((1, "prefill"), (2, "decode")):
        for label in ("sla", "load"):
            tl = runs[label].timeline
            ax[i].step([p["t"] for p in tl], [p[role] for p in tl], where="post", color=colors[label],
                       label=f"{label} policy: target")
            ax[i].step([p["t"] for p in tl], [p[f"{role}_ready"] for p in tl], where="post", color=colors[label],
                       linestyle=":", linewidth=1, label=f"{label} policy: ready")
        ax[i].set_ylabel(f"{role} workers")
        ax[i].yaxis.set_major_locator(MaxNLocator(integer=True))
        ax[i].legend(loc="upper left", ncol=2, fontsize=8)
    for label, color in colors.items():
        w = windows(runs[label])
        ax[3].plot([x["t"] for x in w], [x["ttft_p90"] for x in w], color=color, label=f"TTFT p90, {label}")
        ax[4].plot([x["t"] for x in w], [x["itl_mean"] * 1000 for x in w], color=color, label=f"ITL mean, {label}")
    ax[3].axhline(ttft_ms / 1000, color="gray", linestyle="--", label="TTFT target")
    ax[3].set_yscale("log")
    ax[3].set_ylabel("TTFT p90 (s)")
    ax[3].legend(loc="upper left", ncol=2, fontsize=8)
    ax[4].axhline(itl_ms, color="gray", linestyle="--", label="ITL target")
    ax[4].set_ylim(0, itl_ms * 3)
    ax[4].set_ylabel("ITL (ms)")
    ax[4].set_xlabel("time (s); latencies binned by arrival time")
    ax[4].legend(loc="upper left", ncol=2, fontsize=8, title="static-min leaves the chart", title_fontsize=8)
    for a in ax:
        a.axvspan(BURST[0], BURST[1], color="gold", alpha=0.15)
        a.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--profile", type=Path, default=None, help="default: config/profiles/<model>.json")
    p.add_argument("--out", type=Path, default=OUT_DIR / "planner_sim.png")
    p.add_argument("--ttft-ms", type=float, default=2000)
    p.add_argument("--itl-ms", type=float, default=100)
    p.add_argument("--startup-s", type=float, default=15, help="seconds a new worker takes to serve")
    p.add_argument("--make-trace", action="store_true", help="(re)generate the trace file and exit")
    args = p.parse_args(argv)
    if args.make_trace:
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        args.trace.write_text(json.dumps(make_trace()) + "\n")
        print(f"wrote {args.trace}")
        return 0
    trace = json.loads(args.trace.read_text())
    rows = [tuple(r) for r in trace["requests"]]
    profile = Profile.load(args.profile or profile_path("config/profiles/{model}.json", MODEL))
    kw = {"startup_s": args.startup_s, "end_s": trace["duration_s"]}
    runs: dict[str, SimResult] = {}
    for mode in ("sla", "load"):
        runs[mode] = simulate(rows, profile, planner_cfg(mode, profile, args.ttft_ms, args.itl_ms), profile.model,
                              label=mode, **kw)
    runs["static-min"] = simulate(rows, profile, None, profile.model, label="static-min", **kw)
    peak = runs["sla"].summary(1, 1)
    runs["static-peak"] = simulate(rows, profile, None, profile.model, prefill=peak["peak_prefill"],
                                   decode=peak["peak_decode"], label="static-peak", **kw)
    ttft_s, itl_s = args.ttft_ms / 1000, args.itl_ms / 1000
    summaries = [r.summary(ttft_s, itl_s) for r in runs.values()]
    print(f"trace {trace['name']}: {len(rows)} requests over {trace['duration_s']} s; profile {profile.model} "
          f"({profile.device}); targets TTFT {args.ttft_ms:.0f} ms, ITL {args.itl_ms:.0f} ms\n")
    cols = ["label", "finished", "ttft_p50_s", "ttft_p90_s", "itl_mean_s", "ttft_ok", "itl_ok", "worker_seconds",
            "peak_prefill", "peak_decode"]
    print(table(cols, [[s[c] for c in cols] for s in summaries], digits=3))
    sla = summaries[0]
    goals = [goal("SLA planner: requests within TTFT target", sla["ttft_ok"], 0.9),
             goal("SLA planner: requests within ITL target", sla["itl_ok"], 0.9),
             goal("SLA planner worker-seconds / static-peak", sla["worker_seconds"] / summaries[3]["worker_seconds"],
                  1.0, higher_is_better=False)]
    print()
    for g in goals:
        print(goal_line(g))
    plot(args.out, trace, runs, args.ttft_ms, args.itl_ms, profile)
    data = {"machine": machine_info(), "trace": str(args.trace), "profile": profile.to_dict(),
            "targets": {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms}, "startup_s": args.startup_s,
            "summaries": summaries, "goals": goals,
            "runs": {k: {"timeline": r.timeline, "decisions": r.decisions, "windows": windows(r)}
                     for k, r in runs.items()}}
    jpath = write_json(args.out.with_suffix(".json"), data)
    print(f"\nfigure: {args.out}\nnumbers: {jpath}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
