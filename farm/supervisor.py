"""Run a whole farm on this machine: redis-server, workers, the API (gunicorn) and Flower.

Every component is a separate OS process in its own session (so a Ctrl-C in the terminal reaches
only the supervisor, which then stops the children in order), logging to `<state>/logs/<name>.log`.
`<state>/farm.json` records every process (name, role, pid, command, log) so `farm down` and
`farm status` from another shell find them.

Stop order matters: workers first (SIGTERM = Celery warm shutdown, which finishes the requests in
flight while the API still streams their tokens), then the API, Flower, and Redis last. A second stop
signal kills what is left at once. Children never outlive the process that started them, even when it is
killed with SIGKILL: each gets a parent-death signal (farm.orphans), unless the farm is detached.

    with Farm(cfg, prefill=1, decode=1, port=free_port(), flower=False).running(timeout=300) as farm:
        ...
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests
import yaml

from farm import logfiles, redis_client, redis_server
from farm.backends.cpu_binding import bind_env
from farm.config import (
    PROJECT_ROOT,
    ConfigError,
    FarmConfig,
    farm_secret,
    redact_url,
    redis_url_with_password,
)
from farm.config.redis import is_local, url_password
from farm.orphans import die_with_parent
from farm.progress import ProgressPrinter

STATE_FILE = "farm.json"
RESOLVED_CONFIG = "config.resolved.yaml"
WORKER_ROLES = ("prefill", "decode", "both")
API_APP = "api.app:create_app()"
API_SERVER_CONFIG = "python:api.gunicorn_conf"  # gunicorn settings from the farm config
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
API_GRACE_S = 40.0  # gunicorn --graceful-timeout 30, plus margin
FLOWER_GRACE_S = 10.0
BATCH_GRACE_S = 30.0  # a batch driver gives in-flight lines batch.shutdown_grace_s, then hands its batches back
RESTARTED_ROLES = (*WORKER_ROLES, "batch")  # restarted when they die; anything else dying stops the farm
REDIS_GRACE_S = 30.0
REDIS_KILL_GRACE_S = 10.0  # killing at once still lets Redis flush its AOF (it exits in milliseconds)
# What a child gets when the process that started it dies without stopping it (farm.orphans): Redis flushes
# its AOF and exits, gunicorn's quick shutdown takes its worker along, everything else is killed.
PARENT_DEATH_SIGNALS = {"redis": signal.SIGTERM, "api": signal.SIGQUIT}
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, `farm down`, a closed terminal
STOPPING_MESSAGE = "\nfarm: stopping (workers finish their requests; Ctrl-C again to kill)"
MAX_WORKER_RESTARTS = 3


class FarmError(RuntimeError):
    """The farm could not start, or is not in the state an operation needs."""


class FarmStartError(FarmError):
    """A component died or never became healthy during start-up; carries the tail of its log."""

    def __init__(self, message: str, name: str | None = None, log_tail: str = ""):
        super().__init__(message)
        self.name = name
        self.log_tail = log_tail

    def __str__(self) -> str:
        msg = self.args[0]
        if self.log_tail:
            msg += f"\n--- last lines of {self.name}'s log ---\n{self.log_tail.rstrip()}\n---"
        return msg


def tail(path: str | Path, lines: int = 40, offset: int = 0) -> str:
    """The last `lines` lines of a log file (from byte `offset` on)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(offset, size - 64 * 1024)
            f.seek(start)
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


