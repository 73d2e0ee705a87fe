"""Real farms for the security tests: the API as `farm up` serves it (farm.supervisor's own gunicorn
command), optionally with workers, on a test Redis; every attack goes over real sockets."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import yaml

from farm.config import load_config
from farm.supervisor import Farm
from tests.conftest import free_port

MODEL = "SmolLM2-135M-Instruct"


@contextmanager
def real_farm(redis_url: str, tmp: Path, model_dir: Path, *, both: int = 0, env: dict[str, str] | None = None,
              config: dict[str, Any] | None = None, max_model_len: int = 4096,
              batch_drivers: int = 0) -> Iterator[Farm]:
    """A started, healthy farm (the API, `both` aggregated workers and `batch_drivers` batch drivers) serving one
    model from `model_dir`; `config` is merged over the farm's configuration, `env` is added to its processes'
    environment."""
    tmp.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"models": [{"name": MODEL, "path": str(model_dir), "max_model_len": max_model_len}],
                            "api": {"port": free_port()}, "flower": {"enabled": False},
                            "engine": {"kv_cache_mb": 64, "kv_tiers": {"host_mb": 0, "disk_mb": 0}}}
    for section, values in (config or {}).items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    path = tmp / "farm.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path, environ={"FARM_REDIS__URL": redis_url, "FARM_STATE_DIR": str(tmp / "state")})
    child_env = {"FARM_API_KEYS": "", "FARM_METRICS_TOKEN": "", "FARM_REDIS_PASSWORD": "",
                 "FARM_SECRET": os.environ["FARM_SECRET"], **(env or {})}
    farm = Farm(cfg, prefill=0, decode=0, both=both, batch_drivers=batch_drivers, flower=False, prepare=False,
                grace_s=10, env=child_env)
    with farm.running(240):
        yield farm


def base_url(farm: Farm) -> str:
    return f"http://127.0.0.1:{farm.api_port}"


def api_process(farm: Farm) -> psutil.Process:
    """The API's serving process (gunicorn's worker, where requests run)."""
    [proc] = [p for p in farm.procs if p.role == "api"]
    master = psutil.Process(proc.pid)
    children = master.children()
    return children[0] if children else master
