"""Prometheus metrics of the farm, defined in one place (names: `farm_` prefix, units in the name)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from farm.protocol import FINISH_REASONS
from farm.protocol.keys import METRICS_EXPORTER_KEY, stats_key

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
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512))  # to the 300 s wait
ITL_SECONDS = Histogram("farm_itl_seconds", "Mean inter-token latency per request", ["model"],
                        buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1))


E2E_SECONDS = Histogram("farm_e2e_latency_seconds", "Request latency from submit to the last token", ["model"],
                        buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))  # max_request_s 1800


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
# the operator's remote jailbreak guard (semantic.jailbreak.remote): messages asked, and calls that failed (on_error)
SEMANTIC_REMOTE_ASKED = Counter("farm_semantic_remote_guard_messages_total", "Messages the remote jailbreak guard was "
                                "asked about (not counting answers remembered from the memo)")
SEMANTIC_REMOTE_ERRORS = Counter("farm_semantic_remote_guard_errors_total", "Calls to the remote jailbreak guard that "
                                 "failed (unreachable, timed out, an answer not over its labels): on_error decided")
SEMANTIC_REMOTE_SECONDS = Histogram("farm_semantic_remote_guard_seconds", "Time a request waited for the remote "
                                    "jailbreak guard (all its messages asked together), when it asked",
                                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
SEMANTIC_ROUTES = Counter("farm_semantic_routes_total", "MoM/auto requests by category and chosen model",
                          ["category", "model"])
SEMANTIC_SECONDS = Histogram("farm_semantic_layer_seconds", "Time in the semantic layer per request",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1))
MIGRATIONS = Counter("farm_migrations_total", "Requests moved off a worker that died mid-request, by outcome "
                     "(migrated | finished | limit | no_worker)", ["outcome"])
# Whether this API process reached Redis at its last scrape (1) or not (0): set by FarmCollector.refresh in every
# replica (exporting the farm-wide series or not), so an alert sees Redis down from any replica's /metrics.
REDIS_UP = Gauge("farm_redis_up", "1 when this API process reached Redis at its last /metrics scrape, else 0")
# Under gevent every waiting greenlet holds an event-loop watcher (a timer, a socket, an event), so a greenlet leaked
# per cancelled stream shows as a climbing count; counting greenlets themselves means walking the heap (~0.3 s).
API_LOOP_WATCHERS = Gauge("farm_api_loop_watchers", "Active gevent event-loop watchers in this API process "
                          "(every waiting greenlet holds one); 0 without gevent")


# Label values known up front exist (at 0) from the start, so a dashboard shows "none so far" rather than no
# data: the stages a request is shed at, where prefills run, the guards, cache results, migration outcomes.
for _metric, _label, _values in ((REQUESTS_SHED, "stage", ("prefill", "decode", "generate")),
                                 (PREFILL_MODE, "mode", ("local", "remote")),
                                 (SEMANTIC_BLOCKS, "guard", ("jailbreak", "pii", "fast_response")),
                                 (SEMANTIC_CACHE, "result", ("hit", "miss")),
                                 (MIGRATIONS, "outcome", ("migrated", "finished", "limit", "no_worker"))):
    for _value in _values:
        _metric.labels(**{_label: _value})


# Farm-wide counters kept in Redis hashes (field = label value), because the processes that count them
# (batch drivers) are not the ones Prometheus scrapes; the API's /metrics exports them (FarmCollector).
FARM_COUNTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {  # name -> (help, label, values known up front)
    "farm_batch_lines": ("Batch lines by outcome (completed, failed, retried)", "state",
                         ("completed", "failed", "retried")),
    "farm_batches": ("Batches that reached a final status", "status", ("completed", "failed", "expired", "cancelled")),
}


def count_farm(r, name: str, label_value: str, n: int = 1) -> None:
    """Add to a farm-wide counter (FARM_COUNTERS); failures are logged, never raised into the caller."""
    try:
        r.hincrby(stats_key(name), label_value, n)
    except Exception:  # noqa: BLE001 - a metric must not fail a batch line
        import logging

        logging.getLogger(__name__).warning("could not count %s{%s}", name, label_value)


# -- the workers' engine metrics under vLLM's names ---------------------------------------------------------
# Every worker publishes its engine's stats in its heartbeat (farm.cluster.registry, farm.engine.timings); the API
# exports them per worker with vLLM's names and labels (model_name, engine = the worker id; role added), so
# vLLM's Grafana dashboards, KEDA recipes and llm-d's scheduler read the farm as they read vLLM.
VLLM_LABELS = ("model_name", "engine", "role")
VLLM_GAUGES: dict[str, tuple[str, str]] = {  # vLLM's name -> (help, key of the engine's stats)
    "vllm:num_requests_running": ("Number of requests in model execution batches.", "running"),
    "vllm:num_requests_waiting": ("Number of requests waiting to be processed.", "waiting"),
    "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
    # its name before vLLM V1, which vLLM's example Grafana dashboard still reads
    "vllm:gpu_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage (vLLM's older name).", "kv_usage"),
}
VLLM_COUNTERS: dict[str, tuple[str, str]] = {  # exposed with the _total suffix, as vLLM's are
    "vllm:prefix_cache_queries": ("Prefix cache queries, in terms of number of queried tokens.",
                                  "prefix_query_tokens"),
    "vllm:prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.", "prefix_hit_tokens"),
    "vllm:num_preemptions": ("Cumulative number of preemption from the engine.", "preemptions"),
    "vllm:generation_tokens": ("Number of generation tokens processed.", "tokens_generated"),
    "vllm:prompt_tokens": ("Number of prefill tokens processed.", "prompt_tokens"),
}
# vllm:request_success_total{finished_reason}: requests ended, by vLLM's finish reasons (all present, 0 included)
REQUEST_SUCCESS = ("vllm:request_success", "Count of successfully processed requests.", "request_success")
VLLM_HISTOGRAMS: dict[str, str] = {  # farm.engine.timings.HISTOGRAMS, with vLLM's help texts
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    # farm.engine.timings.TOKEN_HISTOGRAMS (buckets 1, 2, 5, 10, ... up to the model's max_model_len)
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
}
# Names vLLM's example Grafana dashboard reads from before vLLM V1 -> the histogram exported under it too (vLLM
# V0's time_per_output_token was per token: the inter-token latency)
VLLM_OLD_NAMES = {"time_per_output_token_seconds": "inter_token_latency_seconds"}
ROLES = ("prefill", "decode", "both")
# Which role's workers take a shared queue's messages (farm.protocol.queues_for_role): the kind's own role,
# else aggregated workers, which consume every kind.
_QUEUE_ROLES = {"prefill": ("prefill", "both"), "decode": ("decode", "both"), "generate": ("both",)}

# Only one API replica exports the farm-wide series at a time (those read from Redis: the same in every
# replica), so `sum()` over them counts each worker once however many replicas Prometheus scrapes. The
# replica that holds this lease refreshes it on each scrape; if it stops being scraped, another takes over.
EXPORTER_TTL_S = 60
_EXPORTER_LEASE = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
return 1
"""
_EXPORTER_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class _FarmWide:
    """A Prometheus collector of the farm-wide series, as last read from Redis by FarmCollector.refresh."""

    def __init__(self) -> None:
        self.exporting = False
        self.queues: dict[str, int] = {}
        self.workers: list[tuple[Any, dict[str, Any]]] = []  # (WorkerInfo, its heartbeat stats)
        self.waiting: dict[tuple[str, str], float] = {}  # (model, role) -> requests waiting
        self.counters: dict[str, dict[str, float]] = {}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        if not self.exporting:
            return
        fam = GaugeMetricFamily("farm_queue_depth", "Messages waiting in a Celery queue", labels=["queue"])
        for q, n in self.queues.items():
            fam.add_metric([q], n)
        yield fam
        fam = GaugeMetricFamily("farm_requests_waiting", "Requests waiting for a worker of this model and role: "
                                "queued in Redis (the model's queues and the workers' own) and waiting in the "
                                "engines (the KEDA signal)", labels=["model", "role"])
        for (model, role), n in sorted(self.waiting.items()):
            fam.add_metric([model, role], n)
        yield fam
        counts: dict[tuple[str, str], int] = {}
        for w, _ in self.workers:
            counts[(w.model, w.role)] = counts.get((w.model, w.role), 0) + 1
        fam = GaugeMetricFamily("farm_workers", "Live workers", labels=["model", "role"])
        for (model, role), n in sorted(counts.items()):
            fam.add_metric([model, role], n)
        yield fam
        yield from self._kv_families(GaugeMetricFamily)
        for name, (doc, label, known) in FARM_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=[label])
            for value, n in sorted({**dict.fromkeys(known, 0.0), **self.counters.get(name, {})}.items()):
                fam.add_metric([value], n)
            yield fam
        yield from self._vllm_families(GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily)

    def _kv_families(self, gauge):
        blocks = gauge("farm_kv_blocks", "KV blocks per worker, tier and state", labels=["worker", "tier", "state"])
        ratio = gauge("farm_kv_hit_ratio", "Prompt tokens served from a worker's prefix cache / looked up, since "
                      "it started (rate() of vllm:prefix_cache_hits / _queries for a window)", labels=["worker"])
        for w, stats in self.workers:
            wid = w.worker_id
            total, free = stats.get("blocks_total", 0), stats.get("blocks_free", 0)
            blocks.add_metric([wid, "device", "used"], total - free)
            blocks.add_metric([wid, "device", "free"], free)
            blocks.add_metric([wid, "device", "cached"], stats.get("cached_blocks", 0))
            for tier in ("host", "disk"):
                t = (stats.get("tiers") or {}).get(tier)
                if t:
                    blocks.add_metric([wid, tier, "used"], t.get("used", 0))
                    blocks.add_metric([wid, tier, "free"], t.get("capacity_blocks", 0) - t.get("used", 0))
            q = stats.get("prefix_query_tokens", 0)
            ratio.add_metric([wid], stats.get("prefix_hit_tokens", 0) / q if q else 0.0)
        yield blocks
        yield ratio

    def _vllm_families(self, gauge, counter, histogram):
        for name, (doc, key) in VLLM_GAUGES.items():
            fam = gauge(name, doc, labels=list(VLLM_LABELS))
            for w, stats in self.workers:
                fam.add_metric([w.model, w.worker_id, w.role], float(stats.get(key) or 0))
            yield fam
        for name, (doc, key) in VLLM_COUNTERS.items():
            fam = counter(name, doc, labels=list(VLLM_LABELS))
            for w, stats in self.workers:
                fam.add_metric([w.model, w.worker_id, w.role], float(stats.get(key) or 0))
            yield fam
        name, doc, key = REQUEST_SUCCESS
        fam = counter(name, doc, labels=[*VLLM_LABELS, "finished_reason"])
        for w, stats in self.workers:
            for reason, n in {**dict.fromkeys(FINISH_REASONS, 0), **(stats.get(key) or {})}.items():
                fam.add_metric([w.model, w.worker_id, w.role, str(reason)], float(n or 0))
        yield fam
        for name, doc in {**VLLM_HISTOGRAMS, **{old: VLLM_HISTOGRAMS[new] for old, new in VLLM_OLD_NAMES.items()}
                          }.items():
            fam = histogram(f"vllm:{name}", doc, labels=list(VLLM_LABELS))
            for w, stats in self.workers:
                h = (stats.get("histograms") or {}).get(VLLM_OLD_NAMES.get(name, name))
                if h:
                    buckets = [(_le(le), c) for le, c in zip(h["le"], h["counts"], strict=True)]
                    fam.add_metric([w.model, w.worker_id, w.role], buckets, h["sum"])
            yield fam


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes it (+Inf, 0.5, 10.0)."""
    from prometheus_client.utils import floatToGoString

    return floatToGoString(bound)


_FARM_WIDE: _FarmWide | None = None


def _farm_wide() -> _FarmWide:
    global _FARM_WIDE
    if _FARM_WIDE is None:
        from prometheus_client import REGISTRY

        _FARM_WIDE = _FarmWide()
        REGISTRY.register(_FARM_WIDE)
    return _FARM_WIDE


class FarmCollector:
    """Farm-wide series read from Redis at scrape time: queue depths, the requests waiting per model and role,
    every worker's KV state and its engine's metrics under vLLM's names, the batch counters. Exported by one
    API replica at a time (METRICS_EXPORTER_KEY)."""

    def __init__(self, r, cfg):
        import os
        import socket
        import uuid

        self.r, self.cfg = r, cfg
        self.series = _farm_wide()
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lease = r.register_script(_EXPORTER_LEASE)
        self._release = r.register_script(_EXPORTER_RELEASE)

    def release(self) -> None:
        """Give the exporter's lease up (the process exits): another replica, or this process's successor, exports
        the farm-wide series at its next scrape instead of after the lease's 60 s."""
        try:
            self._release(keys=[METRICS_EXPORTER_KEY], args=[self.identity])
        except Exception:  # noqa: BLE001 - Redis gone: the lease lapses by itself
            pass

    def refresh(self) -> None:
        from farm.cluster import registry
        from farm.protocol import BATCH_QUEUE, queue_depths, queue_name
        from farm.protocol.queues import direct_queue

        try:
            self.series.exporting = bool(self._lease(keys=[METRICS_EXPORTER_KEY],
                                                     args=[self.identity, EXPORTER_TTL_S]))
            REDIS_UP.set(1)
            if not self.series.exporting:
                return
            workers = registry.live_workers(self.r)
            shared = [(m.name, k, queue_name(m.name, k)) for m in self.cfg.models for k in _QUEUE_ROLES]
            queues = [q for _, _, q in shared] + [direct_queue(w.worker_id) for w in workers] + [BATCH_QUEUE]
            depths = dict(zip(queues, queue_depths(self.r, queues), strict=True))
            beats = registry.heartbeats(self.r, [w.worker_id for w in workers])
            pipe = self.r.pipeline()
            for name in FARM_COUNTERS:
                pipe.hgetall(stats_key(name))
            counter_values = pipe.execute()
        except Exception:  # noqa: BLE001 - Redis down or slow (its client's short timeout): farm_redis_up 0, and no
            REDIS_UP.set(0)  # farm-wide series rather than the last ones read, which would say workers live on
            self.series.exporting = False
            return
        s = self.series
        s.counters = {name: {k.decode(): float(v) for k, v in raw.items()}
                      for name, raw in zip(FARM_COUNTERS, counter_values, strict=True)}
        s.queues = depths
        s.workers = [(w, beats[w.worker_id]) for w in workers if w.worker_id in beats]
        s.waiting = _waiting(self.cfg, shared, depths, s.workers)


def _waiting(cfg, shared: list[tuple[str, str, str]], depths: dict[str, int],
             workers: list[tuple[Any, dict[str, Any]]]) -> dict[tuple[str, str], float]:
    """Requests waiting per (model, role): in the model's shared queues (counted for the role that takes them),
    in each worker's own queue, and inside each worker's engine. Every configured model and role has a value,
    0 included, so an autoscaler sees the series before the first worker exists."""
    from farm.protocol.queues import direct_queue

    out: dict[tuple[str, str], float] = {(m.name, role): 0.0 for m in cfg.models for role in ROLES}
    live = {(w.model, w.role) for w, _ in workers}
    for model, kind, q in shared:
        roles = _QUEUE_ROLES[kind]
        role = next((r for r in roles if (model, r) in live), roles[0])
        out[(model, role)] = out.get((model, role), 0.0) + depths.get(q, 0)
    for w, stats in workers:
        key = (w.model, w.role)
        out[key] = out.get(key, 0.0) + depths.get(direct_queue(w.worker_id), 0) + float(stats.get("waiting") or 0)
    return out
