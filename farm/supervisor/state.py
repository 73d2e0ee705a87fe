"""The state file (`<state_dir>/farm.json`): what `farm up` started, so `farm status` and `farm down` find it
from another process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from farm.config import (
    FarmConfig,
)
from farm.infra.filemodes import open_private
from farm.supervisor.procs import (
    API_GRACE_S,
    FLOWER_GRACE_S,
    REDIS_GRACE_S,
    Proc,
    _pid_alive,
    stop_ordered,
)

STATE_FILE = "farm.json"
RESOLVED_CONFIG = "config.resolved.yaml"


def state_file(cfg: FarmConfig) -> Path:
    return cfg.state_path / STATE_FILE


def read_state(cfg: FarmConfig) -> dict[str, Any] | None:
    """farm.json of this state dir, or None when there is none (or it is unreadable)."""
    path = state_file(cfg)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def recorded_processes(cfg: FarmConfig) -> list[Proc]:
    state = read_state(cfg) or {}
    return [Proc.from_json(d) for d in state.get("processes", [])]


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:  # 0600
        f.write(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _supervisor_alive(state: dict[str, Any]) -> int | None:
    sup = state.get("supervisor") or {}
    pid = int(sup.get("pid") or 0)
    if pid and pid != os.getpid() and _pid_alive(pid, float(sup.get("since_boot") or 0.0)):
        return pid
    return None


def stop_from_state_file(cfg: FarmConfig, grace_s: float = 60.0) -> list[str]:
    """`farm down`: stop the farm recorded in `<state>/farm.json`; returns the names that were running.

    A foreground supervisor still running in another shell gets SIGTERM and stops its own children
    (in order); whatever is left after that, or of a detached farm, is stopped here in the same order.
    """
    state = read_state(cfg)
    if state is None:
        return []
    procs = [Proc.from_json(d) for d in state.get("processes", [])]
    running = [p.name for p in procs if p.alive()]
    sup = _supervisor_alive(state)
    if sup is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(sup, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + API_GRACE_S + FLOWER_GRACE_S + REDIS_GRACE_S
        while time.monotonic() < deadline and _pid_alive(sup):
            time.sleep(0.1)
    stop_ordered([p for p in procs if p.alive()], grace_s)
    with contextlib.suppress(FileNotFoundError):
        state_file(cfg).unlink()
    return running
