"""What a step of this worker's engine costs, measured while it serves: the router's cost weights.

The router predicts a request's time to first token on each worker from two lines fitted here, online:
prefill step seconds against the prompt tokens it computes, and decode step seconds against the KV blocks
of the sequences it decodes. Each is `base + slope x amount`, fitted by least squares over exponentially
weighted moments (recent steps count most; a worker whose machine gets busier is seen to get slower).
The first steps of an engine pay one-off allocations and are left out. Published in the worker's
heartbeat stats (`costs`), so every router sees every worker's own figures instead of a constant.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class LinearFit:
    """y ~ base + slope * x over exponentially weighted moments (weight `alpha` for each new point).

    With too little spread in x to tell base from slope, the line goes through the origin (slope = mean y
    / mean x: the cost per unit including its share of the overhead), which never underestimates."""

    def __init__(self, alpha: float = 0.1, warmup: int = 2, min_spread: float = 0.15):
        self.alpha = alpha
        self.warmup = warmup  # observations ignored first (first-call allocations, kernel selection)
        self.min_spread = min_spread  # coefficient of variation of x needed to fit a base
        self.seen = 0
        self.samples = 0
        self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, x: float, y: float) -> None:
        self.seen += 1
        if self.seen <= self.warmup or x <= 0 or y <= 0:
            return
        a = self.alpha if self.samples else 1.0
        self._x += a * (x - self._x)
        self._y += a * (y - self._y)
        self._xx += a * (x * x - self._xx)
        self._xy += a * (x * y - self._xy)
        self.samples += 1

    def fit(self) -> tuple[tuple[float, float], bool]:
        """((base, slope), separated), ((0, 0), False) before any observation counted. `separated`: whether the
        line has a base and a slope of its own (else it goes through the origin, and its slope, an average cost
        per unit, overstates what one more unit adds)."""
        if not self.samples:
            return (0.0, 0.0), False
        through_origin = (0.0, self._y / self._x)
        var = self._xx - self._x * self._x
        if var <= (self.min_spread * self._x) ** 2:
            return through_origin, False
        slope = (self._xy - self._x * self._y) / var
        base = self._y - slope * self._x
        if slope <= 0 or base < 0:
            return through_origin, False
        return (base, slope), True


class StepCosts:
    """Prefill and decode step costs of one engine; `observe_*` from the engine's thread, `snapshot` from
    any (the heartbeat's)."""

    def __init__(self, block_size: int, clock: Callable[[], float] = time.monotonic):
        self.block_size = block_size
        self.prefill = LinearFit()  # seconds per prefill step vs prompt tokens computed in it
        self.decode = LinearFit()  # seconds per decode step vs KV blocks of the sequences decoded
        self._clock = clock
        self._last_prefill: float | None = None  # when the last step of each kind was observed
        self._last_decode: float | None = None
        self._lock = threading.Lock()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.prefill.observe(tokens, seconds)
            self._last_prefill = self._clock()

    def observe_decode(self, active_blocks: int, seconds: float) -> None:
        with self._lock:
            self.decode.observe(active_blocks, seconds)
            self._last_decode = self._clock()

    def snapshot(self) -> dict[str, Any]:
        """The heartbeat's `costs`: milliseconds per prefill block (and per prefill step), per decode step
        and per active decode block, with how many steps each rests on (0: not measured yet) and how long
        ago the last step of each kind ran (`*_idle_s`: a worker that gets no work keeps old figures, which
        the router then trusts less), and whether each line separates a base from its slope (`*_separated`:
        without enough spread in the amounts it goes through the origin, and the router prefers a peer's line)."""
        with self._lock:
            (p_base, p_slope), p_separated = self.prefill.fit()
            (d_base, d_slope), d_separated = self.decode.fit()
            now = self._clock()
            return {"prefill_ms_per_block": round(p_slope * self.block_size * 1000, 4),
                    "prefill_step_ms": round(p_base * 1000, 4), "prefill_samples": self.prefill.samples,
                    "prefill_idle_s": _idle(now, self._last_prefill), "prefill_separated": p_separated,
                    "decode_step_ms": round(d_base * 1000, 4), "decode_ms_per_block": round(d_slope * 1000, 5),
                    "decode_samples": self.decode.samples, "decode_idle_s": _idle(now, self._last_decode),
                    "decode_separated": d_separated}


def _idle(now: float, last: float | None) -> float | None:
    return None if last is None else round(now - last, 1)
