"""A small farm of real processes to break on purpose: its own redis-server (AOF on, restartable on the
same port and data dir), Celery worker processes, a Gateway in this process. Shared by tests/chaos and
bench/chaos."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis
import yaml

from farm.cluster import registry
from farm.config import FarmConfig, load_config
from farm.gateway import Gateway
from farm.infra.orphans import die_with_parent
from farm.protocol import DeltaEvent, Event, GenerationRequest, SamplingParams
from tests.conftest import free_port
from tests.procs import ROOT, WorkerProc, wait_registered

MODEL = "SmolLM2-135M-Instruct"


class Redis:
    """redis-server with AOF in `data_dir`; `stop()` (SIGTERM flushes the AOF) and `start()` again."""

    def __init__(self, data_dir: Path, port: int | None = None):
        self.dir, self.port = data_dir, port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 15) -> Redis:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.dir), "--save", "", "--appendonly", "yes", "--daemonize", "no",
             "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(signal.SIGTERM))
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
            except redis.BusyLoadingError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)


def farm_env(redis_url: str, tmp: Path, model_dir: Path, **overrides: str) -> dict[str, str]:
    """Environment of the farm's processes: this Redis, a state dir, the model at `model_dir`."""
    cfg_path = tmp / "chaos.yaml"
    cfg_path.write_text(yaml.safe_dump({"models": [{"name": MODEL, "path": str(model_dir), "max_model_len": 2048}]}))
    env = {
        "FARM_REDIS__URL": redis_url, "FARM_STATE_DIR": str(tmp / "state"), "FARM_CONFIG": str(cfg_path),
        "FARM_SECRET": os.environ.get("FARM_SECRET", "test-secret-not-for-production"),
        "FARM_DISAGGREGATION__MODE": "always", "FARM_ROUTER__PLACEMENT_TIMEOUT_S": "1",
        "FARM_RELIABILITY__LEASE_TTL_S": "3", "FARM_ENGINE__KV_CACHE_MB": "64",
        "FARM_ENGINE__KV_TIERS__HOST_MB": "0", "FARM_ENGINE__KV_TIERS__DISK_MB": "0",
        "FARM_SEMANTIC__ENABLED": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1", "FARM_ENGINE__TORCH_THREADS": "1",
    }
    env.update(overrides)
    return env


class ChaosFarm:
    """Redis + named workers + a Gateway; every process is real and can be killed."""

    def __init__(self, tmp: Path, model_dir: Path, **overrides: str):
        self.tmp = tmp
        self.redis = Redis(tmp / "redis").start()
        self.env = farm_env(self.redis.url, tmp, model_dir, **overrides)
        self.cfg: FarmConfig = load_config(environ=self.env)
        self.r = redis.Redis.from_url(self.redis.url)
        self.workers: dict[str, WorkerProc] = {}
        self.roles: dict[str, str] = {}
        self._gw: Gateway | None = None

    @property
    def gw(self) -> Gateway:
        if self._gw is None:
            self._gw = Gateway(self.cfg, self.r)
        return self._gw

    def start_workers(self, *specs: tuple[str, str], timeout: float = 180) -> list[WorkerProc]:
        """Start (role, name) workers and wait until they are registered."""
        procs = []
        for role, name in specs:
            p = WorkerProc(self.env, role, name, self.tmp)
            self.workers[name] = p
            self.roles[name] = role
            procs.append(p)
        wait_registered(self.r, procs, timeout)
        return procs

    def restart_exited(self, timeout: float = 180) -> list[str]:
        """What `farm up`'s supervisor (or Kubernetes) does: a worker process that exited on its own is
        started again under the same name. Returns the names restarted."""
        dead = [(self.roles[n], n) for n, p in self.workers.items() if p.proc.poll() is not None
                and p.proc.returncode != -9]  # not the ones a test killed with SIGKILL
        if dead:
            self.start_workers(*dead, timeout=timeout)
        return [n for _, n in dead]

    def heal(self, timeout: float = 120) -> list[str]:
        """Until every worker this farm started (and did not SIGKILL) is running and in routing again:
        restart those that exited (a draining worker leaves routing first, then exits)."""
        restarted: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            restarted += self.restart_exited()
            wanted = {p.name for p in self.workers.values() if p.proc.returncode != -9}
            if wanted <= self.live():
                return restarted
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not back in routing: {sorted(wanted - self.live())}")
            time.sleep(0.5)

    def worker(self, worker_id: str) -> WorkerProc:
        return next(p for p in self.workers.values() if p.name == worker_id)

    def live(self) -> set[str]:
        return {w.worker_id for w in registry.live_workers(self.r)}

    def stats(self, worker_id: str) -> dict[str, Any]:
        return json.loads(self.r.get(registry.alive_key(worker_id)) or "{}")

    def request(self, prompt_ids: list[int], **sampling: Any) -> GenerationRequest:
        return GenerationRequest(uuid.uuid4().hex, MODEL, list(prompt_ids),
                                 SamplingParams(**{"max_tokens": 64, "temperature": 0, **sampling}))

    def stop(self) -> None:
        if self._gw is not None:
            self._gw.stop()
        for p in self.workers.values():
            p.stop(timeout=20)
        self.redis.stop()


def reader_process(env: dict[str, str], req: GenerationRequest) -> subprocess.Popen:
    """A process that submits `req` through a Gateway and reads its stream, as an API process does."""
    code = ("import json,sys\n"
            "from farm.config import get_config\nfrom farm.gateway import Gateway\n"
            "from farm.protocol import GenerationRequest\n"
            "from farm.infra.redis_client import connect\ncfg=get_config(); r=connect(cfg.redis)\n"
            "sub=Gateway(cfg,r).submit(GenerationRequest.from_dict(json.loads(sys.argv[1])))\n"
            "for ev in sub.events():\n    print(ev.type, flush=True)\n")
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(req.to_dict())], cwd=ROOT,
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def kill(proc: subprocess.Popen | WorkerProc) -> None:
    """kill -9."""
    p = proc.proc if isinstance(proc, WorkerProc) else proc
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
        p.wait(10)


def collect(sub, timeout: float = 120) -> tuple[list[Event], str]:
    events = list(sub.events(first_timeout_s=timeout, idle_timeout_s=timeout))
    return events, "".join(e.text for e in events if isinstance(e, DeltaEvent))


def per_request_keys_without_ttl(r: redis.Redis) -> list[str]:
    """Per-request keys (streams, cancels, leases, claims) that would never expire."""
    out = []
    for pattern in ("farm:out:*", "farm:cancel:*", "farm:lease:*", "farm:claim:*"):
        for k in r.scan_iter(match=pattern, count=1000):
            if r.ttl(k) == -1:
                out.append(k.decode())
    return out


def wait_all_blocks_free(r: redis.Redis, timeout: float = 20) -> tuple[bool, dict[str, dict[str, Any]]]:
    """Wait until every live worker reports nothing running or held and all its KV blocks free."""
    deadline = time.monotonic() + timeout
    while True:
        stats = {w.worker_id: json.loads(r.get(registry.alive_key(w.worker_id)) or "{}")
                 for w in registry.live_workers(r)}
        clean = all(s.get("running") == 0 and s.get("held") == 0 and s.get("blocks_free") == s.get("blocks_total")
                    for s in stats.values())
        if clean or time.monotonic() > deadline:
            return clean, stats
        time.sleep(0.5)
