"""`farm status [--json]`: workers by role, queue depths, the processes of the farm started from this state dir,
the models, the batches not yet final and the planner's last decisions, as JSON or as text."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from farm.config import FarmConfig, redact_url
from farm.protocol import ROLES, queue_depths, queue_name
from farm.supervisor.flower_login import FLOWER_LOGIN_FILE


def collect_status(cfg: FarmConfig) -> dict[str, Any]:
    """Everything `farm status` shows, as one JSON-able object."""
    from farm.cluster import registry
    from farm.infra.redis_client import connect
    from farm.models.directories import is_prepared, model_dir
    from farm.supervisor import read_state, recorded_processes

    state = read_state(cfg) or {}
    out: dict[str, Any] = {
        "workers": {}, "queues": {}, "processes": [], "models": [],
        "redis": {"url": redact_url(cfg.redis.url), "ok": False, "error": None},
        "state_dir": str(cfg.state_path), "urls": state.get("urls", {}),
    }
    for m in cfg.models:
        out["models"].append({
            "name": m.name, "default": m.name == cfg.default_model, "source": m.source or m.path,
            "dir": str(model_dir(cfg, m)), "prepared": is_prepared(cfg, m), "max_model_len": m.max_model_len,
        })
    for p in recorded_processes(cfg):
        out["processes"].append({"name": p.name, "role": p.role, "model": p.model, "pid": p.pid,
                                 "alive": p.alive(), "log": p.log})
    models = [m.name for m in cfg.models]
    for name in models:
        out["workers"][name] = {role: [] for role in ROLES}
    out["planner"] = None
    out["batches"] = []
    r = connect(cfg.redis, timeout=3)
    try:
        workers = registry.live_workers(r)
        out["redis"]["ok"] = True
        queues: list[str] = []
        for w in workers:
            roles = out["workers"].setdefault(w.model, {role: [] for role in ROLES})
            roles.setdefault(w.role, []).append(asdict(w))
            if w.model not in models:
                models.append(w.model)
            queues += w.queues
        for name in models:
            queues += [queue_name(name, kind) for kind in ("prefill", "decode", "generate")]
        queues = list(dict.fromkeys(queues))
        out["queues"] = dict(zip(queues, queue_depths(r, queues), strict=True))
        from farm.planner.cli import status_section

        out["planner"] = status_section(r)
        out["batches"] = batch_section(r)
    except Exception as e:  # noqa: BLE001 - any Redis trouble is reported, not raised
        out["redis"]["error"] = f"{type(e).__name__}: {e}"
    finally:
        r.close()
    return out


def batch_section(r) -> list[dict[str, Any]]:
    """The batches not yet final: id, status, endpoint, request counts (from farm.batch.store)."""
    from farm.batch.store import BatchStore

    store = BatchStore(r)
    out = []
    for bid in sorted(store.active_ids()):
        b = store.get(bid)
        if b:
            out.append({"id": bid, "status": b.get("status"), "endpoint": b.get("endpoint"),
                        "request_counts": b.get("request_counts") or {}})
    return out


def print_status(st: dict[str, Any]) -> None:
    red = st["redis"]
    print(f"Redis    {red['url']}  " + ("ok" if red["ok"] else f"NOT REACHABLE ({red['error']})"))
    for key, label in (("api", "API"), ("flower", "Flower")):
        if st["urls"].get(key):
            login = f"  (login: FARM_FLOWER_AUTH, or {st['state_dir']}/{FLOWER_LOGIN_FILE})" if key == "flower" else ""
            print(f"{label:<8} {st['urls'][key]}{login}")
    print(f"State    {st['state_dir']}")
    print("\nModels")
    for m in st["models"]:
        flags = " (default)" if m["default"] else ""
        print(f"  {m['name']}{flags}  {'prepared' if m['prepared'] else 'NOT prepared'}  {m['dir']}")
    print("\nWorkers")
    for model, roles in st["workers"].items():
        parts = []
        for role, ws in roles.items():
            names = ", ".join(w["worker_id"] for w in ws)
            parts.append(f"{role}: {len(ws)}" + (f" ({names})" if names else ""))
        print(f"  {model}  " + "  ".join(parts))
    print("\nQueues")
    if not st["queues"]:
        print("  (unknown)" if not red["ok"] else "  (none)")
    width = max((len(q) for q in st["queues"]), default=0)
    for q, n in st["queues"].items():
        print(f"  {q:<{width}}  {n}")
    print("\nProcesses")
    if not st["processes"]:
        print("  (none recorded: no farm started from this state dir)")
    else:
        width = max(len(p["name"]) for p in st["processes"])
        for p in st["processes"]:
            state = "running" if p["alive"] else "DEAD"
            print(f"  {p['name']:<{width}}  {p['role']:<7} pid {p['pid']:<8} {state:<8} {p['log']}")
    if red["ok"]:
        from farm.batch.cli import progress_line
        from farm.planner.cli import print_status_section

        print("\nBatches (not yet final)")
        for b in st.get("batches") or []:
            print(f"  {b['id']}  {b['endpoint']}  {progress_line(b)}")
        if not st.get("batches"):
            print("  (none)")
        print_status_section(st.get("planner"))


def cmd_status(cfg: FarmConfig, args: argparse.Namespace) -> int:
    st = collect_status(cfg)
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print_status(st)
    return 0 if st["redis"]["ok"] else 1
