"""Which process a pid is: its start, counted from the host's boot, which no clock step moves.

A pid alone does not name a process (the kernel reuses them), so the farm records a process's start beside its pid
and compares the two later. psutil's `create_time()` is that start on the wall clock: the kernel's count of ticks
since boot plus the boot time, which Linux works out again at every read from the wall clock. A clock step (NTP, a
virtual machine resumed) moves every process's `create_time()` by the step, and a 1 s rounding of the boot time can
move it by 1 s. Compared across such a step, a live process looked like another one: the vLLM reaper stopped
watching its worker, and a stopped farm's workers looked dead to `farm down`. The start since boot is the tick count
itself, the same at every read.
"""

from __future__ import annotations

import psutil

# Two reads of one process's start since boot differ by at most the boot time's rounding (1 s) if the boot time
# moved between the two reads `started_since_boot` makes; a pid reused within this much of the first is not a worry.
SAME_START_S = 1.5


def started_since_boot(pid: int) -> float:
    """When process `pid` started, in seconds after the host booted; psutil.Error when there is no such process."""
    started = psutil.Process(pid).create_time()  # a fresh Process: its cached value holds the boot time of now
    return started - psutil.boot_time()


def same_process(pid: int, since_boot: float) -> bool:
    """Whether `pid` runs and is the process that started `since_boot` (a value of `started_since_boot`); a
    process whose start cannot be read (not ours to read) counts as the same one."""
    try:
        return abs(started_since_boot(pid) - since_boot) < SAME_START_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True
