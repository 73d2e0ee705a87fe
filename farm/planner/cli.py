"""`farm planner ...`: profile an engine, run the planner, and the planner lines of `farm status`.

    farm planner profile --out config/profiles/<model>.json [--model NAME] [--isl 128,512,2048] ...
    farm planner run [--mode load|sla] [--dry-run] [--actuator local|kubernetes] [--once] [--planner-config F]

`run` with the local actuator starts the farm itself (the supervisor is the actuator) and plans it until
Ctrl-C; with the Kubernetes actuator, or in dry run, it plans a farm that runs elsewhere (same Redis).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from farm.config import FarmConfig

if TYPE_CHECKING:
    from farm.config.planner import PlannerConfig
    from farm.planner.planner import Planner


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def cmd_profile(cfg: FarmConfig, args: argparse.Namespace) -> int:
    from farm.planner.profile import profile_model

    model = args.model or cfg.default_model
    print(f"profiling {model} (isl {args.isl}, batch {args.batch}); this takes a few minutes", flush=True)
    prof = profile_model(cfg, model, isls=_ints(args.isl), batches=_ints(args.batch),
                         decode_context=args.decode_context, decode_tokens=args.decode_tokens, reps=args.reps,
                         passes=args.passes, progress=lambda msg: print(f"  {msg}", flush=True))
    path = prof.save(args.out)
    print(f"wrote {path}")
    return 0


def _planner_cfg(cfg: FarmConfig, args: argparse.Namespace):
    from farm.config.planner import planner_config

    pcfg = planner_config(cfg.planner, args.planner_config)
    updates: dict[str, Any] = {}
    for flag in ("mode", "actuator"):
        if getattr(args, flag):
            updates[flag] = getattr(args, flag)
    if args.dry_run:
        updates["dry_run"] = True
    if args.interval:
        updates["interval_s"] = args.interval
    return pcfg.model_copy(update=updates)


def cmd_run(cfg: FarmConfig, args: argparse.Namespace) -> int:
    from farm.planner.actuators import KubernetesActuator

    logging.basicConfig(level=logging.WARNING if args.once else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        pcfg = _planner_cfg(cfg, args)
        if pcfg.mode == "sla":
            from farm.planner.planner import profile_path

            for m in pcfg.models or [cfg.default_model]:
                if not profile_path(pcfg.sla.profile, m).exists():
                    raise FileNotFoundError(f"SLA mode needs the engine profile {profile_path(pcfg.sla.profile, m)}"
                                            f": run `farm planner profile --model {m} --out ...`")
    except (OSError, ValueError) as e:
        print(f"farm planner: {e}", file=sys.stderr)
        return 2
    if pcfg.actuator == "local" and not pcfg.dry_run:
        return _run_with_local_farm(cfg, args, pcfg)
    stop = threading.Event()

    def _interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # SIGINT too: a process started in the background by a shell inherits an ignored SIGINT (issue 17)
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        actuator = None if pcfg.dry_run else KubernetesActuator(pcfg.kubernetes)
        planner = _planner(cfg, actuator, pcfg, args)
        if args.once:
            for d in planner.step():
                print(d.line())
            return 0
        while not stop.is_set():
            t0 = time.monotonic()
            planner.step()
            stop.wait(max(0.0, pcfg.interval_s - (time.monotonic() - t0)))
        return 0
    except KeyboardInterrupt:
        print("\nplanner: stopping", file=sys.stderr)
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _planner(cfg: FarmConfig, actuator: Any, pcfg: PlannerConfig, args: argparse.Namespace) -> Planner:
    """The planner over the farm's Redis, with its metrics served when asked."""
    from farm.infra.redis_client import connect
    from farm.planner.planner import Planner

    planner = Planner.for_farm(cfg, connect(cfg.redis, timeout=2.0), actuator, pcfg)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)  # farm_planner_* for Prometheus
    return planner


