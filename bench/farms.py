"""Start a throw-away farm for a benchmark: its own Redis on a free port, its own state dir, the prepared
default model (by path, so nothing is converted again), the real worker processes via farm.supervisor."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from farm.config import get_config, load_config
from farm.models.directories import model_dir
from farm.supervisor import Farm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def scratch_redis(prefix: str) -> Iterator[str]:
    """A throwaway redis-server (no persistence, a temporary directory, a free port) for a bench's own state; its
    URL, until the block ends."""
    from farm.infra import redis_server

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = redis_server.start(port, tmp, tmp / "redis.log", appendonly=False)
    try:
        redis_server.wait_ready(url, proc)
        yield url
    finally:
        redis_server.stop(proc)


def _deep(d: dict[str, Any], u: dict[str, Any]) -> dict[str, Any]:
    for k, v in u.items():
        d[k] = _deep(d.get(k, {}), v) if isinstance(v, dict) else v
    return d


@contextlib.contextmanager
def bench_farm(prefill: int = 0, decode: int = 0, both: int = 0, api: bool = False, batch_drivers: int = 0,
               overrides: dict[str, Any] | None = None, timeout: float = 300) -> Iterator[Farm]:
    """A running farm (started, healthy) that is stopped on exit; `farm.cfg` is its configuration."""
    base = load_config(environ={})
    state = Path(tempfile.mkdtemp(prefix="farm-bench-"))
    prepared = model_dir(base, base.model(base.default_model))
    data = {
        "state_dir": str(state),
        "redis": {"url": f"redis://127.0.0.1:{free_port()}/0", "appendonly": False},
        "api": {"port": free_port()},
        "models": [{"name": base.default_model, "path": str(prepared),
                    "max_model_len": base.model(base.default_model).max_model_len}],
    }
    _deep(data, overrides or {})
    cfg_path = state / "bench.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    old = os.environ.get("FARM_CONFIG")
    os.environ["FARM_CONFIG"] = str(cfg_path)
    get_config.cache_clear()
    cfg = load_config()
    farm = Farm(cfg, prefill=prefill, decode=decode, both=both, api=api, flower=False, grace_s=20,
                batch_drivers=batch_drivers)
    try:
        with farm.running(timeout):
            yield farm
    finally:
        if old is None:
            os.environ.pop("FARM_CONFIG", None)
        else:
            os.environ["FARM_CONFIG"] = old
        get_config.cache_clear()
