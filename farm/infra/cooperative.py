"""CPU-bound calls off the gevent hub, where there is one.

The API runs under gunicorn's gevent worker: every connection is a greenlet on one OS thread, so a call
that computes for 50 ms without yielding (an ONNX or torch forward) stalls every open stream for those
50 ms. `offload(fn, ...)` runs such a call on gevent's pool of native threads instead and lets the calling
greenlet wait cooperatively; ONNX Runtime and torch release the GIL while they compute, so the hub keeps
delivering tokens meanwhile. In a process that gevent has not monkey-patched (workers, batch drivers,
tests, scripts) the call simply runs in place.

Only pure computation belongs here: the function must not touch sockets, Redis or gevent locks, which
belong to the hub's thread. Libraries do not always keep to that: spaCy's forward (the PII pass) takes a
`threading.Lock` of thinc's, gevent's once the process is patched, on every call, and imports two optional
modules (under importlib's per-module locks, gevent's too) the first time a thread runs it. Two pool threads
contending for such a lock can wait forever: gevent's locks hand over between native threads without a hub
by spinning on a native lock, and a wake-up can be lost (gevent/gevent#1744, and #890 for the advice: no
gevent blocking API on pool threads). It hung a request of the 500-stream test for good (py-spy: a pool
thread in `_spin_on_native_lock` under `_ModuleLock.acquire`, from thinc's `get_ops`). Such a library runs on
a `Lane`: one native thread of its own, one call at a time, so nothing else ever contends for its locks.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def cooperative() -> bool:
    """Whether this process runs on gevent's hub (gevent monkey-patched the socket module)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and monkey.is_module_patched("socket")


def offload(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, on gevent's thread pool when the process is cooperative (exceptions re-raised here)."""
    if not cooperative():
        return fn(*args)
    import gevent

    return gevent.get_hub().threadpool.apply(fn, args)


class Lane:
    """One native thread of its own for a library that takes gevent's locks on its calls (see the module's
    docstring): calls queue for that thread and run on it one at a time. `submit(fn, ...)` starts a call and returns
    a function that waits for its result (cooperatively under gevent), so the caller can compute meanwhile; `run`
    is both at once. Without gevent the lane is a plain thread (`ThreadPoolExecutor` of one), the same shape."""

    def __init__(self) -> None:
        self._pool: Any = None  # made on the first call in each process: a forked child has none of its threads
        self._pid = 0
        self._made = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: object) -> Callable[[], T]:
        pool = self._pool_here()
        if isinstance(pool, ThreadPoolExecutor):
            return pool.submit(fn, *args).result
        return pool.spawn(fn, *args).get

    def _pool_here(self) -> Any:
        """This process's thread: gevent's pool of one under gevent, else an executor of one."""
        if self._pool is None or self._pid != os.getpid():
            with self._made:  # nothing in here waits, so under gevent no other greenlet can be kept out
                if self._pool is None or self._pid != os.getpid():
                    if cooperative():
                        from gevent.threadpool import ThreadPool

                        self._pool = ThreadPool(1)
                    else:
                        self._pool = ThreadPoolExecutor(1, thread_name_prefix="farm-lane")
                    self._pid = os.getpid()
        return self._pool

    def run(self, fn: Callable[..., T], *args: object) -> T:
        return self.submit(fn, *args)()


def pause() -> None:
    """Let the hub run the other greenlets, where there is a hub: between the steps of a loop that computes on it
    (each step short, the whole loop not); nothing in a plain process."""
    if cooperative():
        import gevent

        gevent.sleep(0)
