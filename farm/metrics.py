"""Prometheus metrics of the farm, defined in one place (names: `farm_` prefix, units in the name)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

ROUTING_DECISIONS = Counter("farm_routing_decisions_total", "Routing decisions", ["mode", "stage"])
ROUTING_STAGE_SECONDS = Histogram(
    "farm_routing_stage_seconds", "Time spent per routing stage", ["stage"],
    buckets=(1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2),
)
ROUTER_PREDICTED_HIT_BLOCKS = Counter("farm_router_predicted_hit_blocks_total",
                                      "Request blocks the router expected to be cached on the chosen worker")
ROUTER_REQUEST_BLOCKS = Counter("farm_router_request_blocks_total", "Full prompt blocks routed")
REQUESTS_SHED = Counter("farm_requests_shed_total", "Requests refused with 503 because every worker was busy",
                        ["stage"])
PROMPT_TOKENS = Counter("farm_prompt_tokens_total", "Prompt tokens served", ["model"])
CACHED_TOKENS = Counter("farm_cached_prompt_tokens_total", "Prompt tokens served from the prefix cache",
                        ["model"])
COMPLETION_TOKENS = Counter("farm_completion_tokens_total", "Completion tokens generated", ["model"])
PREFILL_MODE = Counter("farm_prefill_total", "Prefills by where they ran", ["mode"])


def record_routing(mode: str, stage: str, timings_us: dict[str, float], overlap_blocks: int,
                   request_blocks: int) -> None:
    ROUTING_DECISIONS.labels(mode=mode, stage=stage).inc()
    for name, us in timings_us.items():
        ROUTING_STAGE_SECONDS.labels(stage=name).observe(us / 1e6)
    if stage != "decode":
        ROUTER_PREDICTED_HIT_BLOCKS.inc(overlap_blocks)
        ROUTER_REQUEST_BLOCKS.inc(request_blocks)


def record_usage(model: str, usage: dict[str, int], prefill_mode: str | None) -> None:
    """Token counters from a finished request's usage (what the workers really did)."""
    PROMPT_TOKENS.labels(model=model).inc(usage.get("prompt_tokens", 0))
    CACHED_TOKENS.labels(model=model).inc(usage.get("cached_tokens", 0))
    COMPLETION_TOKENS.labels(model=model).inc(usage.get("completion_tokens", 0))
    if prefill_mode:
        PREFILL_MODE.labels(mode=prefill_mode).inc()

TTFT_SECONDS = Histogram("farm_ttft_seconds", "Time to first token seen by the gateway", ["model"],
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64))
ITL_SECONDS = Histogram("farm_itl_seconds", "Mean inter-token latency per request", ["model"],
                        buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1))


def observe_latency(model: str, ttft_s: float | None, itl_s: float | None) -> None:
    if ttft_s is not None:
        TTFT_SECONDS.labels(model=model).observe(ttft_s)
    if itl_s is not None:
        ITL_SECONDS.labels(model=model).observe(itl_s)
