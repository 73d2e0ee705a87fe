"""A farm spread over network-namespace hosts (tests/netns.py): Redis, the API and worker hosts, each process started
with the same command as on a real machine (README, "Adding workers on a second machine"), plus a streaming chat
client that times every chunk. Shared by tests/test_netfaults.py and bench/netfaults.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import requests
import yaml

from tests.netns import Net

REDIS_PASSWORD = "netfaults-pw"  # Redis off loopback needs one
API_PORT = 8080
REDIS_PORT = 6379


@dataclass
class Host:
    """A worker host: its name (= its namespace's host name in the Net) and the worker's role."""

    name: str
    role: str

    @property
    def worker_id(self) -> str:
        return f"{self.role}-{self.name}@{self.name}"


class NetFarm:
    """Redis on host "redis", the API on host "api", one worker per `workers` host; `env` overrides settings."""

    def __init__(self, net: Net, model_dir: Path, tmp: Path, workers: Sequence[Host], env: dict[str, str],
                 max_model_len: int = 2048):
        from farm.config import load_config

        self.net, self.tmp, self.workers = net, tmp, list(workers)
        cfg = load_config(environ={})
        self.model = cfg.default_model
        override = tmp / "netfarm.yaml"
        override.write_text(yaml.safe_dump({"models": [{"name": self.model, "path": str(model_dir),
                                                        "max_model_len": max_model_len}]}))
        self.redis_url = f"redis://:{REDIS_PASSWORD}@{net.ip('redis')}:{REDIS_PORT}/0"
        self.env = {**os.environ, "FARM_REDIS__URL": self.redis_url, "FARM_STATE_DIR": str(tmp / "state"),
                    "FARM_CONFIG": str(override), "FARM_SEMANTIC__ENABLED": "false",
                    "FARM_ENGINE__KV_CACHE_MB": "64", "FARM_ENGINE__KV_TIERS__HOST_MB": "0",
                    "FARM_ENGINE__KV_TIERS__DISK_MB": "0", "FARM_ENGINE__TORCH_THREADS": "1",
                    "FARM_API__HOST": net.ip("api"), "FARM_API__PORT": str(API_PORT),
                    "FARM_API__ALLOW_UNAUTHENTICATED": "true", **env}
        self.procs: dict[str, Any] = {}
        self.url = f"http://{net.ip('api')}:{API_PORT}"

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def start(self, timeout: float = 180) -> NetFarm:
        net = self.net
        self.procs["redis"] = net.popen("redis", [
            shutil.which("redis-server") or "redis-server", "--port", str(REDIS_PORT), "--bind", net.ip("redis"),
            "--save", "", "--appendonly", "no", "--dir", str(self.tmp), "--requirepass", REDIS_PASSWORD],
            log=self.log("redis"))
        r = self.redis()
        deadline = time.monotonic() + 20
        while True:
            try:
                r.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        for h in self.workers:
            e = {**self.env, "FARM_TRANSFER__ADVERTISE_HOST": net.ip(h.name), "FARM_TRANSFER__BIND_HOST": net.ip(h.name)}
            self.procs[h.name] = net.popen(h.name, [
                sys.executable, "-m", "tasks.worker", "--role", h.role, "--name", h.worker_id, "--concurrency", "8",
                "--loglevel", "WARNING"], env=e, log=self.log(h.name))
        self.procs["api"] = net.popen("api", [
            sys.executable, "-m", "gunicorn", "-c", "python:api.gunicorn_conf", "api.app:create_app()"],
            env=self.env, log=self.log("api"))
        self.wait_ready(timeout)
        return self

    def redis(self) -> redis.Redis:
        from farm.infra.redis_client import connect

        return connect(self.redis_url)

    def wait_ready(self, timeout: float) -> None:
        """Every worker registered and the API answering /health."""
        from farm.cluster import registry

        r = self.redis()
        deadline = time.monotonic() + timeout
        want = {h.worker_id for h in self.workers}
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{self.tail(name)}")
            try:
                have = {w.worker_id for w in registry.live_workers(r)}
                if want <= have and requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except (requests.RequestException, redis.RedisError):
                pass
            time.sleep(0.3)
        raise TimeoutError("the farm did not come up:\n" + "\n".join(self.tail(n) for n in self.procs))

    def tail(self, name: str, n: int = 30) -> str:
        try:
            lines = self.log(name).read_text(errors="replace").splitlines()[-n:]
        except OSError:
            lines = []
        return f"--- {name}\n" + "\n".join(lines)

    def tails(self) -> str:
        return "\n".join(self.tail(n) for n in self.procs)

    def stop(self, grace_s: float = 5) -> None:
        """Workers and API first (SIGTERM, then SIGKILL after `grace_s`), Redis last."""
        others = [p for n, p in self.procs.items() if n != "redis"]
        for group in (others, [self.procs["redis"]] if "redis" in self.procs else []):
            for p in group:
                if p.poll() is None:
                    p.terminate()
            deadline = time.monotonic() + grace_s
            for p in group:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:  # a warm shutdown still finishing, or stuck behind a dead link
                    p.kill()
                    p.wait(10)


@dataclass
class StreamResult:
    """One streamed chat completion as the client saw it."""

    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    started: float = 0.0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between content chunks
    elapsed_s: float = 0.0
    first_content: threading.Event = field(default_factory=threading.Event)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("length", "stop")


def chat_stream(url: str, model: str, prompt: str, max_tokens: int, *, timeout_s: float = 60,
                out: StreamResult | None = None) -> StreamResult:
    """Stream one greedy chat completion of exactly `max_tokens` tokens (ignore_eos); never raises."""
    res = out or StreamResult()
    res.started = t0 = time.monotonic()
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    last = None
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=(5, timeout_s)) as resp:
            res.status, res.headers = resp.status_code, dict(resp.headers)
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return res
            for line in resp.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = json.dumps(chunk["error"])[:300]
                    break
                res.usage = chunk.get("usage") or res.usage
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content") or ""
                    if content:
                        now = time.monotonic()
                        if res.ttft_s is None:
                            res.ttft_s = now - t0
                            res.first_content.set()
                        elif last is not None:
                            res.gaps_s.append(now - last)
                        last = now
                        res.text += content
                        res.chunks += 1
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                if time.monotonic() - t0 > timeout_s:
                    res.error = f"stream still open after {timeout_s:.0f}s"
                    break
    except (requests.RequestException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.elapsed_s = time.monotonic() - t0
        res.first_content.set()
    return res


def stream_in_background(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 60
                         ) -> tuple[threading.Thread, StreamResult]:
    """`chat_stream` on a thread; wait on `result.first_content` to act mid-stream."""
    res = StreamResult()
    t = threading.Thread(target=chat_stream, args=(url, model, prompt, max_tokens),
                         kwargs={"timeout_s": timeout_s, "out": res}, daemon=True)
    t.start()
    return t, res


def percentiles(values: Sequence[float], ps: Sequence[int] = (50, 95, 99)) -> dict[str, float]:
    """Nearest-rank percentiles in milliseconds (empty input: zeros)."""
    s = sorted(values)
    if not s:
        return {f"p{p}": 0.0 for p in ps}
    return {f"p{p}": round(1000 * s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))], 1) for p in ps}


# -- scenarios: shared by the tests (short, with asserts) and bench/netfaults.py (full length, tabulated) -------------
@dataclass
class Outcome:
    """What one fault did to the streams in flight."""

    fault: str
    results: list[StreamResult]
    expected: list[str | None]  # each stream's unfaulted text (greedy), None when not compared
    recovery_s: float | None = None  # until the faulted host served again after healing
    note: str = ""

    @property
    def completed(self) -> int:
        return sum(1 for r, want in zip(self.results, self.expected, strict=True)
                   if r.ok and (want is None or r.text == want))

    @property
    def failed_cleanly(self) -> int:
        """Ended with an error or a non-final finish reason, having sent only a prefix of the answer."""
        return sum(1 for r, want in zip(self.results, self.expected, strict=True)
                   if not r.ok and (want is None or want.startswith(r.text)) and (r.error or r.finish_reason))

    @property
    def wrong(self) -> int:
        """Tokens lost or repeated (a complete answer that differs, or text that is no prefix of it)."""
        return len(self.results) - self.completed - self.failed_cleanly

    def row(self) -> dict[str, Any]:
        ttft = percentiles([r.ttft_s for r in self.results if r.ttft_s is not None])
        itl = percentiles([g for r in self.results for g in r.gaps_s])
        return {"fault": self.fault, "requests": len(self.results), "completed": self.completed,
                "failed_cleanly": self.failed_cleanly, "lost_or_repeated": self.wrong,
                "longest_s": round(max((r.elapsed_s for r in self.results), default=0.0), 1),
                "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 1),
                "ttft_p50_ms": ttft["p50"], "ttft_p95_ms": ttft["p95"], "itl_p50_ms": itl["p50"],
                "itl_p95_ms": itl["p95"], "note": self.note}


def reference_text(farm: NetFarm, prompt: str, tokens: int, cache: dict[tuple[str, int], str]) -> str:
    """The unfaulted greedy answer to `prompt` (every decode host holds the same weights), asked once."""
    if (prompt, tokens) not in cache:
        res = chat_stream(farm.url, farm.model, prompt, tokens)
        if not res.ok:
            raise RuntimeError(f"unfaulted request failed: {res.error}\n{farm.tails()}")
        cache[(prompt, tokens)] = res.text
    return cache[(prompt, tokens)]


def rejoin_seconds(farm: NetFarm, host: Host, timeout: float = 60) -> float:
    """Seconds until `host`'s worker has its heartbeat and registry record back and its Celery consumer answers
    a ping through its own queue (it takes new tasks again)."""
    from farm.cluster import registry
    from farm.config import load_config
    from farm.infra.broker import make_celery
    from farm.protocol import TASK_PING, direct_queue
    from farm.protocol.keys import alive_key, ping_key

    t0 = time.monotonic()
    r = farm.redis()
    token = uuid.uuid4().hex
    app = make_celery(load_config(environ={k: v for k, v in farm.env.items() if k.startswith("FARM_")}))
    next_ping = 0.0
    while time.monotonic() - t0 < timeout:
        if r.exists(alive_key(host.worker_id)) and host.worker_id in {w.worker_id for w in registry.live_workers(r)}:
            if (r.get(ping_key(host.worker_id)) or b"").decode() == token:
                return time.monotonic() - t0
            if time.monotonic() >= next_ping:  # again every 2 s: a sweep that still thought it gone may move one
                app.send_task(TASK_PING, args=[host.worker_id, token], queue=direct_queue(host.worker_id))
                next_ping = time.monotonic() + 2
        time.sleep(0.2)
    raise TimeoutError(f"{host.worker_id} did not rejoin within {timeout}s\n{farm.tail(host.name)}")


def worker_partitioned(farm: NetFarm, seconds: float, tokens: int, cache: dict) -> Outcome:
    """A stream's decode host cut from Redis for `seconds` once its first token arrived; healed; rejoin timed."""
    prompt = f"Partition the decode host for {seconds} seconds."
    want = reference_text(farm, prompt, tokens, cache)
    t, res = stream_in_background(farm.url, farm.model, prompt, tokens, timeout_s=seconds + 120)
    res.first_content.wait(120)
    victim = next((h for h in farm.workers if h.worker_id == res.headers.get("x-farm-decode-worker")), None)
    if victim is None:
        raise RuntimeError(f"no decode worker named for the stream: {res}")
    lost_line = f"worker {victim.worker_id} lost after"  # the API's log line when it migrates a request
    before = farm.log("api").read_text(errors="replace").count(lost_line)
    with farm.net.partitioned(victim.name, "redis"):
        time.sleep(seconds)
    t.join(seconds + 120)
    migrated = farm.log("api").read_text(errors="replace").count(lost_line) > before
    return Outcome(f"decode host cut from Redis {seconds:g}s", [res], [want], rejoin_seconds(farm, victim),
                   f"victim {victim.worker_id}{', migrated' if migrated else ''}")


def api_partitioned(farm: NetFarm, seconds: float, tokens: int, cache: dict, compare: bool = True) -> Outcome:
    """The API host cut from Redis for `seconds` mid-stream; healed; time until it answers a new request.
    `compare`: check the text against the unfaulted answer (asked first)."""
    prompt = f"Partition the API host from Redis for {seconds} seconds."
    want = reference_text(farm, prompt, tokens, cache) if compare else None
    t, res = stream_in_background(farm.url, farm.model, prompt, tokens, timeout_s=seconds + 120)
    res.first_content.wait(120)
    with farm.net.partitioned("api", "redis"):
        time.sleep(seconds)
    healed = time.monotonic()
    t.join(seconds + 120)
    after = chat_stream(farm.url, farm.model, "After the API partition.", 16, timeout_s=120)
    note = "" if after.ok else f"first request after healing: {after.error}"
    return Outcome(f"API host cut from Redis {seconds:g}s", [res], [want],
                   time.monotonic() - healed if after.ok else None, note)


def kv_pull_cut(farm: NetFarm, tokens: int, cache: dict, prefill: str, decodes: Sequence[str]) -> Outcome:
    """The decode hosts cut from the prefill host (Redis and the API reachable): pulls time out, prefill is local."""
    prompt = "Cut the KV pull between hosts."
    want = reference_text(farm, prompt, tokens, cache)
    for d in decodes:
        farm.net.cut(prefill, d)
    try:
        res = chat_stream(farm.url, farm.model, prompt, tokens, timeout_s=120)
    finally:
        farm.net.heal()
    again = chat_stream(farm.url, farm.model, "Healed KV pull.", 16, timeout_s=120)
    return Outcome("decode hosts cut from the prefill host", [res], [want], note=(
        f"prefill {res.headers.get('x-farm-prefill')}; after healing {again.headers.get('x-farm-prefill')}"))


def under_link(farm: NetFarm, fault: str, prompts: Sequence[str], tokens: int, concurrency: int, cache: dict,
               **link: Any) -> Outcome:
    """`prompts` streamed `concurrency` at a time while `link` (Net.link's settings) holds on its hosts' links."""
    import concurrent.futures as cf

    want = [reference_text(farm, p, tokens, cache) for p in prompts]
    src, dst = link.pop("src", "*"), link.pop("dst", "*")
    farm.net.link(src, dst, **link)
    try:
        with cf.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda p: chat_stream(farm.url, farm.model, p, tokens, timeout_s=120), prompts))
        stats = farm.net.stats()
    finally:
        farm.net.heal()
    return Outcome(fault, results, want, note=f"switch {stats}")
