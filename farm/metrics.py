"""Prometheus metrics of the farm, defined in one place (names: `farm_` prefix, units in the name)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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


E2E_SECONDS = Histogram("farm_e2e_latency_seconds", "Request latency from submit to the last token", ["model"],
                        buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256))


def observe_latency(model: str, ttft_s: float | None, itl_s: float | None, e2e_s: float | None = None) -> None:
    if e2e_s is not None:
        E2E_SECONDS.labels(model=model).observe(e2e_s)
    if ttft_s is not None:
        TTFT_SECONDS.labels(model=model).observe(ttft_s)
    if itl_s is not None:
        ITL_SECONDS.labels(model=model).observe(itl_s)

REQUESTS = Counter("farm_requests_total", "Generation requests answered by the API", ["model", "status"])
# the semantic layer (farm.semantic, in the API before anything is queued)
SEMANTIC_CACHE = Counter("farm_semantic_cache_requests_total", "Semantic cache lookups by result (hit | miss)",
                         ["result"])
SEMANTIC_BLOCKS = Counter("farm_semantic_blocks_total", "Requests refused by a semantic guard", ["guard"])
SEMANTIC_ROUTES = Counter("farm_semantic_routes_total", "MoM/auto requests by category and chosen model",
                          ["category", "model"])
SEMANTIC_SECONDS = Histogram("farm_semantic_layer_seconds", "Time in the semantic layer per request",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1))
MIGRATIONS = Counter("farm_migrations_total", "Requests moved off a worker that died mid-request, by outcome "
                     "(migrated | finished | limit | no_worker)", ["outcome"])
QUEUE_DEPTH = Gauge("farm_queue_depth", "Messages waiting in a Celery queue", ["queue"])
KV_BLOCKS = Gauge("farm_kv_blocks", "KV blocks per worker, tier and state", ["worker", "tier", "state"])
WORKERS = Gauge("farm_workers", "Live workers", ["model", "role"])
KV_HIT_RATIO = Gauge("farm_kv_hit_ratio", "Prompt tokens served from a worker's prefix cache / looked up",
                     ["worker"])
BATCH_INFLIGHT = Gauge("farm_batch_inflight_lines", "Batch lines in flight in this batch-driver process")
BATCH_WINDOW = Gauge("farm_batch_window_lines",
                     "Batch lines a driver may have in flight now (small while interactive requests run)")


# Farm-wide counters kept in Redis hashes (field = label value), because the processes that count them
# (batch drivers) are not the ones Prometheus scrapes; the API's /metrics exports them (FarmCollector).
FARM_COUNTERS: dict[str, tuple[str, str]] = {
    "farm_batch_lines": ("Batch lines by outcome (completed, failed, retried)", "state"),
    "farm_batches": ("Batches that reached a final status", "status"),
}


def count_farm(r, name: str, label_value: str, n: int = 1) -> None:
    """Add to a farm-wide counter (FARM_COUNTERS); failures are logged, never raised into the caller."""
    try:
        r.hincrby(f"farm:stats:{name}", label_value, n)
    except Exception:  # noqa: BLE001 - a metric must not fail a batch line
        import logging

        logging.getLogger(__name__).warning("could not count %s{%s}", name, label_value)


class _RedisCounters:
    """A Prometheus collector yielding FARM_COUNTERS as last read from Redis by FarmCollector.refresh."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, float]] = {}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        for name, (doc, label) in FARM_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=[label])
            for value, n in sorted(self.values.get(name, {}).items()):
                fam.add_metric([value], n)
            yield fam


_REDIS_COUNTERS: _RedisCounters | None = None


def _redis_counters() -> _RedisCounters:
    global _REDIS_COUNTERS
    if _REDIS_COUNTERS is None:
        from prometheus_client import REGISTRY

        _REDIS_COUNTERS = _RedisCounters()
        REGISTRY.register(_REDIS_COUNTERS)
    return _REDIS_COUNTERS


class FarmCollector:
    """Farm-wide gauges read from Redis at scrape time: queue depths and every worker's KV state."""

    def __init__(self, r, cfg):
        self.r, self.cfg = r, cfg
        self.counters = _redis_counters()

    def refresh(self) -> None:
        import json

        from farm import registry
        from farm.protocol import BATCH_QUEUE, queue_depths, queue_name
        from farm.router.keys import direct_queue

        try:
            workers = registry.live_workers(self.r)
            queues = [queue_name(m.name, k) for m in self.cfg.models for k in ("prefill", "decode", "generate")]
            queues += [direct_queue(w.worker_id) for w in workers] + [BATCH_QUEUE]
            depths = queue_depths(self.r, queues)
            pipe = self.r.pipeline()
            for w in workers:
                pipe.get(registry.alive_key(w.worker_id))
            for name in FARM_COUNTERS:
                pipe.hgetall(f"farm:stats:{name}")
            res = pipe.execute()
        except Exception:  # noqa: BLE001 - Redis down: keep the last values, the API reports 503 elsewhere
            return
        n_counters = len(FARM_COUNTERS)
        res, counter_values = res[: len(res) - n_counters], res[len(res) - n_counters:]
        self.counters.values = {name: {k.decode(): float(v) for k, v in raw.items()}
                                for name, raw in zip(FARM_COUNTERS, counter_values, strict=True)}
        for q, n in zip(queues, depths, strict=True):
            QUEUE_DEPTH.labels(queue=q).set(n)
        WORKERS.clear()
        counts: dict[tuple[str, str], int] = {}
        for w in workers:
            counts[(w.model, w.role)] = counts.get((w.model, w.role), 0) + 1
        for (model, role), n in counts.items():
            WORKERS.labels(model=model, role=role).set(n)
        KV_BLOCKS.clear()
        KV_HIT_RATIO.clear()
        for w, raw in zip(workers, res, strict=True):
            stats = json.loads(raw) if raw else {}
            total, free = stats.get("blocks_total", 0), stats.get("blocks_free", 0)
            KV_BLOCKS.labels(worker=w.worker_id, tier="device", state="used").set(total - free)
            KV_BLOCKS.labels(worker=w.worker_id, tier="device", state="free").set(free)
            KV_BLOCKS.labels(worker=w.worker_id, tier="device", state="cached").set(stats.get("cached_blocks", 0))
            for tier in ("host", "disk"):
                t = stats.get("tiers", {}).get(tier)
                if t:
                    KV_BLOCKS.labels(worker=w.worker_id, tier=tier, state="used").set(t.get("used", 0))
                    KV_BLOCKS.labels(worker=w.worker_id, tier=tier, state="free").set(
                        t.get("capacity_blocks", 0) - t.get("used", 0))
            q = stats.get("prefix_query_tokens", 0)
            KV_HIT_RATIO.labels(worker=w.worker_id).set(stats.get("prefix_hit_tokens", 0) / q if q else 0.0)
