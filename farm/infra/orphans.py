"""Child processes that never outlive the process that started them.

A supervisor that is killed with SIGKILL (or by the OOM killer) runs no cleanup, and its children, each in
a session of its own so that a terminal's Ctrl-C reaches only the supervisor, would be reparented to pid 1
and run on for good: a whole farm (redis-server, workers, gunicorn) was once found that way after a test
run was killed. Linux's parent-death signal closes that hole: `PR_SET_PDEATHSIG`, set in the child between
fork and exec (it survives exec), makes the kernel signal the child when its parent dies.

    subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))

The signal is sent when the *thread* that forked the child ends, so it is only armed for children started
from the main thread (a helper thread's end must not take its children along); elsewhere, and off Linux,
`die_with_parent` returns None (no preexec_fn).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1

_prctl = None
if sys.platform.startswith("linux"):
    try:  # resolved here, in the parent: the child between fork and exec must not load libraries
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        _prctl = None


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child receive `sig` when this process dies; None where that cannot
    be armed (not Linux, or not called from the main thread)."""
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()
    prctl = _prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)

    return arm
