"""Health of a running farm: each process alive, Redis answering, the API ready, workers registered; and
waiting for it at start."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import requests

from farm.infra import redis_client, redis_server
from farm.supervisor.network import (
    _connect_host,
    _hostport,
)
from farm.supervisor.procs import (
    WORKER_ROLES,
    FarmStartError,
)


class HealthChecks:
    """Farm's health checks (a part of Farm, which holds the state they use)."""

    def health(self) -> dict[str, Any]:
        """What is up: redis, each worker (registered in its role), the API's /health, Flower."""
        from farm.cluster import registry

        out: dict[str, Any] = {"redis": redis_server.ping(self.cfg.redis), "workers": {},
                               "api": None, "flower": None}
        live: dict[str, Any] = {}
        if out["redis"]:
            r = redis_client.connect(self.cfg.redis, timeout=2.0)
            try:
                live = {w.worker_id: w for w in registry.live_workers(r)}
            except Exception:  # noqa: BLE001 - a half-started Redis is simply "not yet"
                live = {}
            finally:
                r.close()
        procs = {p.name: p for p in self.procs}
        for name, role, model in self.expected_workers:
            w, p = live.get(self.worker_id(name)), procs.get(name)
            # This very process, not a record left by an earlier run under the same name.
            fresh = bool(w and p and (w.pid == p.pid or w.started_at >= p.started_at - 1.0))
            out["workers"][name] = bool(fresh and w.role == role and w.model == model)
        if self.api_enabled:
            out["api"] = self._api_ready()
        if self.flower_enabled:
            out["flower"] = self._flower_ready()
        out["ready"] = bool(out["redis"] and all(out["workers"].values())
                            and out["api"] is not False and out["flower"] is not False)
        return out

    def _api_ready(self) -> bool:
        url = f"http://{_hostport(_connect_host(self.api_host), self.api_port)}/health"
        try:
            resp = requests.get(url, timeout=2)
            body = resp.json()
        except (requests.RequestException, ValueError):
            return False
        if resp.status_code != 200:
            return False
        counts = body.get("workers") if isinstance(body, dict) else None
        if isinstance(counts, dict):
            for model in self.models:
                got = counts.get(model) or {}
                for role in WORKER_ROLES:
                    if int(got.get(role, 0) or 0) < self.model_counts(model)[role]:
                        return False
        return True

    def _flower_ready(self) -> bool:
        url = f"http://{_hostport(_connect_host(self.flower_host), self.flower_port)}/healthcheck"
        auth = tuple(self.flower_auth.split(":", 1)) if ":" in self.flower_auth else None
        try:
            return requests.get(url, timeout=2, auth=auth).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout: float = 300.0, interval: float = 0.5,
                     progress: Callable[[dict[str, Any], float], None] | None = None) -> dict[str, Any]:
        """Poll until every component is up and every worker registered in its role.

        `progress(health, elapsed_s)` is called after every poll (farm up prints the component states with it).
        Raises FarmStartError as soon as a child exits (with its log tail), or when `timeout` passes
        (naming what is still missing, with the log tail of the first of those); KeyboardInterrupt once serve()
        has counted a stop signal, even if the interrupt its handler raised was swallowed (by a `__del__`).
        """
        start = time.monotonic()
        deadline = start + timeout
        while True:
            if self._stop_signals:  # serve()'s interrupt can be lost: raised inside a finalizer, Python drops it
                raise KeyboardInterrupt("stop signal during start-up")
            self.check_alive("while starting")
            h = self.health()
            if progress is not None:
                progress(h, time.monotonic() - start)
            if h["ready"]:
                return h
            if time.monotonic() >= deadline:
                missing = [n for n, ok in h["workers"].items() if not ok]
                missing += [c for c in ("redis", "api", "flower") if h[c] is False]
                first = next((p for p in self.procs if p.name == missing[0]), None) if missing else None
                raise FarmStartError(
                    f"the farm did not become healthy within {timeout:.0f}s; not ready: {', '.join(missing)}",
                    first.name if first else None, first.tail() if first else "",
                )
            time.sleep(interval)

    # -- running and stopping -----------------------------------------------------------------------
