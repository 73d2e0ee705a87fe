"""A long mixed load against a farm of real processes, watching for leaks: memory, file descriptors and threads of
every process, Redis's memory and key count, and latency per window, each with its slope over the run.

    python -m bench.soak [--minutes 30] [--window-s 60] [--concurrency 4] [--out bench/out/soak.json]

`farm up`'s processes on this machine (farm.supervisor.Farm: redis-server, a prefill and a decode worker, the
gunicorn API) with the default model. The load mixes streamed and whole answers, prompts of several lengths
(some sharing a prefix, so the prefix cache and KV events churn) and clients that leave mid-stream (cancel
flags, aborted requests). Every window records, per process (its children included: the gunicorn worker),
RSS, open fds and threads, and Redis's used_memory and key count, and the window's TTFT/ITL percentiles and
errors. The slope of each series over the windows after the first (least squares, per hour) is the leak
signal: a process whose RSS keeps growing, fds or threads that climb, keys that pile up in Redis.
"""

from __future__ import annotations

import argparse
import itertools
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import requests

from bench.common import finish, goal, table
from farm.config import load_config
from farm.supervisor import Farm
from tests.conftest import free_port, make_farm_env
from tests.netfarm import StreamResult, chat_stream, percentiles

WARMUP_WINDOWS = 1  # windows left out of the slopes (caches and pools filling)
RSS_SLOPE_MB_PER_H = 50.0  # a process growing faster than this over the run is reported as a leak


def slope_per_hour(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (seconds), per hour; 0 with fewer than two points."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return 3600 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var else 0.0


def process_sample(pid: int) -> dict[str, float]:
    """RSS (MB), fds and threads of a process and all its descendants."""
    out = {"rss_mb": 0.0, "fds": 0.0, "threads": 0.0}
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with p.oneshot():
                out["rss_mb"] += p.memory_info().rss / 2**20
                out["fds"] += p.num_fds()
                out["threads"] += p.num_threads()
    except psutil.Error:
        pass
    return out


class Load:
    """`concurrency` client threads sending the mix until stopped; results collected per window."""

    def __init__(self, url: str, model: str, tokens: int, concurrency: int):
        self.url, self.model, self.tokens = url, model, tokens
        self.results: list[tuple[str, StreamResult]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)]
        self._counter = itertools.count()

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def take(self) -> list[tuple[str, StreamResult]]:
        with self._lock:
            out, self.results = self.results, []
        return out

    def _prompt(self, rng: random.Random) -> str:
        shared = "You are a careful assistant. Answer in full sentences. " * rng.choice((1, 4, 16))
        return shared + f"Question {next(self._counter)}: describe a {rng.choice(['river', 'city', 'machine'])}."

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            kind = rng.choices(["stream", "whole", "abandoned"], weights=[6, 3, 1])[0]
            prompt = self._prompt(rng)
            if kind == "stream":
                res = chat_stream(self.url, self.model, prompt, self.tokens, timeout_s=300)
            elif kind == "whole":
                res = self._whole(prompt)
            else:
                res = self._abandoned(prompt)
            with self._lock:
                self.results.append((kind, res))

    def _whole(self, prompt: str) -> StreamResult:
        res = StreamResult(started=time.monotonic())
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.tokens, "temperature": 0.7}
        try:
            r = requests.post(f"{self.url}/v1/chat/completions", json=body, timeout=300)
            res.status = r.status_code
            if r.status_code == 200:
                res.finish_reason = r.json()["choices"][0]["finish_reason"]
            else:
                res.error = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            res.error = str(e)
        res.elapsed_s = time.monotonic() - res.started
        return res

    def _abandoned(self, prompt: str) -> StreamResult:
        """A client that reads a few chunks and closes its connection (the farm must cancel the request)."""
        res = StreamResult(started=time.monotonic(), finish_reason="abandoned")
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        try:
            with requests.post(f"{self.url}/v1/chat/completions", json=body, stream=True, timeout=300) as r:
                for i, _line in enumerate(r.iter_lines()):
                    if i >= 6:
                        break
        except requests.RequestException as e:
            res.error = str(e)
        res.elapsed_s = time.monotonic() - res.started
        return res


