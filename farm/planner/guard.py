"""Bounds, cooldowns and step limits, shared by both policies.

A policy says how many workers a role *should* have; the guard decides how far the planner may move
towards that now: never outside [min, max], at most `max_step_up`/`max_step_down` per decision, no
scale-up sooner than `cooldown_up_s` after the last change and no scale-down sooner than `cooldown_down_s`
after it (so a worker just added is not removed while it warms up). A count outside the bounds is
corrected at once, cooldown or not.
"""

from __future__ import annotations

from dataclasses import dataclass

from farm.config.planner import Bounds


@dataclass
class Gate:
    target: int
    held: str = ""  # why the target differs from what the policy wanted ("" when it does not)


class Guard:
    def __init__(self, cooldown_up_s: float, cooldown_down_s: float, max_step_up: int = 1,
                 max_step_down: int = 1):
        self.cooldown_up_s = cooldown_up_s
        self.cooldown_down_s = cooldown_down_s
        self.max_step_up = max_step_up
        self.max_step_down = max_step_down
        self._last_change: dict[tuple[str, str], float] = {}

    def last_change(self, key: tuple[str, str]) -> float | None:
        return self._last_change.get(key)

    def apply(self, key: tuple[str, str], current: int, desired: int, bounds: Bounds, now: float) -> Gate:
        """The count to set now for `key` = (model, role), given the policy's `desired` count."""
        if current < bounds.min:
            return Gate(bounds.min, f"below min {bounds.min}")
        if current > bounds.max:
            return Gate(bounds.max, f"above max {bounds.max}")
        want = min(max(desired, bounds.min), bounds.max)
        held = ""
        if want != desired:
            held = f"bounded to [{bounds.min}, {bounds.max}]"
        if want == current:
            return Gate(current, held)
        last = self._last_change.get(key)
        since = now - last if last is not None else float("inf")
        if want > current:
            if since < self.cooldown_up_s:
                return Gate(current, f"scale-up cooldown ({self.cooldown_up_s - since:.0f}s left)")
            step = min(want - current, self.max_step_up)
            target = current + step
        else:
            if since < self.cooldown_down_s:
                return Gate(current, f"scale-down cooldown ({self.cooldown_down_s - since:.0f}s left)")
            step = min(current - want, self.max_step_down)
            target = current - step
        if target != want:
            held = (held + "; " if held else "") + f"step limited to {step}"
        return Gate(target, held)

    def record(self, key: tuple[str, str], now: float) -> None:
        """Remember that `key` was just changed (starts both cooldowns)."""
        self._last_change[key] = now
