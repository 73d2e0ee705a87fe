"""--admission: do 1,000 concurrent streams get inside the engine, or wait outside it?

1,000 streams at once (max_tokens 1024, ignore_eos: none finishes during the test) against a farm with one
API process and one `backend: vllm` worker on the tiny model. Every 0.5 s for 30 s the worker's heartbeat is
read from the farm's Redis (`farm:alive:<worker_id>`, the ids in the `farm:workers` hash): requests inside the
engine = max(running + waiting, vllm_unfinished). Reported: the highest count within the first 20 s, when 95%
of the streams were inside (if ever), how many streams had a first token, and the errors (the router answers
503 when it thinks every worker is busy: counted and reported, never retried). Then every stream is closed
and the engine is watched until it is empty again: requests that outlive their client show up here. Then
(unless --no-admission-again) the same burst is sent once more to the same server: the first burst after a
start meets cold connection pools and threads, the second shows what is left once they have grown. The goal
is read on the first.

The heartbeat is refreshed every 2 s (farm.cluster.registry), so a sample can be up to that old. `vllm serve` gets
the same load as a reference, counted from its /metrics (num_requests_running + num_requests_waiting).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import requests

from bench.common import percentile, table
from bench.cpu import cpu_by_kind, summary
from bench.engine_speed import load
from bench.engine_speed.farm_api import redis_connect
from bench.engine_speed.load import Request
from bench.peers import contenders as pc
from bench.peers.load import chat_messages

Sampler = Callable[[], dict[str, Any]]


def farm_sampler(farm: Any) -> Sampler:
    """Engine counts from the workers' heartbeats in the farm's Redis."""
    r = redis_connect(farm.cfg.redis, timeout=3.0, decode_responses=True)

    def sample() -> dict[str, Any]:
        ids = sorted(r.hkeys("farm:workers"))
        raws = r.mget([f"farm:alive:{w}" for w in ids]) if ids else []
        out: dict[str, Any] = {"running": 0, "waiting": 0, "vllm_unfinished": 0, "heartbeat_age_s": None,
                               "workers": len(ids)}
        for raw in raws:
            if not raw:
                continue
            hb = json.loads(raw)
            for k in ("running", "waiting", "vllm_unfinished"):
                out[k] += int(hb.get(k) or 0)
            if hb.get("ts"):
                age = time.time() - float(hb["ts"])
                out["heartbeat_age_s"] = round(max(age, out["heartbeat_age_s"] or 0.0), 2)
        out["inside"] = max(out["running"] + out["waiting"], out["vllm_unfinished"])
        return out

    return sample


def vllm_sampler(base_url: str) -> Sampler:
    """Engine counts from `vllm serve`'s Prometheus metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    def sample() -> dict[str, Any]:
        vals = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
        for fam in text_string_to_metric_families(requests.get(base_url + "/metrics", timeout=5).text):
            for s in fam.samples:
                if s.name in vals:
                    vals[s.name] += s.value
        running, waiting = int(vals["vllm:num_requests_running"]), int(vals["vllm:num_requests_waiting"])
        return {"running": running, "waiting": waiting, "inside": running + waiting}

    return sample


def _safe(sample: Sampler) -> dict[str, Any]:
    try:
        return sample()
    except Exception as e:  # noqa: BLE001 - a missed sample is recorded, not fatal
        return {"inside": None, "sample_error": f"{type(e).__name__}: {e}"[:200]}


async def _hold(base_url: str, model: str, streams: int, max_tokens: int, seconds: float, interval: float,
                sample: Sampler, tag: str) -> tuple[list[Request], list[dict[str, Any]]]:
    url = base_url.rstrip("/") + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    recs = [Request(i, 0) for i in range(streams)]
    samples: list[dict[str, Any]] = []
    async with load.session(seconds + 600) as s:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(load.stream_chat(s, url, load.request_body(model, chat_messages(tag, i),
                                                                                max_tokens), rec, timeout))
                 for i, rec in enumerate(recs)]
        while (t := time.perf_counter() - t0) < seconds:
            st = await asyncio.to_thread(_safe, sample)
            samples.append({"t": round(t, 2), **st, "first_token": sum(r.first is not None for r in recs),
                            "errors": sum(r.error is not None for r in recs),
                            "ended": sum(r.end is not None for r in recs)})
            await asyncio.sleep(max(0.0, interval - (time.perf_counter() - t0 - t)))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return recs, samples