def window_row(t: float, farm: Farm, results: list[tuple[str, StreamResult]]) -> dict[str, Any]:
    streams = [r for k, r in results if k == "stream"]
    errors = [r.error for _, r in results if r.error]
    r = farm_redis(farm)
    info = r.info("memory")
    row: dict[str, Any] = {
        "t_s": round(t, 1), "requests": len(results), "errors": len(errors),
        "ttft_ms": percentiles([s.ttft_s for s in streams if s.ttft_s is not None]),
        "itl_ms": percentiles([g for s in streams for g in s.gaps_s]),
        "redis_used_mb": round(info["used_memory"] / 2**20, 2), "redis_keys": r.dbsize(), "procs": {},
        "first_errors": errors[:3],
    }
    for p in farm.procs:
        row["procs"][p.name] = {k: round(v, 1) for k, v in process_sample(p.pid).items()}
    return row


def farm_redis(farm: Farm):
    from farm.infra.redis_client import connect

    return connect(farm.cfg.redis)


def slopes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-hour slopes of every series over the windows after the warm-up."""
    used = rows[WARMUP_WINDOWS:] if len(rows) > WARMUP_WINDOWS + 1 else rows
    ts = [r["t_s"] for r in used]
    out = [{"series": "redis used_memory (MB)", "per_hour": slope_per_hour(ts, [r["redis_used_mb"] for r in used])},
           {"series": "redis keys", "per_hour": slope_per_hour(ts, [r["redis_keys"] for r in used])},
           {"series": "TTFT p50 (ms)", "per_hour": slope_per_hour(ts, [r["ttft_ms"]["p50"] for r in used])}]
    for name in used[0]["procs"] if used else []:
        for key in ("rss_mb", "fds", "threads"):
            out.append({"series": f"{name} {key}", "per_hour": slope_per_hour(
                ts, [r["procs"].get(name, {}).get(key, 0.0) for r in used])})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--window-s", type=float, default=60)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default="bench/out/soak.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="farm-soak-"))
    env = make_farm_env(f"redis://127.0.0.1:{free_port()}/0", tmp)
    env["FARM_SEMANTIC__ENABLED"] = "false"
    cfg = load_config(environ=env)
    rows: list[dict[str, Any]] = []
    with Farm(cfg, prefill=1, decode=1, both=0, port=free_port(), flower=False, env=env).running(300) as farm:
        load = Load(f"http://127.0.0.1:{farm.api_port}", cfg.default_model, args.tokens, args.concurrency).start()
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < args.minutes * 60:
                time.sleep(min(args.window_s, max(0.0, args.minutes * 60 - (time.monotonic() - t0))))
                rows.append(window_row(time.monotonic() - t0, farm, load.take()))
                print({k: v for k, v in rows[-1].items() if k != "procs"}, flush=True)
        finally:
            load.stop()
    print(table(["t_s", "requests", "errors", "ttft_p50_ms", "itl_p50_ms", "redis_used_mb", "redis_keys"],
                [[r["t_s"], r["requests"], r["errors"], r["ttft_ms"]["p50"], r["itl_ms"]["p50"],
                  r["redis_used_mb"], r["redis_keys"]] for r in rows], digits=1))
    sl = slopes(rows)
    print(table(["series", "per_hour"], [[s["series"], s["per_hour"]] for s in sl], digits=1))
    worst_rss = max((s["per_hour"] for s in sl if s["series"].endswith("rss_mb")), default=0.0)
    goals = [goal("errors over the run", sum(r["errors"] for r in rows), 0, higher_is_better=False),
             goal("largest RSS growth of a process (MB/h)", worst_rss, RSS_SLOPE_MB_PER_H, higher_is_better=False)]
    finish(args.out, {"config": vars(args), "windows": rows, "slopes": sl}, goals)


if __name__ == "__main__":
    main()
