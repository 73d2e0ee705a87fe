#!/usr/bin/env python3
"""Container health checks of the Inference Farm images (installed as `farm-healthcheck`).

    farm-healthcheck api        GET http://127.0.0.1:$FARM_API__PORT/health/live answers 200 (the API serves)
    farm-healthcheck api-ready  GET .../health/ready answers 200 (the API serves and reaches Redis)
    farm-healthcheck worker     the worker's heartbeat key `farm:alive:<worker id>` exists in Redis

The image's HEALTHCHECK is liveness (`api`): a Redis outage must not mark every API container unhealthy (an
orchestrator that restarts unhealthy containers would drop every stream in flight for nothing).

A worker refreshes its heartbeat key every 2 s with a TTL of 6 s (farm/cluster/registry.py), and only once its
model is loaded and it consumes its queues: the key is missing while the model loads, after the worker
stopped, and when its heartbeat thread hangs. The worker id is `$FARM_WORKER_ID` when set, otherwise
it is worked out from the running `tasks.worker` process (`$FARM_WORKER_PID`, default the first one,
PID 1 in a container) exactly as tasks/worker.py does (`--name`, `<name>@<hostname>` when the name
has no `@`, default `<role>@<hostname>`).

Exit status 0 = healthy, 1 = unhealthy (Docker's HEALTHCHECK convention).
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path


def check_api(path: str = "/health/live") -> int:
    port = os.environ.get("FARM_API__PORT", "8080")
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            ok = resp.status == 200
    except (urllib.error.URLError, OSError) as e:
        print(f"{url}: {e}")
        return 1
    print(f"{url}: {'ok' if ok else 'unhealthy'}")
    return 0 if ok else 1


def _worker_argv() -> list[str] | None:
    """The argv of this container's `python -m tasks.worker` process: PID 1 unless an init runs
    (then the first such process), or the process $FARM_WORKER_PID names. With setproctitle installed (vLLM
    brings it), Celery rewrites the command line as "[celeryd: <node>:MainProcess] -active- (<its argv>)": the
    options are read from the parentheses."""
    pid = os.environ.get("FARM_WORKER_PID")
    procs = [Path("/proc") / pid] if pid else sorted(Path("/proc").glob("[0-9]*"), key=lambda p: int(p.name))
    for proc in procs:
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if "tasks.worker" in args:
            return args[args.index("tasks.worker") + 1:]
        title = " ".join(args)
        if title.startswith("[celeryd:") and "(" in title and "--role" in title:
            return title[title.index("(") + 1:title.rindex(")") if title.endswith(")") else None].split()
    return None


def worker_id() -> str:
    wid = os.environ.get("FARM_WORKER_ID", "")
    if not wid:
        args = _worker_argv() or []
        opts = {a: b for a, b in zip(args, args[1:], strict=False) if a.startswith("--")}
        role = opts.get("--role", "both")
        wid = opts.get("--name") or f"{role}@{socket.gethostname()}"
    if "@" not in wid:
        wid = f"{wid}@{socket.gethostname()}"
    return wid


def check_worker() -> int:
    import redis

    from farm.config import load_config
    from farm.infra.redis_client import connect

    wid = worker_id()
    r = connect(load_config().redis, timeout=3)  # FARM_REDIS__URL / FARM_REDIS__HA__* from the environment
    try:
        alive = bool(r.exists(f"farm:alive:{wid}"))
    except redis.RedisError as e:
        print(f"redis unreachable: {e}")
        return 1
    finally:
        r.close()
    print(f"worker {wid}: {'alive' if alive else 'no heartbeat'}")
    return 0 if alive else 1


CHECKS = {"api": lambda: check_api("/health/live"), "api-ready": lambda: check_api("/health/ready"),
          "worker": lambda: check_worker()}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(f"usage: farm-healthcheck {'|'.join(CHECKS)}", file=sys.stderr)
        return 2
    return CHECKS[argv[0]]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
