"""The router (`router`: mode, cost, admission, the cost prior) and `disaggregation`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from farm.config.base import Section


class CostPrior(Section):
    """Step costs the router assumes for a worker until it (or a live worker of its model) has measured its
    own (farm.engine.step_costs); the defaults are SmolLM2-135M on 2 CPU cores (config/profiles/), slow
    enough to keep a cached prefix worth more than a little load when the hardware is unknown."""

    prefill_ms_per_block: float = Field(36.0, gt=0)
    prefill_step_ms: float = Field(85.0, ge=0)
    decode_step_ms: float = Field(32.0, ge=0)
    decode_ms_per_block: float = Field(0.7, ge=0)


class RouterConfig(Section):
    # kv: the cost below over the KV index and load; least-loaded: fewest outstanding requests, cache-blind
    mode: Literal["kv", "least-loaded", "round-robin", "random"] = "kv"
    # measured: seconds of latency a placement adds (its TTFT, the stall of the requests decoding there, its
    # decode and theirs) from each worker's measured step costs (farm.router.policy);
    # dynamo: Dynamo's overlap_weight x blocks to prefill + active blocks
    cost: Literal["measured", "dynamo"] = "measured"
    overlap_weight: float = Field(1.0, ge=0)  # cost: dynamo only
    ttft_target_ms: float = Field(30000, ge=0)  # a worker predicted slower than this (queueing) is busy; 0 = off
    cost_prior: CostPrior = CostPrior()
    temperature: float = Field(0.0, ge=0)
    use_kv_events: bool = True
    approx_ttl_s: float = Field(120, gt=0)
    prediction_ttl_s: float = Field(10, gt=0)
    tier_weights: dict[str, float] = Field(default_factory=lambda: {"device": 1.0, "host": 0.8, "disk": 0.5})

    @model_validator(mode="after")
    def _tiers_named(self) -> RouterConfig:
        if set(self.tier_weights) != {"device", "host", "disk"}:
            raise ValueError("router.tier_weights needs exactly the keys device, host and disk")
        return self
    busy_threshold: float = Field(0.95, ge=0)
    # a request that finds every worker's KV cache above busy_threshold waits this long for room (requests
    # finishing) before its 503, as an engine's own queue would hold it; 0 = refuse at once
    admission_wait_s: float = Field(10, ge=0)
    retry_after_s: int = Field(2, ge=1)
    placement_timeout_s: float = Field(5, gt=0)


class DisaggregationConfig(Section):
    # conditional: remote prefill only when it pays; always: every request (fails without prefill
    # workers); never: decode workers prefill everything locally.
    mode: Literal["conditional", "always", "never"] = "conditional"
    remote_min_uncached_tokens: int = Field(1000, ge=0)
    max_prefill_queue: int = Field(2, ge=1)
