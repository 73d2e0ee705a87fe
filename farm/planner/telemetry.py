"""Prometheus metrics of the planner (prefix `farm_planner_`): what it saw, wanted, and did."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

REPLICAS = Gauge("farm_planner_replicas", "Replicas per model and role: current (actuator), ready (registered), "
                 "desired (policy), target (after bounds and cooldowns)", ["model", "role", "kind"])
UTILISATION = Gauge("farm_planner_utilisation", "Load-policy utilisation per ready worker (1.0 = full)",
                    ["model", "role"])
SCALING_EVENTS = Counter("farm_planner_scaling_events_total", "Replica changes made (or, in dry run, proposed)",
                         ["model", "role", "direction", "dry_run"])
STEPS = Counter("farm_planner_steps_total", "Planning steps run")
ERRORS = Counter("farm_planner_errors_total", "Planning steps or actuations that failed", ["stage"])
PREDICTED_RATE = Gauge("farm_planner_predicted_rate", "Request rate the SLA policy plans for (req/s)", ["model"])
OBSERVED = Gauge("farm_planner_observed", "Traffic seen in the last window: rate (req/s), isl/osl (tokens), "
                 "ttft_p90/itl_mean (seconds)", ["model", "what"])


def record_decision(model: str, role: str, current: int, ready: int, desired: int, target: int,
                    util: float | None, dry_run: bool) -> None:
    for kind, n in (("current", current), ("ready", ready), ("desired", desired), ("target", target)):
        REPLICAS.labels(model=model, role=role, kind=kind).set(n)
    if util is not None:
        UTILISATION.labels(model=model, role=role).set(util)
    if target != current:
        SCALING_EVENTS.labels(model=model, role=role, direction="up" if target > current else "down",
                              dry_run=str(dry_run).lower()).inc()


def record_traffic(model: str, rate: float, isl: float, osl: float, ttft_p90: float, itl_mean: float) -> None:
    for what, v in (("rate", rate), ("isl", isl), ("osl", osl), ("ttft_p90", ttft_p90), ("itl_mean", itl_mean)):
        OBSERVED.labels(model=model, what=what).set(v)
