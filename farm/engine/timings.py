"""Request phase timings of an engine, as vLLM measures them, for the worker's heartbeat.

vLLM's engine records per request: time in the queue (arrival to first scheduling), prefill (first scheduling
to first token), decode (first to last token), inference (first scheduling to last token), end to end
(arrival to last token), time to first token, and the latency of every token after the first (inter-token
latency, per token, not a per-request mean). `RequestTimings` records the same on the built-in engine's
thread; `from_prometheus` reads what vLLM's own engine recorded in this process. Both give the
`histograms` entry of an engine's `stats()`: {name: {"le": bounds, "counts": cumulative, "sum", "count"}},
with vLLM's metric names (without the `vllm:` prefix) and vLLM's buckets, which the API exports per worker
(farm.telemetry.prometheus) so vLLM's dashboards and autoscaling recipes work unchanged. `RequestTokens` adds, on
both engines, vLLM's per-request token series (prompt tokens, finish reasons, prompt and generation tokens per
request), counted once per request across a farm's prefill and decode workers.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from farm.protocol import FINISH_REASONS

# vLLM's bucket families (vllm/v1/metrics/buckets.py, vLLM 0.31)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)

# vLLM's histogram names (without "vllm:") -> buckets
HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "time_to_first_token_seconds": TTFT_BUCKETS,
    "inter_token_latency_seconds": ITL_BUCKETS,
    "request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    "request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
    "request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
    "e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "request_time_per_output_token_seconds": ITL_BUCKETS,  # a request's mean time per token after its first
}


# vLLM's per-request token histograms (without "vllm:"): buckets 1, 2, 5, 10, 20, 50, ... up to max_model_len
# (vLLM's build_1_2_5_buckets); vllm:request_success_total's finish reasons are farm.protocol.FINISH_REASONS
TOKEN_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens")


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's `request_tokens` bucket family: a 1-2-5 series up to `max_model_len`."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class Histogram:
    """Counts per bucket (Prometheus semantics: a value lands in the first bucket whose bound is >= it)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict[str, Any]:
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return {"le": [*self.bounds, float("inf")], "counts": cumulative, "sum": self.sum, "count": total}


class _Times:
    __slots__ = ("arrival", "scheduled", "first_token", "last_token", "tokens")

    def __init__(self, arrival: float):
        self.arrival = arrival
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.tokens = 0  # sampled here


class RequestTimings:
    """Phase timings of the built-in engine's requests. Called on the engine thread only (no locks);
    `snapshot` may run on another thread (the heartbeat) and reads plain lists."""

    def __init__(self) -> None:
        self.hist = {name: Histogram(bounds) for name, bounds in HISTOGRAMS.items()}
        self._reqs: dict[str, _Times] = {}

    def scheduled(self, request_id: str, arrival: float, resumed: bool = False) -> None:
        """A prefill chunk of the request is computed now; the first one ends its time in the queue. A
        request that arrives with its first token (a remote prefill's handle) has no TTFT of its own here."""
        t = self._reqs.get(request_id)
        if t is not None:
            return
        now = time.monotonic()
        t = self._reqs[request_id] = _Times(arrival)
        t.scheduled = now
        self.hist["request_queue_time_seconds"].observe(now - arrival)
        if resumed:
            t.first_token = t.last_token = now

    def token(self, request_id: str) -> None:
        """A token was sampled for the request: its first (TTFT, prefill time) or one more (ITL)."""
        t = self._reqs.get(request_id)
        if t is None or t.scheduled is None:
            return
        now = time.monotonic()
        t.tokens += 1
        if t.first_token is None:
            t.first_token = now
            self.hist["time_to_first_token_seconds"].observe(now - t.arrival)
            self.hist["request_prefill_time_seconds"].observe(now - t.scheduled)
        else:
            self.hist["inter_token_latency_seconds"].observe(now - (t.last_token or now))
        t.last_token = now

    def finished(self, request_id: str) -> None:
        """The request ended (any reason): its decode, inference and end-to-end times."""
        t = self._reqs.pop(request_id, None)
        if t is None or t.scheduled is None:
            return
        last = t.last_token or time.monotonic()
        if t.first_token is not None:
            self.hist["request_decode_time_seconds"].observe(last - t.first_token)
            # vLLM's mean_time_per_output_token: the decode time over the tokens after the first (0 for one token)
            self.hist["request_time_per_output_token_seconds"].observe(
                (last - t.first_token) / (t.tokens - 1) if t.tokens > 1 else 0.0)
        self.hist["request_inference_time_seconds"].observe(last - t.scheduled)
        self.hist["e2e_request_latency_seconds"].observe(last - t.arrival)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {name: h.snapshot() for name, h in self.hist.items()}


