"""farm.infra.interleave: several blocking generators read as their items come."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Generator

import pytest

from farm.infra.interleave import interleave


def paced(name: str, n: int, gap_s: float, fail_at: int | None = None,
          closed: threading.Event | None = None) -> Generator[str, None, str]:
    try:
        for i in range(n):
            time.sleep(gap_s)
            if i == fail_at:
                raise ValueError(f"{name} failed at {i}")
            yield f"{name}{i}"
        return f"{name} done"
    finally:
        if closed is not None:
            closed.set()


def drain(gen: Generator[str, None, list[str]]) -> tuple[list[str], list[str]]:
    items = []
    while True:
        try:
            items.append(next(gen))
        except StopIteration as end:
            return items, end.value


def test_items_come_as_they_come_each_in_order_and_the_returns_in_order_of_the_generators():
    items, returns = drain(interleave([paced("slow", 3, 0.09), paced("fast", 6, 0.03)]))
    assert returns == ["slow done", "fast done"]
    assert [x for x in items if x.startswith("slow")] == ["slow0", "slow1", "slow2"]
    assert [x for x in items if x.startswith("fast")] == [f"fast{i}" for i in range(6)]
    assert items.index("fast0") < items.index("slow0") and items.index("slow0") < items.index("fast5")


def test_each_generator_sees_the_callers_context():
    var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")
    var.set("req-1")

    def reads() -> Generator[str, None, None]:
        yield var.get()

    assert drain(interleave([reads(), reads()]))[0] == ["req-1", "req-1"]


def test_one_generator_runs_in_place():
    seen = []

    def here() -> Generator[str, None, int]:
        seen.append(threading.current_thread())
        yield "x"
        return 7

    assert drain(interleave([here()])) == (["x"], [7]) and seen == [threading.current_thread()]


def test_an_error_is_raised_at_its_turn_and_the_others_are_closed_after_their_next_item():
    closed = threading.Event()
    gen = interleave([paced("ok", 100, 0.02, closed=closed), paced("bad", 5, 0.03, fail_at=2)])
    items = []
    with pytest.raises(ValueError, match="bad failed at 2"):
        for x in gen:
            items.append(x)
    assert "bad0" in items and "bad1" in items
    assert closed.wait(2), "the other generator was closed once the caller stopped"


def test_a_caller_that_stops_early_closes_every_generator():
    flags = [threading.Event(), threading.Event()]
    gen = interleave([paced("a", 100, 0.01, closed=flags[0]), paced("b", 100, 0.01, closed=flags[1])])
    assert next(gen)
    gen.close()
    assert all(f.wait(2) for f in flags)
