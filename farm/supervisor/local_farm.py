"""Run a whole farm on this machine: redis-server, workers, the API (gunicorn) and Flower.

Every component is a separate OS process in its own session (so a Ctrl-C in the terminal reaches
only the supervisor, which then stops the children in order), logging to `<state>/logs/<name>.log`.
`<state>/farm.json` records every process (name, role, pid, command, log) so `farm down` and
`farm status` from another shell find them.

Stop order matters: workers first (SIGTERM = Celery warm shutdown, which finishes the requests in
flight while the API still streams their tokens), then the API, Flower, and Redis last. A second stop
signal kills what is left at once. Children never outlive the process that started them, even when it is
killed with SIGKILL: each gets a parent-death signal (farm.infra.orphans), unless the farm is detached.

    with Farm(cfg, prefill=1, decode=1, port=free_port(), flower=False).running(timeout=300) as farm:
        ..."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from farm.backends.cpu_binding import bind_env
from farm.config import (
    PROJECT_ROOT,
    ConfigError,
    FarmConfig,
    redact_url,
)
from farm.config.api import LOOPBACK_HOSTS
from farm.config.weak_secrets import FLOWER_ENV
from farm.infra import filemodes, logfiles
from farm.infra.orphans import die_with_parent
from farm.infra.secret import farm_secret
from farm.supervisor.flower_login import flower_login
from farm.supervisor.health_checks import HealthChecks
from farm.supervisor.network import (
    _display_host,
    _hostport,
    _port_in_use,
    worker_counts,
)
from farm.supervisor.procs import (
    PARENT_DEATH_SIGNALS,
    WORKER_ROLES,
    FarmError,
    FarmStartError,
    Proc,
    _since_boot,
)
from farm.supervisor.redis_nodes import ManagedRedis
from farm.supervisor.scaling import Scaling
from farm.supervisor.serve import ServeLoop
from farm.supervisor.state import (
    RESOLVED_CONFIG,
    STATE_FILE,
    _supervisor_alive,
    _write_json_atomic,
    read_state,
)

API_APP = "api.app:create_app()"
API_SERVER_CONFIG = "python:api.gunicorn_conf"  # gunicorn settings from the farm config


class Farm(ManagedRedis, HealthChecks, ServeLoop, Scaling):
    """The processes of one farm on this machine.

    Workers run `cfg.default_model` unless `models` names others; `prefill`, `decode` and `both` are
    counts per model (a model with its own `models[].workers` uses those instead); `batch_drivers` processes run OpenAI batches (tasks.batch). `port` overrides
    `api.port`, `flower_port` overrides `flower.port`. Extra
    keyword arguments exist for tests: `api=False` starts no API, `api_app` replaces the gunicorn app,
    `env` adds environment variables for the children, `grace_s` is the workers' shutdown grace.
    """

    @classmethod
    def from_flags(cls, cfg: FarmConfig, args: Any, models: list[str] | None = None) -> Farm:
        """The farm `farm up` and `farm planner run` (local actuator) start from their shared flags
        (--workers / --prefill-workers / --decode-workers, --port, --no-flower, --grace)."""
        counts = worker_counts(cfg, args.prefill_workers, args.decode_workers, args.workers)
        return cls(cfg, prefill=counts["prefill"], decode=counts["decode"], both=counts["both"], port=args.port,
                   flower=cfg.flower.enabled and not args.no_flower, models=models,
                   grace_s=getattr(args, "grace", 60.0), batch_drivers=cfg.workers.batch_drivers)

    def __init__(self, cfg: FarmConfig, prefill: int = 1, decode: int = 1, both: int = 0,
                 port: int | None = None, flower: bool = True, models: list[str] | None = None,
                 batch_drivers: int = 0, *,
                 api: bool = True, flower_port: int | None = None, api_app: str = API_APP,
                 grace_s: float = 60.0, prepare: bool = True, env: dict[str, str] | None = None,
                 hostname: str | None = None):
        self.cfg = cfg
        self.counts = {"prefill": int(prefill), "decode": int(decode), "both": int(both)}
        self.batch_drivers = int(batch_drivers)
        if any(n < 0 for n in [*self.counts.values(), self.batch_drivers]):
            raise ConfigError(f"worker counts must not be negative: {self.counts}")
        self.models = list(models) if models else [cfg.default_model]
        for name in self.models:
            try:
                cfg.model(name)
            except KeyError:
                raise ConfigError(
                    f"unknown model {name!r}; configured: {[m.name for m in cfg.models]}"
                ) from None
        self.api_enabled = api
        self.api_host = cfg.api.host
        self.api_port = int(port or cfg.api.port)
        self.api_app = api_app
        self.flower_enabled = flower
        self.flower_host = cfg.flower.host
        self.flower_port = int(flower_port or cfg.flower.port)
        self.flower_auth = os.environ.get("FARM_FLOWER_AUTH", "")
        if flower and self.flower_host not in LOOPBACK_HOSTS:
            if not self.flower_auth:  # a malformed one is refused when the configuration loads (weak_secrets)
                raise ConfigError(
                    f"flower.host is {self.flower_host!r} (reachable from other machines): set "
                    "FARM_FLOWER_AUTH=user:password for Flower's basic auth, or use --no-flower"
                )
        if api:
            from farm.tenancy.api_keys import open_api_refusal

            if why := open_api_refusal(cfg):
                raise ConfigError(why)
        self.grace_s = grace_s
        self.prepare = prepare
        self.extra_env = dict(env or {})
        self.hostname = hostname or socket.gethostname()
        self.state_dir = cfg.state_path
        if flower and not self.flower_auth:  # a local Flower gets a generated login, never none
            self.flower_auth = flower_login(self.state_dir)
        self.log_dir = self.state_dir / "logs"
        self.state_path = self.state_dir / STATE_FILE
        self.procs: list[Proc] = []
        self.redis_managed = False
        self.supervisor = False  # set by serve() in foreground mode: `farm down` signals this process
        self.bound = True  # children die with this process (parent-death signal); not for `farm up --detach`
        self._stopping = False
        self._starting = False  # serve(): a stop signal interrupts start-up at once
        self._stop_signals = 0  # stop signals received by serve(): the first stops in order, a second kills
        self._kill_announced = False
        self._env: dict[str, str] | None = None
        self._owns_state = False
        self.started_at: float | None = None

    # -- what it runs -----------------------------------------------------------------------------
    @property
    def expected_workers(self) -> list[tuple[str, str, str]]:
        """(process name, role, model) of every worker, numbered per role across models."""
        out = []
        for role in WORKER_ROLES:
            i = 0
            for model in self.models:
                for _ in range(self.model_counts(model)[role]):
                    i += 1
                    out.append((f"{role}-{i}", role, model))
        return out

    def model_counts(self, model: str) -> dict[str, int]:
        """Workers per role for `model`: its own `models[].workers` when set, else the farm's counts."""
        own = self.cfg.model(model).workers
        return own.model_dump() if own is not None else self.counts

    @property
    def _redis_ha_managed(self) -> bool:
        """Sentinels and data nodes of this farm's own: they are restarted, never a reason to stop the farm."""
        return self.redis_managed and self.cfg.redis.ha.enabled

    def worker_id(self, name: str) -> str:
        return f"{name}@{self.hostname}"

    def urls(self) -> dict[str, str | None]:
        return {
            "api": f"http://{_hostport(_display_host(self.api_host), self.api_port)}/v1" if self.api_enabled else None,
            "flower": f"http://{_hostport(_display_host(self.flower_host), self.flower_port)}"
            if self.flower_enabled else None,
            "redis": redact_url(self.cfg.redis.url),
        }

    def processes(self) -> list[dict[str, Any]]:
        return [{"name": p.name, "role": p.role, "model": p.model, "pid": p.pid, "alive": p.alive(),
                 "log": p.log} for p in self.procs]

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    # -- environment and state ---------------------------------------------------------------------
    def _write_resolved_config(self) -> Path:
        """The exact configuration of this farm, as the FARM_CONFIG of every child."""
        data = self.cfg.model_dump(mode="json")
        data["state_dir"] = str(self.state_dir)
        data["api"]["port"] = self.api_port
        data["flower"]["port"] = self.flower_port
        path = self.state_dir / RESOLVED_CONFIG
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        os.chmod(path, 0o600)  # it may hold the Redis password and API key hashes
        path.write_text("# written by `farm up` for its processes; edit config/ or FARM_* instead\n"
                        + yaml.safe_dump(data, sort_keys=False))
        return path

    def flower_env(self) -> dict[str, str]:
        """What Flower's process gets beyond child_env(): its login (Flower reads FLOWER_<OPTION>)."""
        return {"FLOWER_BASIC_AUTH": self.flower_auth}

    def child_env(self) -> dict[str, str]:
        if self._env is None:
            env = {k: v for k, v in os.environ.items()
                   if not (k.startswith("FARM_") and ("__" in k or k in ("FARM_CONFIG", "FARM_STATE_DIR")))
                   and k not in FLOWER_ENV}  # Flower's login goes to Flower alone (flower_command's Proc)
            env["FARM_CONFIG"] = str(self.state_dir / RESOLVED_CONFIG)
            env["PYTHONUNBUFFERED"] = "1"
            env.setdefault("HF_HUB_OFFLINE", "1")
            env.setdefault("TRANSFORMERS_OFFLINE", "1")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
            env.update(self.extra_env)
            # the resolved configuration is the one every child reads (it carries this farm's ports and
            # password), also when the caller's environment names another FARM_CONFIG
            env["FARM_CONFIG"] = str(self.state_dir / RESOLVED_CONFIG)
            self._env = env
        return self._env

    def write_state(self) -> None:
        sup = {"pid": os.getpid(), "since_boot": _since_boot(os.getpid())} if self.supervisor else None
        self._owns_state = True
        _write_json_atomic(self.state_path, {
            "version": 1,
            "state_dir": str(self.state_dir),
            "supervisor": sup,
            "started_at": self.started_at,
            "urls": self.urls(),
            "redis_managed": self.redis_managed,
            "models": self.models,
            "workers": {m: self.model_counts(m) for m in self.models},
            "processes": [p.to_json() for p in self.procs],
        })

    def _check_not_running(self) -> None:
        state = read_state(self.cfg)
        if state is None:
            return
        live = [p for p in (Proc.from_json(d) for d in state.get("processes", [])) if p.alive()]
        sup = _supervisor_alive(state)
        if live or sup:
            names = ", ".join(f"{p.name} (pid {p.pid})" for p in live) or f"supervisor pid {sup}"
            raise FarmError(f"a farm is already running from {self.state_dir}: {names}; run `farm down` first")
        self.state_path.unlink(missing_ok=True)

    # -- starting ---------------------------------------------------------------------------------
    def _rotate_log(self, proc: Proc) -> None:
        """Rotate a child's log past logs.max_mb (farm.infra.logfiles: copy and truncate, the child keeps writing)."""
        if logfiles.rotate(Path(proc.log), int(self.cfg.logs.max_mb * 1024 * 1024), self.cfg.logs.backups):
            proc.log_offset = 0

    def _spawn(self, proc: Proc) -> Proc:
        log = Path(proc.log)
        log.parent.mkdir(parents=True, exist_ok=True)
        self._rotate_log(proc)
        with os.fdopen(filemodes.open_private(log), "ab") as f:  # 0600, as everything under the state dir
            f.write(f"\n=== farm: starting {proc.name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                    f"{' '.join(proc.command)}\n".encode())
            f.flush()
            proc.log_offset = f.tell()
            proc.popen = subprocess.Popen(
                proc.command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=PROJECT_ROOT, env={**self.child_env(), **proc.env}, start_new_session=True,
                umask=filemodes.PRIVATE_UMASK,  # what children write (Redis's AOF, batch files, ...) is private
                preexec_fn=die_with_parent(PARENT_DEATH_SIGNALS.get(proc.role, signal.SIGKILL))
                if self.bound else None,
            )
        proc.pid = proc.popen.pid
        proc.started_at = time.time()
        proc.since_boot = _since_boot(proc.pid)
        if proc not in self.procs:
            self.procs.append(proc)
        return proc

    def _died(self, proc: Proc, during: str) -> FarmStartError:
        rc = proc.returncode
        return FarmStartError(f"{proc.name} exited with status {rc} {during} (log: {proc.log})",
                              proc.name, proc.tail())

    def worker_command(self, role: str, model: str, name: str) -> list[str]:
        return [sys.executable, "-m", "tasks.worker", "--role", role, "--model", model,
                "--name", self.worker_id(name)]

    def api_command(self) -> list[str]:
        """gunicorn with the API's settings module (gevent worker, bind, limits: all from the resolved
        configuration the child reads, which carries this farm's port)."""
        return [sys.executable, "-m", "gunicorn", "-c", API_SERVER_CONFIG, self.api_app]

    def flower_command(self) -> list[str]:
        return [sys.executable, "-m", "celery", "-A", "tasks.celery_app", "flower",
                f"--address={self.flower_host}", f"--port={self.flower_port}"]

    def batch_command(self, name: str) -> list[str]:
        return [sys.executable, "-m", "tasks.batch", "--name", self.worker_id(name)]

    def _start_worker(self, name: str, role: str, model: str) -> Proc:
        return self._spawn(Proc(name, role, self.worker_command(role, model, name), str(self.log_path(name)),
                                model=model, worker_id=self.worker_id(name), env=self._vllm_bind(name, model)))

    def _vllm_bind(self, name: str, model: str) -> dict[str, str]:
        """A vLLM worker's share of this machine's cores (farm.backends.cpu_binding), by its place among
        the farm's vLLM workers (those it starts, then those added by scaling)."""
        if self.cfg.model(model).backend != "vllm":
            return {}
        names = [n for n, _, m in self.expected_workers if self.cfg.model(m).backend == "vllm"]
        names += sorted({p.name for p in self.procs if p.model and self.cfg.model(p.model).backend == "vllm"}
                        - set(names))
        if name not in names:
            names.append(name)
        return bind_env(names.index(name), len(names), self.child_env())

    def start(self) -> Farm:
        """Prepare the models, then start Redis (if needed), workers, the API and Flower."""
        self._check_not_running()
        self.started_at = time.time()
        self._make_state_private()
        filemodes.private_dir(self.log_dir)
        farm_secret(self.cfg)  # create the shared secret once, before children race to create it
        self._protect_managed_redis()
        self._write_resolved_config()
        for host, port, what in ((self.api_host, self.api_port, "API"),
                                 (self.flower_host, self.flower_port, "Flower")):
            if (what == "API" and self.api_enabled) or (what == "Flower" and self.flower_enabled):
                if _port_in_use(host, port):
                    raise FarmError(f"port {port} on {host} (the {what}) is already in use")
        if self.prepare and self.expected_workers:
            from farm.models.directories import ModelNotFoundError, prepare_model

            try:
                for name in self.models:
                    prepare_model(self.cfg, self.cfg.model(name), progress=True)
            except ModelNotFoundError as e:
                raise FarmError(str(e)) from None
        try:
            self._start_redis()
            self.write_state()
            for name, role, model in self.expected_workers:
                self._start_worker(name, role, model)
            for i in range(1, self.batch_drivers + 1):
                name = f"batch-{i}"
                self._spawn(Proc(name, "batch", self.batch_command(name), str(self.log_path(name))))
            if self.api_enabled:
                self._spawn(Proc("api", "api", self.api_command(), str(self.log_path("api"))))
            if self.flower_enabled:
                # Flower reads FLOWER_<OPTION>: basic auth without the password on a command line, and in no
                # other child's environment (the login can send tasks through Flower's API: an admin credential)
                self._spawn(Proc("flower", "flower", self.flower_command(), str(self.log_path("flower")),
                                 env=self.flower_env()))
            self.write_state()
            self.check_alive("while starting")
        except BaseException:
            self.stop()
            raise
        return self

    def _make_state_private(self) -> None:
        """The state dir (and a batch.files_dir outside it) is this user's alone: 0700 directories, 0600 files;
        one made before that was so (0755 and 0644 with the usual umask) is tightened, and we say so."""
        filemodes.private_dir(self.state_dir)
        roots = [self.state_dir]
        files = self.cfg.files_path
        if self.cfg.batch.files_backend == "disk" and not files.is_relative_to(self.state_dir):
            roots.append(files)
        for root in roots:
            changed, failed = filemodes.tighten(root)
            if changed:
                print(f"farm: {root}: took group and other permissions off {changed} files and directories "
                      "(the farm's state is private to its user)", file=sys.stderr)
            if failed:
                print(f"farm: {root}: could not make {failed} paths private (owned by another user?)", file=sys.stderr)

    def check_alive(self, during: str = "") -> None:
        """Raise FarmStartError with the log tail of the first child that is no longer running."""
        for p in self.procs:
            if not p.alive() and not p.retiring:
                raise self._died(p, during)
