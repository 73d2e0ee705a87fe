"""Loaded by vLLM in each of its processes (entry point `vllm.general_plugins`): on a farm's CPU workers, vLLM's
engine core and model executor wait for each other by blocking, not by spinning.

Why: they pass every step through a shared-memory ring whose reader spins on `sched_yield` for a second after
its last read (vllm/distributed/device_communicators/shm_broadcast.py `SpinCondition`), so under load the engine
core spends most of a step spinning for its executor, and the executor spins for the next step. On a GPU host
those spins run beside many idle cores and save microseconds. On a CPU host they run on the cores that compute
the model and serve the farm's requests: the spinning engine core stretches its own executor's step. The reader
already has a blocking wait (a ZeroMQ notification the writer sends with every message); this makes it use that
wait at once instead of after a second of spinning.

The notification had to be made reliable first. The writer's PUB socket has a high-water mark of 1, and ZeroMQ
learns that its peer took the last message from a command the sending thread reads at most about once a
millisecond: a notification sent within that time of the previous one, long delivered, was dropped as if the pipe
were full. In a ping-pong of the two rings half the round trips lost one, and a blocking reader then waited for its
timeout. The writer now reads its socket's pending commands (`getsockopt(EVENTS)`, which is not throttled) before
each notification; a notification dropped after that means the one before it is still on its way, and the reader
it wakes finds both messages. While the ring is active a wait is still cut at `POLL_MS`, a bound on what a lost
notification could cost, not a polling rate; past a second of quiet vLLM's own idle wait is kept.

It acts only when the farm asked for it: `FARM_VLLM_RING_WAIT=block` in the environment vLLM's processes inherit,
set by farm.backends.vllm from `models[].vllm.ring_wait`. A `vllm serve` run from the same virtualenv, without it,
is untouched. vLLM loads general plugins more than once per process; patching is idempotent.
"""

from __future__ import annotations

import os
import time
from importlib.metadata import entry_points
from typing import Any

GROUP, NAME = "vllm.general_plugins", "farm_ring_wait"  # as pyproject.toml registers it
ENV = "FARM_VLLM_RING_WAIT"
BLOCK = "block"
POLL_MS = 20  # while active, the longest a lost notification (none seen since the fix) delays a read
ACTIVE_S = 1.0  # active: a read within this many seconds (vLLM's own busy period)


def register() -> None:
    """vLLM's plugin hook: make the shared-memory ring's readers block when the farm set `FARM_VLLM_RING_WAIT`."""
    if os.environ.get(ENV) != BLOCK:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    block_ring_waits(shm_broadcast.SpinCondition)


def block_ring_waits(cls: Any) -> None:
    """Patch `cls` (vLLM's SpinCondition) so a reader never spins and a writer's notification is not dropped: for
    every instance, those made before the plugin loaded included (an executor may create its rings first)."""
    if getattr(cls, "_farm_blocking", False):
        return
    import zmq  # vLLM's own dependency: imported here, where vLLM is loaded, not when the farm imports this module

    spin_wait = cls.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + ACTIVE_S:
            timeout_ms = POLL_MS if timeout_ms is None else min(timeout_ms, POLL_MS)
        self.busy_loop_s = 0.0
        return spin_wait(self, timeout_ms)

    def notify(self: Any) -> None:
        socket = self.local_notify_socket
        # take in the peer's "read it" first, so the high-water mark of 1 does not drop this notification
        socket.getsockopt(zmq.EVENTS)
        socket.send(b"\x00")

    cls.wait = wait
    cls.notify = notify
    cls._farm_blocking = True


def why_not_installed() -> str | None:
    """Why vLLM would not load this plugin: the farm not installed as a package (its entry point is package
    metadata: `pip install -e .`), or `VLLM_PLUGINS` naming others only; None when it would."""
    if not any(ep.name == NAME for ep in entry_points(group=GROUP)):
        return f"no {GROUP} entry point {NAME!r}: install the farm as a package (pip install -e .)"
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and NAME not in allowed.split(","):
        return f"VLLM_PLUGINS={allowed!r} does not name {NAME!r}"
    return None
