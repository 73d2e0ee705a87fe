"""The items of several blocking generators in the order they come, not one generator after another.

Each generator runs on a thread of its own (a greenlet, where gevent patched `threading`) and hands its items to
the caller over one queue. A streamed response's choices are generated together on the workers; read one after
another, a client saw nothing of the second choice until the first had ended, where vLLM's server sends every
choice's tokens as they come.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_ITEM, _RETURN, _RAISE = range(3)


def interleave(gens: Sequence[Generator[T, None, R]], name: str = "interleave") -> Generator[T, None, list[R]]:
    """Yield every item of `gens` as it comes, each generator's in its own order; return their return values in
    the order of `gens`. A generator's exception is raised here, at its turn in the queue. When the caller stops
    early (an exception, or this generator closed), each generator is closed after its next item: the caller must
    see to it that each one ends (a streamed choice ends once its request is cancelled)."""
    if len(gens) == 1:
        return [(yield from gens[0])]
    handed: queue.SimpleQueue[tuple[int, int, Any]] = queue.SimpleQueue()
    stop = threading.Event()

    def run(i: int, gen: Generator[T, None, R]) -> None:
        try:
            while not stop.is_set():
                try:
                    item = next(gen)
                except StopIteration as end:
                    handed.put((i, _RETURN, end.value))
                    return
                handed.put((i, _ITEM, item))
            gen.close()
        except BaseException as e:  # noqa: BLE001 - the caller's to raise
            handed.put((i, _RAISE, e))

    for i, gen in enumerate(gens):  # each in a copy of the caller's context: its log fields and trace go along
        threading.Thread(target=contextvars.copy_context().run, args=(run, i, gen), name=f"{name}-{i}",
                         daemon=True).start()
    results: dict[int, R] = {}
    try:
        while len(results) < len(gens):
            i, kind, value = handed.get()
            if kind == _ITEM:
                yield value
            elif kind == _RETURN:
                results[i] = value
            else:
                raise value
        return [results[i] for i in range(len(gens))]
    finally:
        stop.set()
