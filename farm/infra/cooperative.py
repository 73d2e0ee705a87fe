"""CPU-bound calls off the gevent hub, where there is one.

The API runs under gunicorn's gevent worker: every connection is a greenlet on one OS thread, so a call
that computes for 50 ms without yielding (an ONNX or torch forward) stalls every open stream for those
50 ms. `offload(fn, ...)` runs such a call on gevent's pool of native threads instead and lets the calling
greenlet wait cooperatively; ONNX Runtime and torch release the GIL while they compute, so the hub keeps
delivering tokens meanwhile. In a process that gevent has not monkey-patched (workers, batch drivers,
tests, scripts) the call simply runs in place.

Only pure computation belongs here: the function must not touch sockets, Redis or gevent locks, which
belong to the hub's thread.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

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


def pause() -> None:
    """Let the hub run the other greenlets, where there is a hub: between the steps of a loop that computes on it
    (each step short, the whole loop not); nothing in a plain process."""
    if cooperative():
        import gevent

        gevent.sleep(0)
