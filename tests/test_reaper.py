"""The vLLM worker's reaper (farm.backends.reaper): a worker that dies, even by SIGKILL, takes the processes it
started along (vLLM's engine core and executor would otherwise keep their core and gigabytes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

WORKER = textwrap.dedent("""
    import subprocess, sys, time
    from farm.backends.reaper import start_reaper
    reaper = start_reaper()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(reaper.pid, child.pid, flush=True)
    time.sleep(120)
""")


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_a_killed_worker_s_children_are_reaped_and_the_reaper_ends():
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    started: list[int] = []
    try:
        started += [int(x) for x in worker.stdout.readline().split()]
        reaper_pid, child_pid = started
        time.sleep(2.5)  # the reaper lists the worker's descendants every second
        assert not wait_gone(child_pid, 0.5)  # nothing reaped while the worker runs
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        assert wait_gone(child_pid, 10)  # SIGTERM at once
        assert wait_gone(reaper_pid, 10)
    finally:
        worker.kill()
        worker.wait()
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_clock_step_does_not_disarm_the_reaper(monkeypatch):
    """The reaper knows a descendant by its start since boot: after the wall clock stepped (psutil's create_time
    moves with it) the process it listed is still the one it stops, where a start on the wall clock no longer
    matched and nothing was stopped."""
    from farm.backends.reaper import _descendants, reap

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        known = {child.pid: _descendants(os.getpid())[child.pid]}  # this child alone: the session's others stay
        real_boot = psutil._pslinux.boot_time
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real_boot() + 90.0)
        assert reap(known, grace_s=5) == [child.pid]
        assert wait_gone(child.pid, 5)
    finally:
        child.kill()
        child.wait()
