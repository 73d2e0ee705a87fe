"""Take an engine's helper processes down with the worker that started them, however the worker ends.

vLLM runs its engine core and model worker in processes of their own. When the farm's worker process is
killed (kill -9, the OOM killer), nothing tells them: measured, both stayed alive holding a core and
gigabytes after their worker was gone. A tiny reaper process watches the worker instead: it holds the
read end of a pipe whose write end only the worker has, so end-of-file means the worker is gone, for any
reason (processes forked by the worker inherit that end too, so the worker's pid is watched as well).
Meanwhile it keeps a list of the worker's descendants (each known by pid and start since boot, so a
reused pid is never hit, and a clock step does not disarm it: farm.infra.process_identity); at the worker's end it stops those still running (SIGTERM, then SIGKILL).

    python -m farm.backends.reaper PID    # started by `start_reaper()`, stdin = the pipe
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

import psutil

from farm.infra.process_identity import same_process, started_since_boot

SNAPSHOT_S = 1.0  # how often the worker's descendants are listed
GRACE_S = 3.0  # between SIGTERM and SIGKILL


def start_reaper() -> subprocess.Popen:
    """Start the reaper of this process's descendants; it lives until this process ends."""
    return subprocess.Popen([sys.executable, "-m", "farm.backends.reaper", str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # not in the worker's process group: signals to it spare us


def _descendants(pid: int) -> dict[int, float]:
    try:
        children = [p.pid for p in psutil.Process(pid).children(recursive=True) if p.pid != os.getpid()]
    except psutil.Error:
        return {}
    out = {}
    for child in children:
        with contextlib.suppress(psutil.Error):
            out[child] = started_since_boot(child)
    return out


def reap(known: dict[int, float], grace_s: float = GRACE_S) -> list[int]:
    """Stop the processes of `known` (pid -> start since boot) that still run; returns the pids signalled."""
    procs = []
    for pid, since_boot in known.items():
        if same_process(pid, since_boot):
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    return [p.pid for p in procs]


def main(argv: list[str]) -> int:
    pid = int(argv[0])
    try:
        started = started_since_boot(pid)
    except psutil.Error:
        return 0
    known: dict[int, float] = {}
    gone = threading.Event()

    def watch_pipe() -> None:
        # End-of-file once every write end is closed. Processes forked by the worker inherit its end, so
        # the worker's own liveness is checked too (by pid and start time).
        sys.stdin.buffer.read()
        gone.set()

    threading.Thread(target=watch_pipe, daemon=True).start()
    while not gone.wait(SNAPSHOT_S) and same_process(pid, started):
        known.update(_descendants(pid))
        known = {p: t for p, t in known.items() if same_process(p, t)}
    reap(known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