class RequestTokens:
    """The per-request series vLLM's Grafana dashboard reads, counted once per request across the farm:
    `vllm:prompt_tokens_total` by the engine that computes the prompt (a prefill worker's, or the worker that
    generates when nothing was prefilled elsewhere; a decode that imports the prompt's KV does not count it again),
    and, by the engine that generates the completion when the request ends, `vllm:request_success_total` by finish
    reason and the histograms of its prompt tokens, generation tokens and (vLLM's
    `request_max_num_generation_tokens`, the most generated by any of a request's n samples) generation tokens
    again: each of a response's n choices is a request of its own on the workers. Updated on one thread (the
    engine's, or vLLM's loop); `snapshot` may run on another (the heartbeat)."""

    def __init__(self, max_model_len: int):
        bounds = token_buckets(max_model_len)
        self.hist = {name: Histogram(bounds) for name in TOKEN_HISTOGRAMS}
        self.prompt_tokens = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)

    def prefilled(self, prompt_tokens: int) -> None:
        """This engine computed a request's prompt (prefix-cache hits included, as vLLM counts them)."""
        self.prompt_tokens += prompt_tokens

    def finished(self, reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        """A request this engine generated for ended (`reason` as the engine reports it: "error:..." is error)."""
        if reason not in self.success:
            reason = "error" if reason.startswith("error") else "stop"
        self.success[reason] += 1
        self.hist["request_prompt_tokens"].observe(prompt_tokens)
        self.hist["request_generation_tokens"].observe(generation_tokens)
        self.hist["request_max_num_generation_tokens"].observe(generation_tokens)

    def snapshot(self) -> dict[str, Any]:
        """{"prompt_tokens", "request_success": {reason: n}, "histograms": {name: Histogram.snapshot()}}."""
        return {"prompt_tokens": self.prompt_tokens, "request_success": dict(self.success),
                "histograms": {name: h.snapshot() for name, h in self.hist.items()}}


def from_prometheus(registry: Any = None, prefix: str = "vllm:") -> dict[str, dict[str, Any]]:
    """The HISTOGRAMS that vLLM's own stat logger recorded in this process's Prometheus registry, in
    `RequestTimings.snapshot`'s shape (summed over vLLM's engine indexes)."""
    if registry is None:
        from prometheus_client import REGISTRY as registry  # noqa: N811 - the process-wide default
    out: dict[str, dict[str, Any]] = {}
    # only these families: collecting all of vLLM's series took about 1.5 ms of every heartbeat
    names = [f"{prefix}{h}{suffix}" for h in HISTOGRAMS for suffix in ("", "_bucket", "_sum", "_count")]
    for family in registry.restricted_registry(names).collect():
        name = family.name.removeprefix(prefix)
        if not family.name.startswith(prefix) or name not in HISTOGRAMS:
            continue
        buckets: dict[float, float] = {}
        total = count = 0.0
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                total += s.value
            elif s.name.endswith("_count"):
                count += s.value
        if buckets:
            bounds = sorted(buckets)
            out[name] = {"le": bounds, "counts": [buckets[b] for b in bounds], "sum": total, "count": count}
    return out
