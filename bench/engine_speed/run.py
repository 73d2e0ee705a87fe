"""bench/engine_speed: the farm's serving path against `vllm serve`, with an engine made nearly free.

    .venv/bin/python -m bench.engine_speed                  # 5 contenders x 2 rounds at 64 and 256 streams
    .venv/bin/python -m bench.engine_speed --all            # and --profile, --api-scale, --admission
    .venv/bin/python -m bench.engine_speed --smoke          # every mode, briefly (a few minutes)

Why: on the real model a CPU decode step costs tens of milliseconds and hides whatever the serving path
around the engine costs. Here the model is SmolLM2's tokenizer and chat template on a tiny random Llama
(model.py: 2 layers, hidden 128, fp32), so a decode step is nearly free, as on a GPU, and the API, Redis,
Celery, the worker's glue and vLLM's own front end are what is left to measure.

Contenders (contenders.py), each started from nothing and stopped before the next, in alternating order
(round 1 A B C D E, round 2 E D C B A, ...), each warmed up first (3 short requests alone, then 4 at once):
`vllm serve`; the farm with one `backend: vllm` worker (semantic layer off); the same with the farm's default
semantic layer on (at the 64-stream level only: what the guards and the semantic cache cost); the farm with
one built-in-engine worker; the built-in engine in this process. Same block size (32), max_model_len 2048,
fp32, KV cache bytes (--kv-mb).

Load (load.py): closed loop, N streams each sending its requests one after another; streamed chat, 128
output tokens, ignore_eos, temperature 0, usage in the stream, distinct prompts. Errors are counted, never
raised; a level with any error is FAILED. Reported per contender and level: wall time, output tok/s, TTFT,
gaps between content chunks, ITL (aiperf's), request latency, tokens per chunk, and CPU by kind of process
(cpu.py) per 1,000 output tokens; then the ratios within the run (report.py) and their goals.

Modes: --profile (py-spy on the farm's API and worker at the largest level, profile.py), --api-scale
(output tok/s per core of one API process, scale.py), --admission (1,000 streams: how many get inside the
engine, admission.py). Writes bench/out/engine_speed.json (smoke: engine_speed-smoke.json).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, alternating, finish, goal, load_average, machine_info, table
from bench.cpu import cpu_by_kind, summary
from bench.engine_speed import admission as adm
from bench.engine_speed import contenders as ct
from bench.engine_speed import load, report, scale
from bench.engine_speed.model import DEFAULT_DIR, describe, make_tiny_model
from bench.engine_speed.profile import Profiler, print_profile
from bench.peers import contenders as pc
from bench.peers import install

API_CORE_GOAL = 20_000.0  # output tok/s per API core at 256 streams
ADMISSION_GOAL = 0.95  # share of the streams inside the engine within the window



@contextlib.contextmanager
def recorded(rec: dict[str, Any]) -> Iterator[None]:
    """Time the block into `rec`; an exception becomes `rec['error']` (the run goes on). Ctrl-C propagates
    (after the contender's own context managers stopped what they started)."""
    t0 = time.monotonic()
    rec["load_average_start"] = load_average()
    try:
        yield
    except Exception as e:  # noqa: BLE001 - one contender failing must not lose the others' numbers
        rec["error"] = f"{type(e).__name__}: {str(e)[:3000]}"
        rec["traceback"] = traceback.format_exc()
        print(f"  !! {rec['contender']} (round {rec['round'] + 1}) failed: {rec['error'][:1500]}", flush=True)
    finally:
        rec["total_s"] = time.monotonic() - t0


def levels_for(name: str, args: argparse.Namespace) -> list[tuple[int, int]]:
    """(streams, requests per stream) the contender runs; the semantic farm only at --semantic-level."""
    pairs = list(zip(args.levels, args.per_stream, strict=True))
    if name == "farm-vllm-semantic":
        pairs = [p for p in pairs if p[0] == args.semantic_level] or [pairs[0]]
    return pairs


def print_level(name: str, streams: int, lv: dict[str, Any]) -> None:
    def f(x: float | None, d: int = 0) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    status = f"FAILED ({lv['errors']} errors {lv['error_kinds']})" if lv["failed"] else "ok"
    print(f"    {name} at {streams} streams: {lv['output_tok_s']:.0f} tok/s over {lv['wall_s']:.1f} s, "
          f"TTFT p50 {f(lv['ttft_p50_ms'])} ms, gap p50 {f(lv['gap_p50_ms'], 1)} ms, ITL p50 {f(lv['itl_p50_ms'], 1)} "
          f"ms, {f(lv['tokens_per_chunk'], 2)} tok/chunk; {status}; CPU s: {summary(lv.get('cpu_s') or {})}",
          flush=True)


def run_main(args: argparse.Namespace, s: pc.Setup) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    top = max(args.levels)
    for rnd, name in alternating(args.contenders, args.rounds):
        rec: dict[str, Any] = {"contender": name, "round": rnd, "levels": {}}
        runs.append(rec)
        print(f"[main] round {rnd + 1}/{args.rounds}: {name}", flush=True)
        with recorded(rec), ct.started(name, s, args.request_timeout) as target:
            rec.update(start_s=target.start_s, commands=target.commands)
            print(f"    started in {target.start_s:.0f} s", flush=True)
            rec["warm_up"] = load.warm_up(target.level)
            if rec["warm_up"]["errors"]:
                print(f"    warm-up errors: {rec['warm_up']}", flush=True)
            for streams, per_stream in levels_for(name, args):
                prof = None
                if args.profile and name in ct.FARMS and streams == top:
                    prof = Profiler(OUT_DIR / "engine_speed-profiles", f"{name}-r{rnd + 1}-{streams}",
                                    args.profile_seconds)
                try:
                    with cpu_by_kind() as cpu:
                        if prof:
                            prof.start()
                        lv = target.level(f"r{rnd}-s{streams}", streams, per_stream, args.max_tokens)
                except BaseException:
                    if prof:
                        prof.stop(kill=True)
                    raise
                if prof:
                    prof.stop()  # lets py-spy finish its seconds if the level was shorter
                lv["cpu_s"] = cpu
                if prof:
                    lv["profile"] = prof.result
                rec["levels"][streams] = lv
                print_level(name, streams, lv)
                if prof:
                    print_profile(name, streams, prof.result)
    return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_speed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="every mode, briefly: one round, tiny levels")
    ap.add_argument("--rounds", type=int, help="rounds in alternating order (default 2, smoke 1)")
    ap.add_argument("--contenders", default=",".join(ct.NAMES), help=f"subset of {ct.NAMES} ('' for none)")
    ap.add_argument("--levels", help="concurrent streams per level (default 64,256; smoke 4)")
    ap.add_argument("--per-stream", help="requests per stream at each level (default 6,3; smoke 2)")
    ap.add_argument("--max-tokens", type=int, help="output tokens per request (default 128, smoke 16)")
    ap.add_argument("--semantic-level", type=int, help="the one level of farm-vllm-semantic (default: the first)")
    ap.add_argument("--kv-mb", type=int, default=1024, help="KV cache per engine (MiB), every contender")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                    help="vLLM --enforce-eager and the built-in engine's enforce_eager for every contender "
                         "(default: off; on with --smoke, for faster starts)")
    ap.add_argument("--request-timeout", type=float, default=900.0, help="per request, seconds")
    ap.add_argument("--all", action="store_true", help="also --profile, --api-scale and --admission")
    ap.add_argument("--profile", action="store_true", help="py-spy on the farm contenders at the largest level")
    ap.add_argument("--profile-seconds", type=float, help="py-spy duration (default 10, smoke 3)")
    ap.add_argument("--api-scale", action="store_true", help="tok/s per API core at --scale-levels")
    ap.add_argument("--scale-levels", help="streams (default 1,64,256,1024; smoke 1,16)")
    ap.add_argument("--scale-seconds", type=float, help="send requests for this long per level (default 25, smoke 5)")
    ap.add_argument("--admission", action="store_true", help="many streams at once: how many get inside the engine")
    ap.add_argument("--admission-streams", type=int, help="default 1000, smoke 50")
    ap.add_argument("--admission-seconds", type=float, help="default 30, smoke 10")
    ap.add_argument("--admission-window", type=float, help="goal window (default 20, smoke 8)")
    ap.add_argument("--admission-max-tokens", type=int, default=1024)
    ap.add_argument("--admission-contenders", default="farm-vllm,vllm-serve")
    ap.add_argument("--admission-again", action=argparse.BooleanOptionalAction, default=True,
                    help="send the same burst a second time on the same server (cold vs warm admission)")
    ap.add_argument("--model-dir", default=str(DEFAULT_DIR), help="where the tiny model is written (rebuilt each run)")
    ap.add_argument("--out", help="JSON path (default bench/out/engine_speed.json, smoke: engine_speed-smoke.json)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    for key, full, quick in (("rounds", 2, 1), ("levels", "64,256", "4"), ("per_stream", "6,3", "2"),
                             ("max_tokens", 128, 16), ("profile_seconds", 10.0, 3.0),
                             ("scale_levels", "1,64,256,1024", "1,16"), ("scale_seconds", 25.0, 5.0),
                             ("admission_streams", 1000, 50), ("admission_seconds", 30.0, 10.0),
                             ("admission_window", 20.0, 8.0), ("eager", False, True)):
        if getattr(args, key) is None:
            setattr(args, key, quick if smoke else full)
    if smoke or args.all:
        args.profile = args.api_scale = args.admission = True
    args.contenders = [x for x in args.contenders.split(",") if x]
    unknown = sorted(set(args.contenders) - set(ct.NAMES))
    if unknown:
        ap.error(f"unknown contenders {unknown}; known: {ct.NAMES}")
    args.levels = [int(x) for x in str(args.levels).split(",") if x]
    args.per_stream = [int(x) for x in str(args.per_stream).split(",") if x]
    if len(args.per_stream) == 1:
        args.per_stream *= len(args.levels)
    if len(args.per_stream) != len(args.levels):
        ap.error("--per-stream needs one value, or one per level")
    args.semantic_level = args.semantic_level or args.levels[0]
    args.scale_levels = [int(x) for x in str(args.scale_levels).split(",") if x]
    args.admission_contenders = tuple(x for x in args.admission_contenders.split(",") if x)
    args.out = args.out or str(OUT_DIR / ("engine_speed-smoke.json" if smoke else "engine_speed.json"))
    return args


