"""200 concurrent streaming clients for 60 seconds against `farm up`'s processes (gunicorn API, two
aggregated workers with the real model, a managed redis-server), loopback only: every request completes
or is refused up front with 503 + Retry-After; none errors mid-stream; memory stays bounded; afterwards
every KV block is free and no per-request key lives without a TTL."""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest
import requests

from farm.config import load_config
from farm.infra.redis_client import connect
from farm.supervisor import Farm
from tests.chaos.harness import per_request_keys_without_ttl, wait_all_blocks_free
from tests.conftest import free_port, make_farm_env

pytestmark = pytest.mark.slow

CLIENTS = 200
DURATION_S = 60


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            total += p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
        except psutil.Error:
            pass
    return total / 2**20


def _finished(lines: list[bytes]) -> bool:
    """A clean SSE answer: [DONE] last, no error line, a chunk with a finish_reason."""
    if not lines or lines[-1] != b"data: [DONE]":
        return False
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    return not any("error" in c for c in chunks) and any(
        ch.get("finish_reason") for c in chunks for ch in c.get("choices", []))


def _client(url: str, model: str, stop_at: float, outcomes: dict[str, int], lock: threading.Lock, i: int) -> None:
    body = {"model": model, "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": f"Client {i}: name a colour."}]}
    while time.monotonic() < stop_at:
        kind = "failed"
        try:
            with requests.post(url, json=body, stream=True, timeout=120,
                               headers={"Cache-Control": "no-cache"}) as resp:
                if resp.status_code == 503 and resp.headers.get("Retry-After"):
                    kind = "shed"
                    time.sleep(float(resp.headers["Retry-After"]))
                elif resp.status_code == 200 and _finished([ln for ln in resp.iter_lines()
                                                             if ln.startswith(b"data: ")]):
                    kind = "completed"
        except requests.RequestException:
            kind = "failed"
        with lock:
            outcomes[kind] += 1


def test_200_streaming_clients_for_60_seconds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load")
    env = make_farm_env(f"redis://127.0.0.1:{free_port()}/0", tmp)
    env["FARM_ENGINE__KV_CACHE_MB"] = "128"
    cfg = load_config(environ=env)
    farm = Farm(cfg, prefill=0, decode=0, both=2, port=free_port(), flower=False, env=env)
    try:
        farm.start()
        farm.wait_healthy(240)
        url = f"http://127.0.0.1:{farm.api_port}/v1/chat/completions"
        pids = [p.pid for p in farm.procs if p.role in ("api", "both")]
        outcomes = {"completed": 0, "shed": 0, "failed": 0}
        lock = threading.Lock()
        t0 = time.monotonic()
        threads = [threading.Thread(target=_client, args=(url, cfg.default_model, t0 + DURATION_S, outcomes, lock, i), daemon=True)
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        time.sleep(15)
        rss_early = _rss_mb(pids)
        for t in threads:
            t.join(DURATION_S + 150)
        rss_late = _rss_mb(pids)
        print(f"load: {outcomes}, RSS {rss_early:.0f} MB after 15 s, {rss_late:.0f} MB at the end")
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert outcomes["failed"] == 0, outcomes
        assert outcomes["completed"] >= CLIENTS, outcomes
        assert rss_late < rss_early * 1.25 + 200, (rss_early, rss_late)  # bounded: no growth with requests

        r = connect(farm.cfg.redis)  # with the managed Redis's generated password
        clean, stats = wait_all_blocks_free(r, timeout=30)
        assert clean, stats
        assert per_request_keys_without_ttl(r) == []
    finally:
        farm.stop()
