"""Scaling a running farm's workers on this machine: what the planner's local actuator (farm.planner.actuators)
asks of the supervisor."""

from __future__ import annotations

import signal

from farm.supervisor.procs import WORKER_ROLES, Proc


class Scaling:
    """Farm's worker scaling (a part of Farm, which holds the state it uses)."""

    def workers(self, role: str, model: str | None = None) -> list[Proc]:
        """Running workers of a role (and model), oldest first, not counting those being retired."""
        model = model or self.cfg.default_model
        return [p for p in self.procs if p.role == role and p.model == model and not p.retiring and p.alive()]

    def scale(self, role: str, n: int, model: str | None = None) -> list[str]:
        """Start or retire workers until `n` of `role` serve `model`; returns the names changed.

        Retiring is Celery's warm shutdown (SIGTERM): the worker stops taking tasks, finishes every
        request it has, then exits; the newest workers are retired first. Requests already placed on
        a retiring worker's own queue are re-sent by the gateway once its heartbeat is gone."""
        if role not in WORKER_ROLES or n < 0:
            raise ValueError(f"cannot scale {role!r} to {n}")
        model = model or self.cfg.default_model
        current = self.workers(role, model)
        changed = []
        if n > len(current):
            taken = {p.name for p in self.procs}
            i = 0
            for _ in range(n - len(current)):
                i += 1
                while f"{role}-{i}" in taken:
                    i += 1
                name = f"{role}-{i}"
                taken.add(name)
                self._start_worker(name, role, model)
                changed.append(name)
        else:
            for p in current[n:][::-1]:
                p.retiring = True
                p.send(signal.SIGTERM)
                changed.append(p.name)
        self.write_state()
        return changed

    def reap_retired(self) -> None:
        """Forget retired workers that have exited (foreground `wait` does this too)."""
        for p in [p for p in self.procs if p.retiring and not p.alive()]:
            p.reap()
            self.procs.remove(p)
        self.write_state()
