"""A farm spread over network-namespace hosts (tests/netns.py): Redis, the API and worker hosts, each process started
with the same command as on a real machine (README, "Adding workers on a second machine"), plus a streaming chat
client that times every chunk; with `ha=True` Redis Sentinel across three hosts. Shared by tests/test_netfaults.py,
tests/test_netfaults_sentinel.py and bench/netfaults.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
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
SENTINEL_PORT = 26379
MASTER_NAME = "farm"
# NetFarm(ha=True): a data node and a sentinel on each of these hosts, the first starting as the primary. Two
# replicas, so that with min-replicas-to-write 1 the majority side of a partition of the primary's host keeps a
# writable primary (the promoted replica with the other one as its replica), and three sentinels, so that the
# same partition leaves two of them (the quorum and a majority) on the majority side.
HA_HOSTS = ("redis", "redis2", "redis3")


@dataclass
class Host:
    """A worker host: its name (= its namespace's host name in the Net) and the worker's role."""

    name: str
    role: str

    @property
    def worker_id(self) -> str:
        return f"{self.role}-{self.name}@{self.name}"


@contextlib.contextmanager
def running(tmp: Path, hosts: Sequence[str], model_dir: Path, workers: Sequence[Host], env: dict[str, str],
            **farm_kw: Any) -> Iterator[NetFarm]:
    """A NetFarm on its own Net of `hosts`, started; healed and stopped however the block ends (the module
    fixtures of the multi-host tests). Skips when network namespaces are not available here."""
    import pytest

    from tests import netns

    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.Net(list(hosts), log_dir=tmp) as net:
        f = NetFarm(net, model_dir, tmp, workers, env, **farm_kw)
        try:
            f.start()
            yield f
        finally:
            net.heal()
            f.stop()


class NetFarm:
    """Redis on host "redis", the API on host "api", one worker per `workers` host; `env` overrides settings.

    `ha`: Redis Sentinel across hosts (the Net needs HA_HOSTS): a primary on "redis", replicas on "redis2" and
    "redis3", a sentinel on each of the three, all bound to their host's address, with the product's data-node
    and sentinel commands (farm.infra.redis_server: requirepass/masterauth, sentinel auth-pass, and
    min-replicas-to-write 1 with redis.ha.min_replicas_max_lag_s); every farm process gets
    FARM_REDIS__HA__* and finds the primary through the sentinels (`env` may override down_after_ms,
    failover_timeout_ms, min_replicas_max_lag_s)."""

    def __init__(self, net: Net, model_dir: Path, tmp: Path, workers: Sequence[Host], env: dict[str, str],
                 max_model_len: int = 2048, ha: bool = False):
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
                    "FARM_API__ALLOW_UNAUTHENTICATED": "true"}
        self.ha = ha
        if ha:
            self.env.update({
                "FARM_REDIS__HA__ENABLED": "true", "FARM_REDIS__HA__MASTER_NAME": MASTER_NAME,
                "FARM_REDIS__HA__SENTINELS": ",".join(f"{net.ip(h)}:{SENTINEL_PORT}" for h in HA_HOSTS),
                "FARM_REDIS__HA__DOWN_AFTER_MS": "2000", "FARM_REDIS__HA__FAILOVER_TIMEOUT_MS": "10000",
                # split-brain protection (off by default): two replicas here, so losing one node stops nothing
                "FARM_REDIS__HA__MIN_REPLICAS_MAX_LAG_S": "5"})
        self.env.update(env)
        self.cfg = load_config(environ={k: v for k, v in self.env.items() if k.startswith("FARM_")})
        self.procs: dict[str, Any] = {}
        self.url = f"http://{net.ip('api')}:{API_PORT}"

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def start(self, timeout: float = 180) -> NetFarm:
        net = self.net
        if self.ha:
            self.start_sentinel_set()
        else:
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

    def start_sentinel_set(self, timeout: float = 30) -> None:
        """ha: the data nodes (the first of HA_HOSTS the primary), then a sentinel per data host; returns once the
        primary has both replicas online and every sentinel knows the primary, both replicas and the other two
        sentinels (so a failover can be voted at once)."""
        from farm.infra import redis_server

        net, ha = self.net, self.cfg.redis.ha
        primary = HA_HOSTS[0]
        for h in HA_HOSTS:
            cmd = redis_server.command(REDIS_PORT, self.tmp / f"data-{h}", appendonly=False, password=REDIS_PASSWORD,
                                       replica_of=None if h == primary else REDIS_PORT, bind=net.ip(h),
                                       replica_of_host=net.ip(primary),
                                       min_replicas_max_lag_s=ha.min_replicas_max_lag_s)
            self.procs[h] = net.popen(h, [*cmd, "--save", ""], log=self.log(h))
        for i, h in enumerate(HA_HOSTS, 1):
            cmd = redis_server.sentinel_command(i, SENTINEL_PORT, self.tmp, ha, REDIS_PORT, REDIS_PASSWORD,
                                                bind=net.ip(h), primary_host=net.ip(primary))
            self.procs[f"sentinel-{h}"] = net.popen(h, cmd, log=self.log(f"sentinel-{h}"))
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = self.node(primary).info("replication")
                views = [self.sentinel_node(h).sentinel_master(MASTER_NAME) for h in HA_HOSTS]
                if info.get("connected_slaves") == len(HA_HOSTS) - 1 and all(
                        int(v["num-slaves"]) == len(HA_HOSTS) - 1 and int(v["num-other-sentinels"]) == len(HA_HOSTS) - 1
                        for v in views):
                    return
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the Sentinel set did not come up:\n" + self.tails())
            time.sleep(0.3)

    def node(self, host: str, timeout: float = 2.0) -> redis.Redis:
        """ha: a client of the data node on `host` itself (not through the sentinels)."""
        return redis.Redis(host=self.net.ip(host), port=REDIS_PORT, password=REDIS_PASSWORD, socket_timeout=timeout,
                           socket_connect_timeout=timeout)

    def sentinel_node(self, host: str, timeout: float = 2.0) -> redis.Redis:
        """ha: a client of the sentinel on `host`."""
        return redis.Redis(host=self.net.ip(host), port=SENTINEL_PORT, password=REDIS_PASSWORD,
                           socket_timeout=timeout, socket_connect_timeout=timeout)

    def redis(self) -> redis.Redis:
        """A client as the farm's processes have one: through the sentinels with `ha`."""
        from farm.infra.redis_client import connect

        return connect(self.cfg.redis if self.ha else self.redis_url)

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
        """Workers and API first (SIGTERM, then SIGKILL after `grace_s`), Redis (and the sentinels) last."""
        redis_side = [p for n, p in self.procs.items() if n == "redis" or n in HA_HOSTS or n.startswith("sentinel-")]
        others = [p for p in self.procs.values() if p not in redis_side]
        for group in (others, redis_side):
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


# -- Redis Sentinel: the primary's host partitioned (NetFarm(ha=True)) ------------------------------------------------
SPLIT_KEY = "netfaults:splitbrain:{}"  # a list per writer: the sequence numbers it wrote
# The writer co-located with the old primary: a process on its host writing to its address directly (no sentinel),
# one RPUSH every `interval` s, each outcome a line "<seq> <wall time> ok|err <message>" in the output file.
COLOCATED_WRITER = """
import sys, time, redis
host, port, pw, key, out, stop, interval = sys.argv[1:8]
r = redis.Redis(host=host, port=int(port), password=pw, socket_timeout=1, socket_connect_timeout=1)
seq = 0
with open(out, "a", buffering=1) as f:
    while True:
        try:
            open(stop).close()
            break
        except OSError:
            pass
        seq += 1
        try:
            r.rpush(key, seq)
            f.write(f"{seq} {time.time():.4f} ok\\n")
        except (redis.RedisError, OSError) as e:
            f.write(f"{seq} {time.time():.4f} err {str(e).splitlines()[0][:80]}\\n")
        time.sleep(float(interval))
"""


@dataclass
class Writes:
    """One writer's sequence numbers: when each was acknowledged (wall time), and which were refused."""

    acked: dict[int, float] = field(default_factory=dict)
    errors: list[tuple[int, float, str]] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)  # acknowledged, yet not on the final primary

    def acked_between(self, t0: float, t1: float) -> list[int]:
        return [s for s, t in self.acked.items() if t0 <= t < t1]

    def error_summary(self, t0: float) -> str:
        """The refusals by kind: how many, and from when to when (s after `t0`)."""
        kinds: dict[str, list[float]] = {}
        for _seq, t, msg in self.errors:
            kinds.setdefault(msg.split(":")[0].split(" ")[0], []).append(t - t0)
        return ", ".join(f"{k} x{len(ts)} {min(ts):.1f}..{max(ts):.1f}s" for k, ts in kinds.items()) or "none"


