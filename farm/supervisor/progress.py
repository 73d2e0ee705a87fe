"""What `farm up` / `farm serve` print while they wait for the farm to become healthy.

One line per change of the components' states, and a reminder every `every_s` seconds while nothing changes
(a model can take minutes to load), e.g.

    farm: [  14s] redis up | api waiting | flower up | workers 1/2 ready (waiting: decode-1)
"""

from __future__ import annotations

import time
from typing import Any, TextIO


def _state(v: bool | None) -> str:
    return "up" if v else "waiting"


def describe(health: dict[str, Any]) -> str:
    """The component states of `Farm.health()` as one line (without the time)."""
    parts = [f"redis {_state(health.get('redis'))}"]
    for name in ("api", "flower"):
        if health.get(name) is not None:  # None: not part of this farm
            parts.append(f"{name} {_state(health[name])}")
    workers: dict[str, bool] = health.get("workers") or {}
    if workers:
        ready = sum(1 for ok in workers.values() if ok)
        waiting = [n for n, ok in workers.items() if not ok]
        parts.append(f"workers {ready}/{len(workers)} ready"
                     + (f" (waiting: {', '.join(waiting)})" if waiting else ""))
    return " | ".join(parts)


class ProgressPrinter:
    """A `progress` callback for Farm.wait_healthy that writes to `out` on change or every `every_s` seconds."""

    def __init__(self, out: TextIO, every_s: float = 10.0):
        self.out, self.every_s = out, every_s
        self.last: str | None = None
        self.last_t = 0.0

    def __call__(self, health: dict[str, Any], elapsed_s: float) -> None:
        line = describe(health)
        now = time.monotonic()
        if line == self.last and now - self.last_t < self.every_s:
            return
        self.last, self.last_t = line, now
        print(f"farm: [{elapsed_s:4.0f}s] {line}", file=self.out, flush=True)
