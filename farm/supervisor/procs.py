"""Processes of one farm: start, signal, stop in order, the exit of one; and the supervisor's constants
(grace periods, restarted roles, stop signals)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from farm.infra.process_identity import same_process, started_since_boot

WORKER_ROLES = ("prefill", "decode", "both")
API_GRACE_S = 40.0  # gunicorn --graceful-timeout 30, plus margin
FLOWER_GRACE_S = 10.0
BATCH_GRACE_S = 30.0  # a batch driver gives in-flight lines batch.shutdown_grace_s, then hands its batches back
RESTARTED_ROLES = (*WORKER_ROLES, "batch")  # restarted when they die; anything else dying stops the farm
REDIS_GRACE_S = 30.0
REDIS_KILL_GRACE_S = 10.0  # killing at once still lets Redis flush its AOF (it exits in milliseconds)
# What a child gets when the process that started it dies without stopping it (farm.infra.orphans): Redis flushes
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
    since_boot: float = 0.0  # its start after the host's boot (farm.infra.process_identity): pid reuse told apart
    popen: subprocess.Popen | None = field(default=None, repr=False)
    log_offset: int = field(default=0, repr=False)
    restarts: int = 0
    started_at: float = 0.0  # wall clock, when spawned
    retiring: bool = False  # being scaled down: warm shutdown in progress, never restarted
    env: dict[str, str] = field(default_factory=dict, repr=False)  # this child's own additions to child_env()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.role, "model": self.model, "worker_id": self.worker_id,
            "pid": self.pid, "since_boot": self.since_boot, "command": self.command, "log": self.log,
            "restarts": self.restarts, "started_at": self.started_at,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Proc:
        return cls(name=d["name"], role=d["role"], command=list(d.get("command", [])), log=d.get("log", ""),
                   model=d.get("model"), worker_id=d.get("worker_id"), pid=int(d.get("pid") or 0),
                   since_boot=float(d.get("since_boot") or 0.0), restarts=int(d.get("restarts") or 0),
                   started_at=float(d.get("started_at") or 0.0))

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _pid_alive(self.pid, self.since_boot)

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


def _pid_alive(pid: int, since_boot: float = 0.0) -> bool:
    """Whether `pid` runs and is the process recorded as started `since_boot` (0: any), not a reused pid nor a
    zombie."""
    if pid <= 0 or (since_boot and not same_process(pid, since_boot)):
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _since_boot(pid: int) -> float:
    try:
        return started_since_boot(pid)
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