@dataclass
class SentinelOutcome(Outcome):
    """`sentinel_primary_partitioned`: the streams' Outcome, plus what the sentinels and the two writers saw.
    Times in seconds from the cut."""

    old_primary: str = ""
    new_primary: str | None = None  # the host the majority's sentinels promoted
    failover_s: float | None = None  # until a majority-side sentinel named the new primary
    refused_s: float | None = None  # until the old primary first refused a co-located write (NOREPLICAS)
    last_minority_ack_s: float | None = None  # the old primary's last acknowledged write while cut
    demoted_s: float | None = None  # after healing, until the old primary replicated from the new one
    roles: dict[str, str] = field(default_factory=dict)  # data node host -> ROLE after healing
    sentinel_views: dict[str, str | None] = field(default_factory=dict)  # sentinel host -> the primary it names
    majority: Writes = field(default_factory=Writes)
    colocated: Writes = field(default_factory=Writes)
    cut_s: float = 0.0
    cut_at: float = 0.0  # wall time (time.time()) of the cut

    @property
    def primaries(self) -> list[str]:
        return [h for h, role in self.roles.items() if role == "master"]

    def row(self) -> dict[str, Any]:
        def r1(x: float | None) -> float | None:
            return None if x is None else round(x, 1)

        row = super().row()
        row.update({"failover_s": r1(self.failover_s), "refused_s": r1(self.refused_s),
                    "last_minority_ack_s": r1(self.last_minority_ack_s), "demoted_s": r1(self.demoted_s),
                    "primaries": len(self.primaries), "majority_acked": len(self.majority.acked),
                    "majority_lost": len(self.majority.lost), "colocated_acked": len(self.colocated.acked),
                    "colocated_lost": len(self.colocated.lost)})
        return row