def _run_with_local_farm(cfg: FarmConfig, args: argparse.Namespace, pcfg: PlannerConfig) -> int:
    """The farm `farm up` would start (batch drivers included), supervised by the same loop (restarts, signals),
    with the planner's step as the loop's tick every `interval_s`."""
    from farm.planner.actuators import LocalActuator
    from farm.supervisor import Farm

    farm = Farm.from_flags(cfg, args, pcfg.models or None)
    planner: Planner | None = None

    def step() -> bool:
        nonlocal planner
        if planner is None:  # farm.cfg carries the managed Redis's password once the farm started
            planner = _planner(farm.cfg, LocalActuator(farm), pcfg, args)
            print(f"planning the farm ({pcfg.mode}); Ctrl-C stops both", flush=True)
        decisions = planner.step()
        if args.once:
            for d in decisions:
                print(d.line())
            return False
        return True

    return farm.serve(timeout=args.timeout, tick=step, tick_every_s=pcfg.interval_s)


def add_parser(sub) -> None:
    """Register `farm planner` and its subcommands on the main parser's subparsers."""
    p = sub.add_parser("planner", help="scale workers by load or SLA; profile the engine for it")
    psub = p.add_subparsers(dest="planner_command", metavar="SUBCOMMAND", required=True)

    prof = psub.add_parser("profile", help="measure prefill TTFT by prompt length and decode ITL by batch size")
    prof.add_argument("--out", required=True, metavar="PATH", help="profile JSON to write")
    prof.add_argument("--model", help="model name from the config (default: default_model)")
    prof.add_argument("--isl", default="128,512,2048", help="prompt lengths (default: 128,512,2048)")
    prof.add_argument("--batch", default="1,4,8,16,32", help="decode batch sizes (default: 1,4,8,16,32)")
    prof.add_argument("--decode-context", type=int, default=256, help="prompt tokens of decode runs")
    prof.add_argument("--decode-tokens", type=int, default=48, help="tokens generated per decode run")
    prof.add_argument("--reps", type=int, default=3, help="prefill repetitions per length (fastest kept)")
    prof.add_argument("--passes", type=int, default=3, help="measure the whole grid this often, keep the "
                      "fastest per point (a shared machine's busy spells only add time; default: 3)")
    prof.set_defaults(func=cmd_profile)

    run = psub.add_parser("run", help="plan replica counts every interval (local: also runs the farm)")
    run.add_argument("--planner-config", metavar="PATH", help="YAML with a `planner:` section")
    run.add_argument("--mode", choices=("load", "sla"))
    run.add_argument("--actuator", choices=("local", "kubernetes"))
    run.add_argument("--dry-run", action="store_true", help="log and publish decisions, change nothing")
    run.add_argument("--interval", type=float, metavar="S", help="seconds between steps")
    run.add_argument("--once", action="store_true", help="one step, print the decisions, exit")
    run.add_argument("--metrics-port", type=int, metavar="P", help="serve /metrics on P (of --metrics-host)")
    run.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                     help="address the metrics port listens on (0.0.0.0 in a pod, for Prometheus)")
    run.add_argument("--prefill-workers", type=int, metavar="N")
    run.add_argument("--decode-workers", type=int, metavar="N")
    run.add_argument("--workers", type=int, metavar="N", help="aggregated workers")
    run.add_argument("--port", type=int, metavar="P", help="API port (local actuator)")
    run.add_argument("--no-flower", action="store_true")
    run.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds to wait for health")
    run.set_defaults(func=cmd_run)


# -- `farm status` --------------------------------------------------------------------------------------------
def status_section(r) -> dict[str, Any] | None:
    """The planner's last published state (for `farm status --json`)."""
    from farm.planner.planner import read_state

    return read_state(r)


def print_status_section(state: dict[str, Any] | None) -> None:
    print("\nPlanner")
    if not state:
        print("  (no planner has run on this Redis)")
        return
    age = time.time() - float(state.get("updated") or 0)
    how = "dry run" if state.get("dry_run") else f"actuator {state.get('actuator')}"
    print(f"  {state.get('mode')} mode, {how}, last step {age:.0f}s ago")
    for model, roles in (state.get("models") or {}).items():
        for role, d in roles.items():
            held = f" [{d['held']}]" if d.get("held") else ""
            err = f" ERROR: {d['error']}" if d.get("error") else ""
            print(f"  {model} {role:<7} {d['action']:<10} current {d['current']} ready {d['ready']} desired "
                  f"{d['desired']} target {d['target']}: {d['reason']}{held}{err}")