# -- processes ------------------------------------------------------------------------------------
@dataclass
class Proc:
    """One child process of the farm, started here or found again through farm.json."""

    name: str
    role: str  # redis | prefill | decode | both | api | flower
    command: list[str]
    log: str
    model: str | None = None
    worker_id: str | None = None
    pid: int = 0
    create_time: float = 0.0
    popen: subprocess.Popen | None = field(default=None, repr=False)
    log_offset: int = field(default=0, repr=False)
    restarts: int = 0
    started_at: float = 0.0  # wall clock, when spawned
    retiring: bool = False  # being scaled down: warm shutdown in progress, never restarted
    env: dict[str, str] = field(default_factory=dict, repr=False)  # this child's own additions to child_env()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.role, "model": self.model, "worker_id": self.worker_id,
            "pid": self.pid, "create_time": self.create_time, "command": self.command, "log": self.log,
            "restarts": self.restarts, "started_at": self.started_at,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Proc:
        return cls(name=d["name"], role=d["role"], command=list(d.get("command", [])), log=d.get("log", ""),
                   model=d.get("model"), worker_id=d.get("worker_id"), pid=int(d.get("pid") or 0),
                   create_time=float(d.get("create_time") or 0.0), restarts=int(d.get("restarts") or 0),
                   started_at=float(d.get("started_at") or 0.0))

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _pid_alive(self.pid, self.create_time)

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def send(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the process and its process group (gunicorn's and Flower's children too)."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(self.pid) == self.pid:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)

    def reap(self) -> None:
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=0.1)

    def tail(self, lines: int = 40) -> str:
        return tail(self.log, lines, self.log_offset)


def _pid_alive(pid: int, create_time: float = 0.0) -> bool:
    """Whether `pid` runs and is the same process as recorded (not a reused pid, not a zombie)."""
    if pid <= 0:
        return False
    try:
        p = psutil.Process(pid)
        if create_time and abs(p.create_time() - create_time) > 1.0:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def _stop_group(procs: list[Proc], sig_timeout: float, abort: Callable[[], bool] | None = None) -> None:
    """SIGTERM every live process of the group, wait up to `sig_timeout` (or until `abort()` says to stop
    waiting), then SIGKILL the rest."""
    live = [p for p in procs if p.alive()]
    for p in live:
        p.send(signal.SIGTERM)
    deadline = time.monotonic() + sig_timeout
    while live and time.monotonic() < deadline and not (abort and abort()):
        for p in live:
            p.reap()
        live = [p for p in live if p.alive()]
        if live:
            time.sleep(0.1)
    for p in live:
        p.kill()
    for p in live:
        end = time.monotonic() + 5
        while p.alive() and time.monotonic() < end:
            p.reap()
            time.sleep(0.05)


def stop_ordered(procs: Iterable[Proc], grace_s: float = 60.0, abort: Callable[[], bool] | None = None) -> None:
    """Stop farm processes in the safe order: batch drivers (they stop feeding lines and hand their batches
    back), workers (warm shutdown), API, Flower, Redis. Once `abort()` is true (a second Ctrl-C) nobody is
    waited for any more: what is left is killed, except Redis, which still gets SIGTERM (AOF flush)."""
    procs = list(procs)
    by_role = {r: [p for p in procs if p.role == r] for r in ("batch", "api", "flower", "redis")}
    workers = [p for p in procs if p.role in WORKER_ROLES]
    others = [p for p in procs if p.role not in (*WORKER_ROLES, "batch", "api", "flower", "redis")]
    for group, grace in ((by_role["batch"], BATCH_GRACE_S), (workers, grace_s), (by_role["api"], API_GRACE_S),
                         (by_role["flower"] + others, FLOWER_GRACE_S)):
        _stop_group(group, 0.0 if abort and abort() else grace, abort)
    _stop_group(by_role["redis"], REDIS_KILL_GRACE_S if abort and abort() else REDIS_GRACE_S)


def _kill_now(procs: Iterable[Proc]) -> None:
    """Second Ctrl-C: kill everything at once, except Redis, which still gets SIGTERM (AOF flush)."""
    procs = list(procs)
    for p in procs:
        if p.role != "redis":
            p.kill()
    _stop_group([p for p in procs if p.role == "redis"], REDIS_KILL_GRACE_S)
    for p in procs:
        p.reap()