def _sentinel_primary(farm: NetFarm, host: str) -> str | None:
    """The host (of HA_HOSTS) the sentinel on `host` names as the primary; None if it does not answer."""
    try:
        addr = farm.sentinel_node(host, timeout=1).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
    except (redis.RedisError, OSError):
        return None
    ip = addr[0].decode() if addr else None
    return next((h for h in HA_HOSTS if farm.net.ip(h) == ip), ip)


def _role(farm: NetFarm, host: str) -> tuple[str, str | None, str | None]:
    """ROLE of the data node on `host`: ("master", None, None) or ("slave", primary host, link state)."""
    role = farm.node(host, timeout=1).execute_command("ROLE")
    kind = role[0].decode()
    if kind != "slave":
        return kind, None, None
    ip = role[1].decode() if isinstance(role[1], bytes) else str(role[1])
    state = role[3].decode() if isinstance(role[3], bytes) else str(role[3])
    return kind, next((h for h in HA_HOSTS if farm.net.ip(h) == ip), ip), state


def sentinel_primary_partitioned(farm: NetFarm, seconds: float, tokens: int, cache: dict, streams: int = 2,
                                 settle_s: float = 60) -> SentinelOutcome:
    """NetFarm(ha=True): the primary's host (data node and one sentinel) cut from every other host for `seconds`
    while `streams` chats stream through the API and two writers append sequence numbers: one in the test process
    through the sentinels (`connect()` with the farm's redis.ha, on the majority side), one co-located with the
    old primary writing to it directly (the split-brain client). Then healed; waits (up to `settle_s`) until the
    old primary replicates from the new one and every sentinel names the same primary, then reads both writers'
    lists from the final primary. The caller asserts (the test) or tabulates (the bench)."""
    net = farm.net
    old = next(h for h in HA_HOSTS if _role(farm, h)[0] == "master")
    prompts = [f"Sentinel partition stream {i}: tell me about replication." for i in range(streams)]
    wants = [reference_text(farm, p, tokens, cache) for p in prompts]
    r = farm.redis()
    for who in ("majority", "colocated"):
        r.delete(SPLIT_KEY.format(who))
    out = SentinelOutcome(f"Sentinel primary's host cut {seconds:g}s", [], wants, old_primary=old, cut_s=seconds)

    # the writers
    stop = threading.Event()

    def majority_writer() -> None:
        client = farm.redis()
        seq = 0
        while not stop.is_set():
            seq += 1
            try:
                client.rpush(SPLIT_KEY.format("majority"), seq)
                out.majority.acked[seq] = time.time()
            except (redis.RedisError, OSError) as e:
                out.majority.errors.append((seq, time.time(), f"{type(e).__name__}: {str(e)[:60]}"))
            time.sleep(0.02)

    stop_file = farm.tmp / f"colocated-{uuid.uuid4().hex[:6]}.stop"
    record = farm.tmp / f"colocated-{uuid.uuid4().hex[:6]}.txt"
    colocated = net.popen(old, [sys.executable, "-c", COLOCATED_WRITER, net.ip(old), str(REDIS_PORT), REDIS_PASSWORD,
                                SPLIT_KEY.format("colocated"), str(record), str(stop_file), "0.02"],
                          log=farm.log("colocated-writer"))
    writer = threading.Thread(target=majority_writer, daemon=True)
    writer.start()

    # the streams, then the cut once each has its first token
    started = [stream_in_background(farm.url, farm.model, p, tokens, timeout_s=seconds + settle_s + 120)
               for p in prompts]
    for _, res in started:
        res.first_content.wait(120)
    time.sleep(1.0)  # both writers under way
    t_cut = out.cut_at = time.time()
    net.cut(old, "*")
    try:
        majority = [h for h in HA_HOSTS if h != old]
        while time.time() - t_cut < seconds:
            if out.failover_s is None:
                named = {_sentinel_primary(farm, h) for h in majority}
                if len(named) == 1 and (new := named.pop()) not in (None, old):
                    out.failover_s, out.new_primary = time.time() - t_cut, new
            time.sleep(0.1)
    finally:
        net.heal()
    t_heal = time.time()

    # healed: the old primary must turn into a replica of the new one, every sentinel naming that one
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        try:
            kind, of, state = _role(farm, old)
            views = {h: _sentinel_primary(farm, h) for h in HA_HOSTS}
            if kind == "slave" and state == "connected" and len(set(views.values())) == 1 and of == views[old]:
                out.demoted_s = time.time() - t_heal
                break
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.2)
    time.sleep(1.0)
    stop_file.touch()
    stop.set()
    writer.join(30)
    try:
        colocated.wait(30)
    except subprocess.TimeoutExpired:
        colocated.kill()
    for t, res in started:
        t.join(seconds + settle_s + 120)
        out.results.append(res)

    # what is where
    for h in HA_HOSTS:
        try:
            kind, of, _state = _role(farm, h)
            out.roles[h] = kind if kind == "master" else f"replica of {of}"
        except (redis.RedisError, OSError) as e:
            out.roles[h] = f"no answer: {e}"
        out.sentinel_views[h] = _sentinel_primary(farm, h)
    for line in record.read_text().splitlines():
        seq, when, status, *msg = line.split(" ", 3)
        if status == "ok":
            out.colocated.acked[int(seq)] = float(when)
        else:
            out.colocated.errors.append((int(seq), float(when), " ".join(msg)))
    final = out.primaries[0] if len(out.primaries) == 1 else None
    if final is not None:
        node = farm.node(final, timeout=10)
        for who, w in (("majority", out.majority), ("colocated", out.colocated)):
            present = {int(x) for x in node.lrange(SPLIT_KEY.format(who), 0, -1)}
            w.lost = sorted(s for s in w.acked if s not in present)
    during = [t for s, t in out.colocated.acked.items() if t_cut <= t < t_heal]
    out.last_minority_ack_s = max(during) - t_cut if during else None
    refused = [t for _s, t, msg in out.colocated.errors if t >= t_cut and msg.startswith("NOREPLICAS")]
    out.refused_s = min(refused) - t_cut if refused else None
    after = chat_stream(farm.url, farm.model, "After the Sentinel partition.", 16, timeout_s=120)
    out.recovery_s = out.demoted_s if after.ok else None
    out.note = (f"primary {old} -> {out.new_primary} (final {final}); roles {out.roles}; sentinels "
                f"{out.sentinel_views}; majority {len(out.majority.acked)} acked/{len(out.majority.errors)} refused/"
                f"{len(out.majority.lost)} lost; co-located {len(out.colocated.acked)} acked/"
                f"{len(out.colocated.errors)} refused/{len(out.colocated.lost)} lost"
                + ("" if after.ok else f"; first request after healing: {after.error}")
                + f"; cut at 0, healed at {t_heal - t_cut:.1f}s; majority refusals: "
                  f"{out.majority.error_summary(t_cut)}; co-located refusals: {out.colocated.error_summary(t_cut)}")
    return out
