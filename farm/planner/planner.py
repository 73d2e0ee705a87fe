"""The planning loop: every interval, per model and role, signals -> policy -> guard -> actuator.

Each step reads the signals of every planned model, asks the configured policy (load or SLA) how many
workers each role should have, lets the guard apply bounds, cooldowns and step limits, holds further
scale-ups while workers it already asked for are still starting, and then scales (or, in dry run, only
says it would). Every decision is logged, counted in `farm_planner_*` metrics and published as JSON
in the Redis key `farm:planner:state` (the last decision per model and role; `farm status` shows it),
with changes also appended to the capped list `farm:planner:events`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from farm.config.planner import PlannerConfig
from farm.planner import telemetry
from farm.planner.actuators import Actuator, ActuatorError
from farm.planner.guard import Guard
from farm.planner.load_policy import LoadPolicy, Proposal
from farm.planner.profile import Profile
from farm.planner.signals import ModelSignals, RedisSignals, RoleSignals
from farm.planner.sla_policy import SlaPolicy
from farm.protocol.keys import PLANNER_EVENTS_KEY, PLANNER_STATE_KEY

log = logging.getLogger("farm.planner")

EVENTS_KEPT = 200
STARTUP_GRACE_S = 300.0  # a worker asked for longer ago than this is not waited for any more


@dataclass
class Decision:
    """One planning outcome for one model and role."""

    model: str
    role: str
    mode: str
    current: int  # what the actuator runs or is starting
    ready: int  # registered, heartbeating workers
    desired: int  # what the policy asked for
    target: int  # what the planner set (or would set, in dry run)
    action: str  # scale_up | scale_down | hold
    reason: str
    held: str = ""  # why target != desired (bounds, cooldown, step limit, workers starting)
    dry_run: bool = False
    applied: str = ""  # what the actuator did
    error: str = ""
    util: float | None = None
    ts: float = 0.0

    def line(self) -> str:
        what = {"scale_up": f"scale up {self.current} -> {self.target}",
                "scale_down": f"scale down {self.current} -> {self.target}"}.get(self.action, f"hold at {self.current}")
        extra = f" [{self.held}]" if self.held else ""
        prefix = "DRY RUN: would " if self.dry_run and self.action != "hold" else ""
        return f"{self.model}/{self.role}: {prefix}{what} (desired {self.desired}, ready {self.ready}): {self.reason}{extra}"


def profile_path(template: str, model: str) -> Path:
    from farm.config import PROJECT_ROOT

    p = Path(template.format(model=model))
    return p if p.is_absolute() else PROJECT_ROOT / p


class Planner:
    """Plans `models` with `cfg`; `signals` has `collect(model) -> ModelSignals`; no actuator = observe only."""

    def __init__(self, cfg: PlannerConfig, signals: Any, actuator: Actuator | None, models: list[str], *,
                 r: redis.Redis | None = None, profiles: dict[str, Profile] | None = None, clock=time.time):
        if cfg.mode == "sla":
            missing = [m for m in models if m not in (profiles or {})]
            if missing:
                raise ValueError(f"SLA mode needs an engine profile for {missing} (farm planner profile)")
        self.cfg = cfg
        self.signals = signals
        self.actuator = actuator
        self.models = list(models)
        self.r = r
        self.clock = clock
        self.dry_run = cfg.dry_run or actuator is None
        self.guard = Guard(cfg.cooldown_up_s, cfg.cooldown_down_s, cfg.max_step_up, cfg.max_step_down)
        self.load = LoadPolicy(cfg.load)
        self.sla = {m: SlaPolicy(cfg.sla, p) for m, p in (profiles or {}).items()}
        self.last: dict[tuple[str, str], Decision] = {}
        self.last_signals: dict[str, ModelSignals] = {}

    @classmethod
    def for_farm(cls, farm_cfg, r: redis.Redis, actuator: Actuator | None, cfg: PlannerConfig | None = None,
                 **kw: Any) -> Planner:
        """A planner reading the farm's Redis, with the farm's disaggregation rule and default model."""
        from farm.config.planner import planner_config

        cfg = cfg or planner_config(farm_cfg.planner)
        d = farm_cfg.disaggregation
        rule = {"always": 0, "never": 1 << 62}.get(d.mode, d.remote_min_uncached_tokens)
        models = cfg.models or [farm_cfg.default_model]
        profiles = None
        if cfg.mode == "sla":
            profiles = {}
            for m in models:
                path = profile_path(cfg.sla.profile, m)
                if not path.exists():
                    raise FileNotFoundError(f"SLA mode needs the engine profile {path}: run "
                                            f"`farm planner profile --model {m} --out {path}`")
                profiles[m] = Profile.load(path)
        return cls(cfg, RedisSignals(r, cfg.window_s, remote_min_tokens=rule), actuator, models, r=r,
                   profiles=profiles, **kw)

    # -- one step -------------------------------------------------------------------------------------
    def _current(self, model: str, role: str, sig: RoleSignals) -> int:
        return self.actuator.replicas(model, role) if self.actuator is not None else sig.workers

    def _proposals(self, model: str, sig: ModelSignals, current: dict[str, int]) -> dict[str, Proposal]:
        if self.cfg.mode == "sla":
            props = self.sla[model].plan(model, sig.traffic, current, sig.roles, self.cfg.interval_s)
            pred = self.sla[model].predicted(model)
            telemetry.PREDICTED_RATE.labels(model=model).set(pred.rate if pred else 0.0)
            return props
        return {role: self.load.propose((model, role), sig.roles.get(role) or RoleSignals(role), n)
                for role, n in current.items()}

    def step(self) -> list[Decision]:
        """Plan every model once; returns the decisions (also logged, counted and published)."""
        telemetry.STEPS.inc()
        out: list[Decision] = []
        now = self.clock()
        for model in self.models:
            try:
                sig = self.signals.collect(model)
                current = {role: self._current(model, role, sig.roles.get(role) or RoleSignals(role))
                           for role in self.cfg.roles}
            except (redis.RedisError, ActuatorError, OSError) as e:
                telemetry.ERRORS.labels(stage="signals").inc()
                log.warning("planner: cannot read the state of %s: %s", model, e)
                continue
            self.last_signals[model] = sig
            t = sig.traffic
            telemetry.record_traffic(model, t.rate, t.isl, t.osl, t.ttft_p90, t.itl_mean)
            for role, prop in self._proposals(model, sig, current).items():
                out.append(self._decide(model, role, current[role], sig.roles.get(role) or RoleSignals(role), prop,
                                        now))
        self.publish(out)
        return out

    def _decide(self, model: str, role: str, cur: int, rs: RoleSignals, prop: Proposal, now: float) -> Decision:
        key = (model, role)
        bounds = self.cfg.bounds_for(role)
        gate = self.guard.apply(key, cur, prop.desired, bounds, now)
        target, held = gate.target, gate.held
        last = self.guard.last_change(key)
        starting = cur - rs.workers
        if (target > cur and starting > 0 and cur >= bounds.min and last is not None
                and now - last < STARTUP_GRACE_S and not self.dry_run):
            target, held = cur, f"waiting for {starting} starting worker(s)"
        action = "hold" if target == cur else ("scale_up" if target > cur else "scale_down")
        util = prop.util if self.cfg.mode == "load" else None
        d = Decision(model, role, self.cfg.mode, cur, rs.workers, prop.desired, target, action, prop.reason, held,
                     self.dry_run, util=util, ts=now)
        if action != "hold":
            if not self.dry_run:
                try:
                    d.applied = self.actuator.scale(model, role, target)
                except (ActuatorError, OSError, ValueError) as e:
                    d.error = str(e)
                    telemetry.ERRORS.labels(stage="actuate").inc()
            if not d.error:
                self.guard.record(key, now)
                self.load.reset(key)
        telemetry.record_decision(model, role, cur, rs.workers, prop.desired, target if not d.error else cur,
                                util, self.dry_run)
        level = logging.INFO if action != "hold" or self.dry_run else logging.DEBUG
        if d.error:
            log.error("planner: %s: FAILED: %s", d.line(), d.error)
        else:
            log.log(level, "planner: %s%s", d.line(), f" ({d.applied})" if d.applied else "")
        self.last[key] = d
        return d

    # -- visibility -----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The JSON published in PLANNER_STATE_KEY."""
        models: dict[str, Any] = {}
        for (model, role), d in self.last.items():
            models.setdefault(model, {})[role] = asdict(d)
        traffic = {m: asdict(s.traffic) for m, s in self.last_signals.items()}
        return {"updated": self.clock(), "mode": self.cfg.mode, "dry_run": self.dry_run,
                "actuator": self.actuator.name if self.actuator else None, "interval_s": self.cfg.interval_s,
                "targets": {"ttft_ms": self.cfg.sla.ttft_ms, "itl_ms": self.cfg.sla.itl_ms}
                if self.cfg.mode == "sla" else None,
                "models": models, "traffic": traffic}

    def publish(self, decisions: list[Decision]) -> None:
        if self.r is None:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.set(PLANNER_STATE_KEY, json.dumps(self.state()))
            for d in decisions:
                if d.action != "hold":
                    pipe.lpush(PLANNER_EVENTS_KEY, json.dumps(asdict(d)))
            pipe.ltrim(PLANNER_EVENTS_KEY, 0, EVENTS_KEPT - 1)
            pipe.execute()
        except redis.RedisError as e:
            telemetry.ERRORS.labels(stage="publish").inc()
            log.warning("planner: cannot publish its state: %s", e)

    # -- the loop -------------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None, on_step=None) -> None:
        """Step every `interval_s` until `stop` is set; `on_step(decisions)` runs after each step."""
        stop = stop or threading.Event()
        log.info("planner: %s mode%s, every %.0fs, models %s, roles %s", self.cfg.mode,
                 " (dry run)" if self.dry_run else f", actuator {self.actuator.name}", self.cfg.interval_s,
                 self.models, self.cfg.roles)
        while not stop.is_set():
            t0 = time.monotonic()
            decisions = self.step()
            if on_step is not None:
                on_step(decisions)
            stop.wait(max(0.0, self.cfg.interval_s - (time.monotonic() - t0)))


def read_state(r: redis.Redis) -> dict[str, Any] | None:
    """The planner's last published state, or None when no planner ever ran on this Redis."""
    raw = r.get(PLANNER_STATE_KEY)
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None