# -- the state file -------------------------------------------------------------------------------
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
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _supervisor_alive(state: dict[str, Any]) -> int | None:
    sup = state.get("supervisor") or {}
    pid = int(sup.get("pid") or 0)
    if pid and pid != os.getpid() and _pid_alive(pid, float(sup.get("create_time") or 0.0)):
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


# -- the farm -------------------------------------------------------------------------------------
def _display_host(host: str) -> str:
    return socket.gethostname() if host in ("0.0.0.0", "", "::") else host


def _connect_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _port_in_use(host: str, port: int) -> bool:
    try:
        with socket.create_connection((_connect_host(host), port), timeout=0.3):
            return True
    except OSError:
        return False


def worker_counts(cfg: FarmConfig, prefill: int | None, decode: int | None, both: int | None) -> dict[str, int]:
    """Worker counts from the flags; `--workers N` alone means N aggregated workers and nothing else."""
    if both is not None and prefill is None and decode is None:
        prefill = decode = 0
    counts = {
        "prefill": cfg.workers.prefill if prefill is None else prefill,
        "decode": cfg.workers.decode if decode is None else decode,
        "both": cfg.workers.both if both is None else both,
    }
    if any(n < 0 for n in counts.values()):
        raise ConfigError(f"worker counts must not be negative: {counts}")
    if sum(counts.values()) == 0:
        raise ConfigError("no workers to start: give --workers N, or --prefill-workers N --decode-workers N")
    if counts["prefill"] and not (counts["decode"] or counts["both"]):
        raise ConfigError("prefill workers hand every request to a decode worker: add --decode-workers N "
                          "(or --workers N)")
    return counts


