"""KV-aware routing end to end with a real client: NVIDIA aiperf against the farm, all modes side by side.

    python -m bench.routing [--quick] [--out bench/out/routing.json]

For each router mode (kv, round-robin, random) a fresh farm with 4 aggregated workers on the default
model is started (same config otherwise; each worker has one torch thread and a deliberately small KV
cache with the lower KV tiers off, so that all the workload's prefixes fit in the farm but not in one
worker: where a request lands decides whether its prefix is cached). aiperf (installed into bench/.venv-aiperf by this script) drives
the same shared-prefix workload each time: a pool of long prefix prompts, short user turns, multi-turn
conversations, streaming, a fixed concurrency. Reported per mode: TTFT p50/p90/p99, ITL, request and
output-token throughput (from aiperf), and the measured prefix-cache hit ratio (cached / prompt tokens
from the farm's /metrics); the ideal hit ratio of the workload (every reusable full block reused, from
the prompts aiperf actually sent) and how close each mode gets. Goals (issue 3): kv TTFT p50 >= 3x
better than round-robin; kv hit ratio >= 90% of ideal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from bench.common import BENCH_DIR, OUT_DIR, finish, goal, table
from bench.farms import bench_farm
from farm.engine.hashing import block_hashes
from farm.models import model_dir
from farm.tokenization import chat_prompt_ids, get_tokenizer

AIPERF_VENV = BENCH_DIR / ".venv-aiperf"


def aiperf_bin() -> Path:
    exe = AIPERF_VENV / "bin" / "aiperf"
    if not exe.exists():
        print("installing aiperf into", AIPERF_VENV, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(AIPERF_VENV)], check=True)
        subprocess.run([str(AIPERF_VENV / "bin" / "pip"), "install", "-q", "aiperf"], check=True)
    return exe


def aiperf_profile(exe: Path, model: str, url: str, tokenizer_dir: Path, art: Path, w, timeout: float
                   ) -> tuple[dict, Path | None, float]:
    """aiperf's shared-prefix multi-turn workload against `url`: `w` has requests, concurrency, prefixes,
    prefix_tokens, output_tokens and turns; seeded, shuffled (aiperf's synthetic default, made explicit).
    Returns aiperf's summary JSON, its raw records file and the wall time; raises with aiperf's stderr."""
    cmd = [str(exe), "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
           "--streaming", "--tokenizer", str(tokenizer_dir), "--concurrency", str(w.concurrency),
           "--request-count", str(w.requests), "--prefix-prompt-pool-size", str(w.prefixes),
           "--prefix-prompt-length", str(w.prefix_tokens), "--prompt-input-tokens-mean", "48",
           "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(w.output_tokens),
           "--prompt-output-tokens-stddev", "0", "--conversation-turn-mean", str(w.turns),
           "--conversation-turn-stddev", "0", "--conversation-num", str(w.requests // max(w.turns, 1)),
           "--extra-inputs", "ignore_eos:true", "--random-seed", "7", "--dataset-sampling-strategy", "shuffle",
           "--export-level", "raw", "--artifact-dir", str(art), "--ui-type", "none"]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    shutil.rmtree(art, ignore_errors=True)  # a summary left by an earlier run must not be read as this one's
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    art.mkdir(parents=True, exist_ok=True)
    (art / "aiperf.log").write_text(" ".join(cmd) + "\n" + proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"aiperf failed against {url}:\n{proc.stderr[-3000:]}")
    summary = json.loads(next(art.rglob("profile_export_aiperf.json")).read_text())
    return summary, next(art.rglob("*raw.jsonl"), None), wall


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(requests.get(url, timeout=10).text):
        for s in fam.samples:
            if s.name in ("farm_prompt_tokens_total", "farm_cached_prompt_tokens_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def ideal_hit_ratio(raw: Path, tok, block_size: int) -> tuple[float, int]:
    """Reuse an infinite single cache would get: leading full blocks already seen, over prompt tokens."""
    seen: set[int] = set()
    reused = total = n = 0
    records = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()]
    records.sort(key=lambda r: r.get("start_perf_ns") or r.get("request_start_ns") or 0)
    for rec in records:
        payload = rec.get("payloads") or rec.get("payload") or rec.get("request") or {}
        if isinstance(payload, list):
            payload = payload[0] if payload else {}
        msgs = payload.get("messages")
        if not msgs:
            continue
        ids = chat_prompt_ids(tok, msgs)
        hs = block_hashes(ids, block_size)
        lead = 0
        for h in hs:
            if h not in seen:
                break
            lead += 1
        reused += min(lead * block_size, len(ids) - 1)
        total += len(ids)
        seen.update(hs)
        n += 1
    return (reused / total if total else 0.0), n


def run_mode(mode: str, args, exe: Path) -> dict:
    # KV tiers off: a host tier would hold every prefix for every worker and hide where requests land
    overrides = {"router": {"mode": mode, "overlap_weight": args.overlap_weight}, "engine": {"torch_threads": 1, "kv_cache_mb": args.kv_cache_mb,
                                                      "kv_tiers": {"host_mb": 0, "disk_mb": 0}}}
    with bench_farm(both=args.workers, api=True, overrides=overrides) as farm:
        cfg = farm.cfg
        base = f"http://127.0.0.1:{farm.api_port}"
        tok_dir = model_dir(cfg, cfg.model(cfg.default_model))
        before = scrape(base + "/metrics")
        art = OUT_DIR / f"aiperf-{mode}"
        summary, raw, wall = aiperf_profile(exe, cfg.default_model, base, tok_dir, art, args, args.timeout)
        after = scrape(base + "/metrics")
        prompt = after.get("farm_prompt_tokens_total", 0) - before.get("farm_prompt_tokens_total", 0)
        cached = after.get("farm_cached_prompt_tokens_total", 0) - before.get("farm_cached_prompt_tokens_total", 0)
        tok = get_tokenizer(cfg, cfg.default_model)
        ideal, n_ideal = ideal_hit_ratio(raw, tok, cfg.engine.block_size) if raw else (float("nan"), 0)
    return {"mode": mode, "wall_s": wall, "aiperf": summary, "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_ratio": cached / prompt if prompt else 0.0, "ideal_hit_ratio": ideal, "ideal_requests": n_ideal}


def metric(summary: dict, name: str, stat: str) -> float | None:
    m = summary.get(name) or summary.get("records", {}).get(name) or {}
    v = m.get(stat)
    return float(v) if v is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="kv,round-robin,random")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=640)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--kv-cache-mb", type=int, default=128)
    ap.add_argument("--overlap-weight", type=float, default=4.0,
                    help="router.overlap_weight: higher favours cache reuse over load balance")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--quick", action="store_true", help="a small run to check the plumbing")
    ap.add_argument("--out", default="bench/out/routing.json")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.prefixes, args.concurrency = 16, 2, 4
    exe = aiperf_bin()
    runs = [run_mode(m, args, exe) for m in args.modes.split(",")]
    rows = []
    for r in runs:
        s = r["aiperf"]
        rows.append([r["mode"], metric(s, "time_to_first_token", "p50"), metric(s, "time_to_first_token", "p90"),
                     metric(s, "time_to_first_token", "p99"), metric(s, "inter_token_latency", "p50"),
                     metric(s, "request_throughput", "avg"), metric(s, "output_token_throughput", "avg"),
                     r["hit_ratio"], r["ideal_hit_ratio"]])
    print(table(["mode", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms", "req/s", "out tok/s",
                 "hit ratio", "ideal"], rows))
    by = {r["mode"]: r for r in runs}
    goals = []
    if "kv" in by and "round-robin" in by:
        kv_ttft = metric(by["kv"]["aiperf"], "time_to_first_token", "p50") or float("nan")
        rr_ttft = metric(by["round-robin"]["aiperf"], "time_to_first_token", "p50") or float("nan")
        goals.append(goal("round-robin TTFT p50 / kv TTFT p50", rr_ttft / kv_ttft, 3.0))
    if "kv" in by:
        goals.append(goal("kv hit ratio / ideal", by["kv"]["hit_ratio"] / (by["kv"]["ideal_hit_ratio"] or 1), 0.9))
    finish(args.out, {"args": vars(args), "runs": runs}, goals)


if __name__ == "__main__":
    main()
