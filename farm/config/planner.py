"""The planner's settings: pydantic models with defaults, loadable from an optional YAML file.

FarmConfig holds `PlannerConfig` as its `planner` section (config/default.yaml). `farm planner run --planner-config F` reads
a separate file instead (how the Helm chart's planner pod gets its settings).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from farm.config.base import Section

PlannerRole = Literal["prefill", "decode", "both"]


class Bounds(Section):
    """Replica limits of one role: the planner never goes below `min` or above `max`."""

    min: int = Field(0, ge=0)
    max: int = Field(4, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Bounds:
        if self.min > self.max:
            raise ValueError(f"bounds: min ({self.min}) must not exceed max ({self.max})")
        return self


class LoadPolicyConfig(Section):
    """Load-based scaling: per-worker utilisation against two thresholds (the gap is the hysteresis)."""

    scale_up_util: float = Field(0.8, gt=0)  # above this for `up_intervals` readings: add workers
    scale_down_util: float = Field(0.3, ge=0)  # below this for `down_intervals` readings: remove one
    up_intervals: int = Field(1, ge=1)
    down_intervals: int = Field(3, ge=1)
    # What one worker counts as "fully loaded" (utilisation 1.0) for each signal:
    prefill_tokens_per_worker: int = Field(4096, ge=1)  # prompt tokens placed and not yet prefilled
    decode_requests_per_worker: int = Field(16, ge=1)  # requests decoding at once
    queued_per_worker: int = Field(4, ge=1)  # messages waiting in the role's queues
    kv_util_weight: float = Field(1.0, ge=0)  # KV-cache use counts this much (0 ignores it)

    @model_validator(mode="after")
    def _band(self) -> LoadPolicyConfig:
        if self.scale_down_util >= self.scale_up_util:
            raise ValueError("load.scale_down_util must be below load.scale_up_util (the hysteresis band)")
        return self


class SlaPolicyConfig(Section):
    """SLA-based scaling: TTFT and ITL targets, the engine profile, and how to predict the next interval."""

    ttft_ms: float = Field(1000, gt=0)
    itl_ms: float = Field(80, gt=0)
    # measured by `farm planner profile`; {model} is the model name; relative paths: from the project root
    profile: str = "config/profiles/{model}.json"
    predictor: Literal["last", "ema"] = "ema"  # ema: follows rises at once, smooths falls
    ema_alpha: float = Field(0.5, gt=0, le=1)
    headroom: float = Field(1.1, ge=1.0)  # plan for this multiple of the predicted load
    scale_down_margin: float = Field(1.2, ge=1.0)  # a smaller count must also carry this much more load
    max_prefill_util: float = Field(0.85, gt=0, le=1)  # never plan a prefill queue hotter than this
    min_requests: int = Field(3, ge=0)  # fewer observations than this in a window: keep the counts


class KubernetesConfig(Section):
    """Where the worker Deployments live; credentials are the pod's service-account files."""

    api_server: str = ""  # default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    namespace: str = ""  # default: the service account's namespace file, else "default"
    deployment: str = "farm-{model}-{role}"  # {model} is the queue-safe, lower-case model name
    token_path: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_path: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    namespace_path: str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    timeout_s: float = Field(10, gt=0)


class PlannerConfig(Section):
    enabled: bool = False  # `farm planner run` works either way; this is for deployments that start it
    mode: Literal["load", "sla"] = "load"
    actuator: Literal["local", "kubernetes"] = "local"
    dry_run: bool = False  # decide, log and publish, but never change a replica count
    interval_s: float = Field(10, gt=0)  # one planning step per interval
    # rate, lengths and latencies are measured over this window; at most the 10 minutes the observations stream
    # keeps (farm.protocol.keys.OBS_KEEP_S)
    window_s: float = Field(10, gt=0, le=600)
    cooldown_up_s: float = Field(30, ge=0)  # after a change, no further scale-up for this long
    cooldown_down_s: float = Field(60, ge=0)  # after a change, no scale-down for this long
    max_step_up: int = Field(2, ge=1)  # workers added per decision at most
    max_step_down: int = Field(1, ge=1)  # workers removed per decision at most
    models: list[str] = Field(default_factory=list)  # empty: the farm's default model
    roles: list[PlannerRole] = Field(default_factory=lambda: ["prefill", "decode"])
    bounds: dict[str, Bounds] = Field(default_factory=lambda: {
        "prefill": Bounds(min=0, max=4), "decode": Bounds(min=1, max=4), "both": Bounds(min=0, max=4)})
    load: LoadPolicyConfig = LoadPolicyConfig()
    sla: SlaPolicyConfig = SlaPolicyConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()

    @model_validator(mode="after")
    def _roles_bounded(self) -> PlannerConfig:
        unknown = set(self.bounds) - {"prefill", "decode", "both"}
        if unknown:
            raise ValueError(f"planner.bounds: unknown roles {sorted(unknown)}")
        for role in self.roles:
            self.bounds.setdefault(role, Bounds())
        return self

    def bounds_for(self, role: str) -> Bounds:
        return self.bounds.get(role) or Bounds()


def load_planner_config(path: str | Path | None = None, data: dict[str, Any] | None = None) -> PlannerConfig:
    """Defaults, updated by a YAML file (a top-level `planner:` mapping or the section itself) or a dict."""
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read planner config {path}: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"planner config {path} must hold a mapping")
        section = raw.get("planner", raw)
        data = section if isinstance(section, dict) else {}
    try:
        return PlannerConfig.model_validate(data or {})
    except ValidationError as e:
        where = f" ({path})" if path else ""
        lines = [f"  planner.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ValueError(f"invalid planner configuration{where}:\n" + "\n".join(lines)) from None


def planner_config(section: PlannerConfig, path: str | Path | None = None) -> PlannerConfig:
    """The planner settings: from `path` when given, else `section` (the farm configuration's `planner`)."""
    if path is not None:
        return load_planner_config(path)
    return section