class Farm:
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
        if flower and self.flower_host not in LOCAL_HOSTS:
            if ":" not in self.flower_auth:
                raise ConfigError(
                    f"flower.host is {self.flower_host!r} (reachable from other machines): set "
                    "FARM_FLOWER_AUTH=user:password for Flower's basic auth, or use --no-flower"
                )
        if api and self.api_host not in LOCAL_HOSTS:
            from farm.apikeys import keys_configured

            if not keys_configured(cfg) and not cfg.api.allow_unauthenticated:
                raise ConfigError(
                    f"api.host is {self.api_host!r} (reachable from other machines) and no API key is set: "
                    "set FARM_API_KEYS=key1,key2 (or api.api_keys), or api.allow_unauthenticated: true "
                    "behind your own authenticating proxy"
                )
        self.grace_s = grace_s
        self.prepare = prepare
        self.extra_env = dict(env or {})
        self.hostname = hostname or socket.gethostname()
        self.state_dir = cfg.state_path
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

    def child_env(self) -> dict[str, str]:
        if self._env is None:
            env = {k: v for k, v in os.environ.items()
                   if not (k.startswith("FARM_") and ("__" in k or k in ("FARM_CONFIG", "FARM_STATE_DIR")))}
            env["FARM_CONFIG"] = str(self.state_dir / RESOLVED_CONFIG)
            env["PYTHONUNBUFFERED"] = "1"
            env.setdefault("HF_HUB_OFFLINE", "1")
            env.setdefault("TRANSFORMERS_OFFLINE", "1")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
            if self.flower_enabled and self.flower_auth:
                # Flower reads FLOWER_<OPTION>: basic auth without the password on a command line.
                env["FLOWER_BASIC_AUTH"] = self.flower_auth
            env.update(self.extra_env)
            # the resolved configuration is the one every child reads (it carries this farm's ports and
            # password), also when the caller's environment names another FARM_CONFIG
            env["FARM_CONFIG"] = str(self.state_dir / RESOLVED_CONFIG)
            self._env = env
        return self._env

    def write_state(self) -> None:
        sup = {"pid": os.getpid(), "create_time": _create_time(os.getpid())} if self.supervisor else None
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
        """Rotate a child's log past logs.max_mb (farm.logfiles: copy and truncate, the child keeps writing)."""
        if logfiles.rotate(Path(proc.log), int(self.cfg.logs.max_mb * 1024 * 1024), self.cfg.logs.backups):
            proc.log_offset = 0

    def _spawn(self, proc: Proc) -> Proc:
        log = Path(proc.log)
        log.parent.mkdir(parents=True, exist_ok=True)
        self._rotate_log(proc)
        with open(log, "ab") as f:
            f.write(f"\n=== farm: starting {proc.name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                    f"{' '.join(proc.command)}\n".encode())
            f.flush()
            proc.log_offset = f.tell()
            proc.popen = subprocess.Popen(
                proc.command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=PROJECT_ROOT, env={**self.child_env(), **proc.env}, start_new_session=True,
                preexec_fn=die_with_parent(PARENT_DEATH_SIGNALS.get(proc.role, signal.SIGKILL))
                if self.bound else None,
            )
        proc.pid = proc.popen.pid
        proc.started_at = time.time()
        proc.create_time = _create_time(proc.pid)
        if proc not in self.procs:
            self.procs.append(proc)
        return proc

    def _died(self, proc: Proc, during: str) -> FarmStartError:
        rc = proc.returncode
        return FarmStartError(f"{proc.name} exited with status {rc} {during} (log: {proc.log})",
                              proc.name, proc.tail())

    def _protect_managed_redis(self) -> None:
        """A Redis this farm is about to start never runs without a password: when the URL has none (nor
        FARM_REDIS_PASSWORD), one is generated once into `<state_dir>/redis.password` (0600) and put into
        this farm's URL, so every child (through config.resolved.yaml) and every later `farm` command
        (load_config reads the file) authenticates. A Redis already answering without one is used as it is."""
        url = self.cfg.redis.url
        if not self.cfg.redis.managed or not is_local(url) or url_password(url):
            return
        if redis_server.ping(url):
            return  # someone else's Redis: not ours to protect (redis.managed: false says so explicitly)
        url = redis_url_with_password(url, redis_server.ensure_password(self.state_dir))
        self.cfg = self.cfg.model_copy(update={"redis": self.cfg.redis.model_copy(update={"url": url})})

    def _start_redis(self) -> None:
        url = self.cfg.redis.url
        if redis_server.ping(self.cfg.redis):
            return  # someone else's Redis (or a shared one): use it, never stop it
        if not self.cfg.redis.managed:
            raise FarmError(f"Redis at {redact_url(url)} does not answer and redis.managed is false")
        if not is_local(url):
            raise FarmError(f"Redis at {redact_url(url)} does not answer, and it is not on this machine, so the "
                            "farm cannot start one; check FARM_REDIS__URL")
        if self.cfg.redis.ha.enabled:
            self._start_redis_ha()
            return
        _host, port, _db = redis_server.parse_url(url)
        self._start_redis_node("redis", port)

    def _redis_node_dir(self, port: int) -> Path:
        """The data dir of the managed data node on `port`: the primary's (redis.url) or the replica's."""
        _host, url_port, _db = redis_server.parse_url(self.cfg.redis.url)
        return self.state_dir / ("redis" if port == url_port else "redis-replica")

    def _redis_node_command(self, port: int, replica_of: int | None = None) -> list[str]:
        try:
            return redis_server.command(port, self._redis_node_dir(port), self.cfg.redis.appendonly,
                                        password=url_password(self.cfg.redis.url), replica_of=replica_of)
        except redis_server.RedisServerError as e:
            raise FarmError(str(e)) from None

    def _start_redis_node(self, name: str, port: int, replica_of: int | None = None) -> None:
        cmd = self._redis_node_command(port, replica_of)
        self._redis_node_dir(port).mkdir(parents=True, exist_ok=True)
        proc = self._spawn(Proc(name, "redis", cmd, str(self.log_path(name))))
        self.redis_managed = True
        try:
            redis_server.wait_ready(redis_server.node_url(self.cfg.redis.url, port), proc.popen, timeout=15)
        except redis_server.RedisServerError as e:
            raise FarmStartError(f"{e} (log: {proc.log})", proc.name, proc.tail()) from None

    def _start_redis_ha(self) -> None:
        """redis.ha on this machine: the primary, its replica, then the sentinels watching them. The node
        the sentinels last knew as the primary (after a failover: the promoted replica) starts as the primary
        again, so the other resyncs from it and no acknowledged write is overwritten."""
        rcfg, ha = self.cfg.redis, self.cfg.redis.ha
        sentinels = ha.sentinel_addresses()
        if not all(is_local(f"redis://{h}:{p}/0") for h, p in sentinels):
            raise FarmError(f"redis.ha.sentinels {ha.sentinels} do not answer and are not all on this machine, "
                            "so the farm cannot start them")
        _host, url_port, _db = redis_server.parse_url(rcfg.url)
        ports = [url_port, ha.replica_port, *(p for _h, p in sentinels)]
        if len(set(ports)) != len(ports):
            raise FarmError(f"redis.url's port, redis.ha.replica_port and the sentinels' ports must differ: {ports}")
        primary = redis_server.last_primary_port(self.state_dir, ha.master_name)
        primary = primary if primary in (url_port, ha.replica_port) else url_port
        replica = ha.replica_port if primary == url_port else url_port
        names = {url_port: "redis", ha.replica_port: "redis-replica"}
        self._start_redis_node(names[primary], primary)
        self._start_redis_node(names[replica], replica, replica_of=primary)
        password = url_password(rcfg.url)
        for i, (_h, port) in enumerate(sentinels, 1):
            try:
                cmd = redis_server.sentinel_command(i, port, self.state_dir, ha, primary, password)
            except redis_server.RedisServerError as e:
                raise FarmError(str(e)) from None
            self._spawn(Proc(f"sentinel-{i}", "sentinel", cmd, str(self.log_path(f"sentinel-{i}"))))
        deadline = time.monotonic() + 15
        while not redis_server.ping(rcfg):  # clients find the primary through the sentinels
            self.check_alive("while starting Redis Sentinel")
            if time.monotonic() > deadline:
                first = next(p for p in self.procs if p.role == "sentinel")
                raise FarmStartError("the sentinels did not report a primary within 15s", first.name, first.tail())
            time.sleep(0.1)

    def _rejoin_command(self, proc: Proc) -> list[str] | None:
        """redis.ha: the command that brings a dead data node back, as a replica of the primary the sentinels
        name now; None while they still name the dead node (the failover is not done: wait)."""
        if proc.role != "redis":
            return proc.command  # a sentinel: the config it rewrote holds what it knew
        port = int(proc.command[proc.command.index("--port") + 1])
        now = redis_client.primary_address(self.cfg.redis)
        if now is None or now[1] == port:
            return None
        return self._redis_node_command(port, replica_of=now[1])

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
        self.log_dir.mkdir(parents=True, exist_ok=True)
        farm_secret(self.cfg)  # create the shared secret once, before children race to create it
        self._protect_managed_redis()
        self._write_resolved_config()
        for host, port, what in ((self.api_host, self.api_port, "API"),
                                 (self.flower_host, self.flower_port, "Flower")):
            if (what == "API" and self.api_enabled) or (what == "Flower" and self.flower_enabled):
                if _port_in_use(host, port):
                    raise FarmError(f"port {port} on {host} (the {what}) is already in use")
        if self.prepare and self.expected_workers:
            from farm.models import ModelNotFoundError, prepare_model

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
                self._spawn(Proc("flower", "flower", self.flower_command(), str(self.log_path("flower"))))
            self.write_state()
            self.check_alive("while starting")
        except BaseException:
            self.stop()
            raise
        return self

    def check_alive(self, during: str = "") -> None:
        """Raise FarmStartError with the log tail of the first child that is no longer running."""
        for p in self.procs:
            if not p.alive() and not p.retiring:
                raise self._died(p, during)

    # -- scaling (the planner's local actuator) ---------------------------------------------------------
    def workers(self, role: str, model: str | None = None) -> list[Proc]:
        """Running workers of a role (and model), oldest first, not counting those being retired."""
        model = model or self.cfg.default_model
        return [p for p in self.procs if p.role == role and p.model == model and not p.retiring and p.alive()]

    def scale(self, role: str, n: int, model: str | None = None) -> list[str]:
        """Start or retire workers until `n` of `role` serve `model`; returns the names changed.

        Retiring is Celery's warm shutdown (SIGTERM): the worker stops taking tasks, finishes every
        request it has, then exits; the newest workers are retired first. Requests already placed on
        a retiring worker's own queue are re-sent by the gateway once its heartbeat is gone."""
        if role not in WORKER_ROLES or n < 0:
            raise ValueError(f"cannot scale {role!r} to {n}")
        model = model or self.cfg.default_model
        current = self.workers(role, model)
        changed = []
        if n > len(current):
            taken = {p.name for p in self.procs}
            i = 0
            for _ in range(n - len(current)):
                i += 1
                while f"{role}-{i}" in taken:
                    i += 1
                name = f"{role}-{i}"
                taken.add(name)
                self._start_worker(name, role, model)
                changed.append(name)
        else:
            for p in current[n:][::-1]:
                p.retiring = True
                p.send(signal.SIGTERM)
                changed.append(p.name)
        self.write_state()
        return changed

    def reap_retired(self) -> None:
        """Forget retired workers that have exited (foreground `wait` does this too)."""
        for p in [p for p in self.procs if p.retiring and not p.alive()]:
            p.reap()
            self.procs.remove(p)
        self.write_state()

    # -- health -----------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """What is up: redis, each worker (registered in its role), the API's /health, Flower."""
        from farm import registry

        out: dict[str, Any] = {"redis": redis_server.ping(self.cfg.redis), "workers": {},
                               "api": None, "flower": None}
        live: dict[str, Any] = {}
        if out["redis"]:
            r = redis_client.connect(self.cfg.redis, timeout=2.0)
            try:
                live = {w.worker_id: w for w in registry.live_workers(r)}
            except Exception:  # noqa: BLE001 - a half-started Redis is simply "not yet"
                live = {}
            finally:
                r.close()
        procs = {p.name: p for p in self.procs}
        for name, role, model in self.expected_workers:
            w, p = live.get(self.worker_id(name)), procs.get(name)
            # This very process, not a record left by an earlier run under the same name.
            fresh = bool(w and p and (w.pid == p.pid or w.started_at >= p.started_at - 1.0))
            out["workers"][name] = bool(fresh and w.role == role and w.model == model)
        if self.api_enabled:
            out["api"] = self._api_ready()
        if self.flower_enabled:
            out["flower"] = self._flower_ready()
        out["ready"] = bool(out["redis"] and all(out["workers"].values())
                            and out["api"] is not False and out["flower"] is not False)
        return out

    def _api_ready(self) -> bool:
        url = f"http://{_hostport(_connect_host(self.api_host), self.api_port)}/health"
        try:
            resp = requests.get(url, timeout=2)
            body = resp.json()
        except (requests.RequestException, ValueError):
            return False
        if resp.status_code != 200:
            return False
        counts = body.get("workers") if isinstance(body, dict) else None
        if isinstance(counts, dict):
            for model in self.models:
                got = counts.get(model) or {}
                for role in WORKER_ROLES:
                    if int(got.get(role, 0) or 0) < self.model_counts(model)[role]:
                        return False
        return True

    def _flower_ready(self) -> bool:
        url = f"http://{_hostport(_connect_host(self.flower_host), self.flower_port)}/healthcheck"
        auth = tuple(self.flower_auth.split(":", 1)) if ":" in self.flower_auth else None
        try:
            return requests.get(url, timeout=2, auth=auth).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout: float = 300.0, interval: float = 0.5,
                     progress: Callable[[dict[str, Any], float], None] | None = None) -> dict[str, Any]:
        """Poll until every component is up and every worker registered in its role.

        `progress(health, elapsed_s)` is called after every poll (farm up prints the component states with it).
        Raises FarmStartError as soon as a child exits (with its log tail), or when `timeout` passes
        (naming what is still missing, with the log tail of the first of those).
        """
        start = time.monotonic()
        deadline = start + timeout
        while True:
            self.check_alive("while starting")
            h = self.health()
            if progress is not None:
                progress(h, time.monotonic() - start)
            if h["ready"]:
                return h
            if time.monotonic() >= deadline:
                missing = [n for n, ok in h["workers"].items() if not ok]
                missing += [c for c in ("redis", "api", "flower") if h[c] is False]
                first = next((p for p in self.procs if p.name == missing[0]), None) if missing else None
                raise FarmStartError(
                    f"the farm did not become healthy within {timeout:.0f}s; not ready: {', '.join(missing)}",
                    first.name if first else None, first.tail() if first else "",
                )
            time.sleep(interval)

    # -- running and stopping -----------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, timeout: float = 300.0) -> Iterator[Farm]:
        """Start, wait until healthy, hand the farm over, and stop it whatever happens (tests, benches)."""
        try:
            self.start()
            self.wait_healthy(timeout)
            yield self
        finally:
            self.stop()

    def wait(self, poll_s: float = 0.5, tick: Callable[[], bool | None] | None = None,
             tick_every_s: float = 1.0) -> int:
        """Foreground: watch the children until one fails for good; returns the exit status (1).

        A worker that dies is restarted (at most MAX_WORKER_RESTARTS times), so are the data nodes and
        sentinels of a managed Redis Sentinel set; the API, Flower or a single Redis dying stops the farm.
        Returns 0 once serve() received a stop signal (the caller then calls stop()); Ctrl-C without
        serve()'s handlers (KeyboardInterrupt) propagates to the caller. `tick` (the planner's step) runs
        every `tick_every_s` between looks; it returning False ends the wait with 0.
        """
        next_tick = 0.0
        while not self._stop_signals:
            status = self.supervise_once()
            if status is not None:
                return status
            if tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + tick_every_s
                if tick() is False:
                    return 0
            time.sleep(poll_s)
        return 0

    def supervise_once(self) -> int | None:
        """One look at every child: restart what may be restarted; 1 when one failed for good, else None."""
        for p in list(self.procs):
            if not self._stopping and p.popen is not None:
                self._rotate_log(p)
            if self._stopping or p.alive():
                continue
            if p.retiring:  # scaled down: it finished its requests and left
                self.procs.remove(p)
                self.write_state()
                continue
            rc = p.returncode
            restarted = RESTARTED_ROLES + (("redis", "sentinel") if self._redis_ha_managed else ())
            if p.role in restarted and p.restarts < MAX_WORKER_RESTARTS:
                command = self._rejoin_command(p) if p.role in ("redis", "sentinel") else p.command
                if command is None:
                    continue  # a primary that died: it rejoins as a replica once the sentinels promoted one
                p.command = command
                p.restarts += 1
                print(f"farm: {p.name} exited with status {rc}; restarting it "
                      f"({p.restarts}/{MAX_WORKER_RESTARTS}); log: {p.log}\n{p.tail(10)}", file=sys.stderr)
                self._spawn(p)
                self.write_state()
                continue
            print(f"farm: {p.name} exited with status {rc}; stopping the farm (log: {p.log})\n"
                  f"{p.tail(20)}", file=sys.stderr)
            return 1
        return None

    def stop(self, grace_s: float | None = None) -> None:
        """Workers first (SIGTERM: warm shutdown, up to the grace period, then SIGKILL), then the API,
        Flower, and Redis last. A second Ctrl-C while stopping kills what is left at once."""
        self._stopping = True
        try:
            stop_ordered(self.procs, self.grace_s if grace_s is None else grace_s,
                         abort=self._kill_requested)
        except KeyboardInterrupt:
            print("farm: killing what is left", file=sys.stderr)
            _kill_now(self.procs)
        finally:
            for p in self.procs:
                p.reap()
            if self._owns_state:  # never touch the farm.json of another farm
                if not any(p.alive() for p in self.procs):
                    self.state_path.unlink(missing_ok=True)
                    self._owns_state = False
                else:
                    self.write_state()
            self._stopping = False

    def _on_stop_signal(self, signum: int, _frame: Any) -> None:
        """serve()'s handler of Ctrl-C, SIGTERM (`farm down`) and SIGHUP, installed whatever this process
        inherited: a shell starting a command in the background (`make test &`, CI runners) makes it ignore
        SIGINT, and a supervisor that kept that disposition ignored Ctrl-C for good (issue 17: the test timed
        out and its redis-server lived on). During start-up the first signal interrupts at once
        (KeyboardInterrupt); after that signals are only counted, never raised into whatever the main thread
        is doing (raised between a lock's acquire and its `try`, in subprocess's waitpid bookkeeping, it left
        a child looking alive forever): wait() returns on the first, stop_ordered() kills on the second."""
        self._stop_signals += 1
        if self._starting and not self._stopping and self._stop_signals == 1:
            raise KeyboardInterrupt(signal.Signals(signum).name)

    def _kill_requested(self) -> bool:
        """stop_ordered()'s abort: a second stop signal arrived while stopping."""
        if self._stop_signals > 1 and not self._kill_announced:
            self._kill_announced = True
            print("farm: killing what is left", file=sys.stderr, flush=True)
        return self._stop_signals > 1

    def detach(self) -> None:
        """Leave the children running on their own (`farm up --detach`); farm.json keeps their pids."""
        self.supervisor = False
        self.write_state()
        for p in self.procs:
            p.popen = None

    def serve(self, timeout: float = 300.0, detach: bool = False, tick: Callable[[], bool | None] | None = None,
              tick_every_s: float = 1.0) -> int:
        """`farm up` (and `farm planner run` with the local actuator, whose step is `tick`): start, wait until
        healthy, print the URLs; then detach or supervise until Ctrl-C."""
        handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in handlers:
            signal.signal(s, self._on_stop_signal)
        self.supervisor = not detach
        self.bound = not detach  # a detached farm's children must outlive `farm up`
        detached = False
        try:
            try:
                self._starting = True
                self.start()
                self.wait_healthy(timeout, progress=ProgressPrinter(sys.stderr))
            except FarmError as e:
                print(f"farm: failed to start: {e}", file=sys.stderr)
                return 1
            finally:
                self._starting = False
            urls = self.urls()
            print("farm is up:")
            if urls["api"]:
                print(f"  API     {urls['api']}")
            if urls["flower"]:
                print(f"  Flower  {urls['flower']}")
            print(f"  Redis   {urls['redis']}" + ("  (managed)" if self.redis_managed else ""))
            workers = ", ".join(f"{n} ({m})" for n, _r, m in self.expected_workers) or "none"
            print(f"  Workers {workers}")
            print(f"  Logs    {self.log_dir}")
            if detach:
                self.detach()
                detached = True
                print("running in the background; `farm status` shows it, `farm down` stops it")
                return 0
            print("press Ctrl-C to stop", flush=True)
            status = self.wait(tick=tick, tick_every_s=tick_every_s)
            if self._stop_signals:
                print(STOPPING_MESSAGE, file=sys.stderr, flush=True)
            return status
        except KeyboardInterrupt:
            print(STOPPING_MESSAGE, file=sys.stderr, flush=True)
            return 0
        finally:
            if not detached:
                self.stop()
            for s, h in handlers.items():
                signal.signal(s, h)