def _interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM/SIGHUP raise KeyboardInterrupt, so every contender's context manager stops what it
    started (vllm serve runs in its own session: a plain SIGTERM would leave it running). SIGINT gets its
    default handler back even when the shell started this process with it ignored (a background job)."""
    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _interrupt_on_signals()
    t_run = time.monotonic()
    command = f"{shlex.quote(sys.executable)} -m bench.engine_speed {' '.join(map(shlex.quote, sys.argv[1:]))}"
    info = machine_info()
    print(f"command: {command}\ndate: {info['date_utc']}; {info['platform']}; python {info['python']}; "
          f"cores {info['cpu_affinity']}/{info['cpu_count']}; torch {info.get('torch')} "
          f"({info.get('torch_threads')} threads); load average {info['load_average']}", flush=True)
    cores = info["cpu_affinity"] or 1
    if info["load_average"] and info["load_average"][0] > 0.5 * cores:
        print(f"WARNING: load average {info['load_average']} on {cores} cores: something else is running; "
              "the numbers will be noisy (ratios within this run compare like with like only if it stays even)")
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")  # as bench/peers/procs.py: vLLM 0.31's AOT cache bug
    t0 = time.monotonic()
    mdir = make_tiny_model(Path(args.model_dir))
    print(f"tiny model written to {mdir} in {time.monotonic() - t0:.1f} s", flush=True)
    logs = install.PEERS_DIR / "logs" / f"engine_speed-{time.strftime('%Y%m%d-%H%M%S')}"
    s = pc.Setup(mdir, logs, kv_bytes=args.kv_mb * 2**20, block_size=32, max_model_len=2048,
                 enforce_eager=args.eager)
    print(f"logs of vllm serve in {logs}; rounds {args.rounds}; levels {args.levels} x {args.per_stream} requests "
          f"per stream; {args.max_tokens} output tokens; eager {args.eager}", flush=True)
    phases: dict[str, float] = {}
    runs: list[dict[str, Any]] = []
    scale_res: dict[str, Any] = {}
    adm_res: dict[str, Any] = {}
    if args.contenders:
        t0 = time.monotonic()
        runs = run_main(args, s)
        phases["main"] = time.monotonic() - t0
    if args.api_scale:
        t0 = time.monotonic()
        scale_res = scale.run_scale(s, args.scale_levels, args.scale_seconds, args.max_tokens, args.request_timeout)
        phases["api-scale"] = time.monotonic() - t0
    if args.admission:
        t0 = time.monotonic()
        adm_res = adm.run_admission(s, args.admission_streams, args.admission_max_tokens, args.admission_seconds,
                                    args.admission_window, args.admission_contenders, args.admission_again)
        phases["admission"] = time.monotonic() - t0
    phases["total"] = time.monotonic() - t_run

    goals: list[dict[str, Any]] = []
    missing: list[str] = []
    agg = report.levels_of(runs)
    ratios: list[dict[str, Any]] = []
    if runs:
        print(f"\nServing path, tiny model: {args.max_tokens} output tokens, greedy, ignore_eos, streamed; medians "
              f"over {args.rounds} round(s)")
        print(report.main_table(agg))
        print()
        print(report.cpu_table(agg))
        errs = report.error_table(agg)
        if errs:
            print("\nErrors\n" + errs)
        ratios = report.ratios(agg, args.levels, args.semantic_level)
        if ratios:
            print()
            print(report.ratio_table(ratios))
        goals += report.goals_of(ratios)
        missing += [g for g in report.expected_goals(args.levels) if g not in {r["name"] for r in ratios}]
    failed = [r for r in runs if r.get("error")]
    if failed:
        print()
        print(table(["contender", "round", "error"],
                    [[r["contender"], r["round"] + 1, r["error"].splitlines()[0][:160]] for r in failed]))
    if scale_res:
        print("\nAPI scale: output tokens per second per core of the API process (its own CPU only)")
        print(scale.scale_table(scale_res))
        goal_streams = 256 if 256 in args.scale_levels else max(args.scale_levels)
        lv = (scale_res.get("farm") or {}).get("levels", {}).get(goal_streams)
        name = f"farm API: output tok/s per API core at {goal_streams} streams"
        if lv and lv.get("tok_s_per_api_core") is not None:
            g = goal(name + (" (level FAILED)" if lv["failed"] else ""), lv["tok_s_per_api_core"], API_CORE_GOAL)
            g["reached"] = g["reached"] and not lv["failed"]
            goals.append(g)
        else:
            missing.append(name)
    if adm_res:
        print(f"\nAdmission: {args.admission_streams} streams at once, {args.admission_max_tokens} tokens each")
        print(adm.admission_table(adm_res))
        for name, rec in adm_res.items():
            for label, r in ((name, rec), (f"{name}, same burst again", rec.get("again") or {})):
                if r.get("samples"):
                    print(f"\n{label}: every 4th sample (one each 0.5 s, or as fast as the client's loop allows)")
                    print(adm.sample_table(r))
        r = adm_res.get("farm-vllm") or {}
        name = f"farm: share of {args.admission_streams} streams inside the engine within {args.admission_window:.0f} s"
        if "share_inside_in_window" in r:
            goals.append(goal(name, r["share_inside_in_window"], ADMISSION_GOAL))
        elif "farm-vllm" in args.admission_contenders:
            missing.append(name)
    print()
    print(table(["phase", "seconds"], [[k, v] for k, v in phases.items()], digits=0))
    for name in missing:
        print(f"goal {name}: not measured (a contender is missing or failed)")
    finish(args.out, {"benchmark": "engine_speed", "command": command, "args": vars(args), "model": describe(mdir),
                      "logs": str(logs), "load_average_end": load_average(), "phases_s": phases, "runs": runs,
                      "ratios": ratios, "api_scale": scale_res, "admission": adm_res, "goals_not_measured": missing},
           goals)
    any_failed = failed or any(lv.get("failed") for r in runs for lv in r.get("levels", {}).values())
    return 1 if any_failed else 0