def hold_streams(base_url: str, model: str, sample: Sampler, streams: int, max_tokens: int, seconds: float,
                 window_s: float, drain_s: float = 60.0, interval: float = 0.5, tag: str = "adm") -> dict[str, Any]:
    """Open `streams` streams, sample the engine every `interval` for `seconds`, close them, watch it drain."""
    load.raise_open_files(2 * streams + 512)
    with cpu_by_kind() as cpu:
        recs, samples = load.run_async(lambda: _hold(base_url, model, streams, max_tokens, seconds, interval,
                                                     sample, tag))
    closed = time.perf_counter()
    drain: list[dict[str, Any]] = []
    while True:
        st = _safe(sample)
        drain.append({"t": round(time.perf_counter() - closed, 2), **st})
        if st.get("inside") == 0 or time.perf_counter() - closed > drain_s:
            break
        time.sleep(1.0)
    need = int(0.95 * streams + 0.999)
    in_window = [x for x in samples if x["t"] <= window_s and x.get("inside") is not None]
    reached = next((x["t"] for x in samples if (x.get("inside") or 0) >= need), None)
    # errors that happened before the streams were closed (not the client's own cancellations)
    errors = [r.error for r in recs if r.error and not r.error.startswith("cancelled")]
    ttft = [r.ttft * 1000 for r in recs if r.ttft is not None]
    return {
        "streams": streams, "max_tokens": max_tokens, "seconds": seconds, "window_s": window_s,
        "peak_inside_in_window": max((x["inside"] for x in in_window), default=None),
        "peak_inside": max((x.get("inside") or 0 for x in samples), default=None),
        "needed_95": need, "reached_95_at_s": reached,
        "share_inside_in_window": (max((x["inside"] for x in in_window), default=0) / streams),
        "first_token": sum(r.first is not None for r in recs),
        "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
        "errors": len(errors), "error_kinds": dict(Counter(load.error_kind(e) for e in errors)),
        "error_examples": sorted(set(errors))[:5],
        "statuses": dict(Counter(str(r.status) for r in recs)),
        "drained": drain[-1].get("inside") == 0, "drain_s": drain[-1]["t"], "drain_last": drain[-1],
        "cpu_s": cpu,
        "samples": samples, "drain_samples": drain,
    }


def _say(label: str, r: dict[str, Any]) -> None:
    print(f"    {label}: peak inside the engine within {r['window_s']:.0f} s: {r['peak_inside_in_window']} of "
          f"{r['streams']} (95% at {r['reached_95_at_s']} s); first token: {r['first_token']}; errors: {r['errors']} "
          f"{r['error_kinds'] or ''}; after closing: {'empty' if r['drained'] else 'NOT empty'} after "
          f"{r['drain_s']:.0f} s; CPU s while holding: {summary(r['cpu_s'])}", flush=True)


def run_admission(s: pc.Setup, streams: int, max_tokens: int, seconds: float, window_s: float,
                  contenders: tuple[str, ...] = ("farm-vllm", "vllm-serve"), again: bool = True) -> dict[str, Any]:
    """Per contender the first burst after the warm-up (its figures at the top level: the goal's), and with
    `again` the same burst once more on the same server (under "again": what is left once the server has
    seen that many streams, e.g. connection pools and threads grown)."""
    out: dict[str, Any] = {}
    for name in contenders:
        print(f"[admission] {name}: {streams} streams x {max_tokens} tokens, {seconds:.0f} s", flush=True)
        rec: dict[str, Any] = {}
        out[name] = rec
        try:
            cm = pc.farm(s, "vllm", 1) if name == "farm-vllm" else pc.vllm_serve(s)
            with cm as ep:
                rec.update(start_s=ep.start_s, commands=ep.commands)
                load.warm_up(lambda tag, n, k, m, ep=ep: load.run_level(ep.base_url, ep.model, tag, n, k, m))
                sampler = farm_sampler(ep.farm) if ep.farm is not None else vllm_sampler(ep.base_url)
                rec.update(hold_streams(ep.base_url, ep.model, sampler, streams, max_tokens, seconds, window_s))
                _say("first burst", rec)
                if again:
                    rec["again"] = hold_streams(ep.base_url, ep.model, sampler, streams, max_tokens, seconds,
                                                window_s, tag="adm2")
                    _say("same burst again", rec["again"])
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"  !! admission {name} failed: {rec['error'][:500]}", flush=True)
    return out


def admission_table(res: dict[str, Any]) -> str:
    rows = []
    for name, rec in res.items():
        if "streams" not in rec:
            rows.append([name, "-", "-", "-", "-", "-", "-", rec.get("error", "")[:80]])
            continue
        for label, r in ((name, rec), (f"{name} (again)", rec.get("again"))):
            if r:
                rows.append([label, r["streams"], r["peak_inside_in_window"], r["reached_95_at_s"], r["first_token"],
                             r["errors"], "yes" if r["drained"] else f"NO ({r['drain_last'].get('inside')} left)",
                             str(r["error_kinds"] or "")])
    return table(["contender", "streams", "peak inside (window)", "95% inside at s", "first token", "errors",
                  "empty after close", "error kinds"], rows, digits=1)


def sample_table(r: dict[str, Any], every: int = 4) -> str:
    """The samples, thinned (every `every`-th), to show how admission ramps."""
    xs = r.get("samples", [])[::every]
    return table(["t s", "inside", "running", "waiting", "vllm_unfinished", "first token", "errors"],
                 [[x["t"], x.get("inside"), x.get("running"), x.get("waiting"), x.get("vllm_unfinished"),
                   x["first_token"], x["errors"]] for x in xs], digits=1)
