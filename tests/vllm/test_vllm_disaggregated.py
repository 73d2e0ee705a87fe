"""Disaggregated serving with vLLM on CPUs: a prefill worker and a decode worker, both vLLM, the KV moving
through vLLM's NixlConnector (NIXL over UCX, host memory) under the farm's signed handle.

The decode worker must use the prefill worker's KV, not recompute it: vLLM's connector statistics on the
decode side count the prompt tokens brought in and the transfers made, and greedy output matches
`vllm serve` (aggregated) on the same settings.
"""

from __future__ import annotations

import json
import os
import time

import openai
import psutil
import pytest
import redis

from farm.backends.cpu_binding import parse_cpu_list
from farm.cluster import registry
from farm.supervisor import Farm
from tests.vllm.conftest import MODEL, vllm_farm

pytestmark = pytest.mark.slow

PROMPTS = ["What is 2+2?", "Write one sentence about the sea.",
           "List the planets of the solar system in order from the sun, with one fact about each."]


@pytest.fixture(scope="module")
def farm(tmp_path_factory, real_model_dir) -> Farm:
    with vllm_farm(tmp_path_factory.mktemp("vllm-pd"), real_model_dir, prefill=1, decode=1,
                   env={"FARM_DISAGGREGATION__MODE": "always"}, kv_connector="NixlConnector") as f:
        yield f


def stats(farm, worker_id: str) -> dict:
    r = redis.Redis.from_url(farm.cfg.redis.url)
    return json.loads(r.get(registry.alive_key(worker_id)) or "{}")


def test_decode_uses_the_prefill_workers_kv_and_matches_vllm_serve(farm, vllm_serve):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{farm.api_port}/v1", api_key="unused", max_retries=0)
    serve = openai.OpenAI(base_url=vllm_serve.url, api_key="unused", max_retries=0)
    r = redis.Redis.from_url(farm.cfg.redis.url)
    (pre,), (dec,) = ([w for w in registry.live_workers(r) if w.role == role] for role in ("prefill", "decode"))
    before = stats(farm, dec.worker_id)["connector"]
    prompt_tokens = 0
    for text in PROMPTS:
        msgs = [{"role": "user", "content": text}]
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=40,
                                                               temperature=0)
        ours = raw.parse()
        assert raw.headers["x-farm-prefill"] == "remote"
        assert (raw.headers["x-farm-prefill-worker"], raw.headers["x-farm-decode-worker"]) == (pre.worker_id,
                                                                                             dec.worker_id)
        theirs = serve.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
        assert ours.choices[0].message.content == theirs.choices[0].message.content
        assert ours.usage.completion_tokens == theirs.usage.completion_tokens
        prompt_tokens += ours.usage.prompt_tokens
    assert pre.pid != dec.pid
    # vLLM's connector on the decode worker brought each prompt's KV in over NIXL: nothing prefilled there
    deadline = time.monotonic() + 15
    while True:  # the heartbeat carries the statistics every few seconds
        after = stats(farm, dec.worker_id)["connector"]
        if after["transfers"] - before["transfers"] >= len(PROMPTS) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert after["transfers"] - before["transfers"] >= len(PROMPTS) and after["bytes"] > before["bytes"]
    assert after["hit_tokens"] - before["hit_tokens"] >= prompt_tokens - len(PROMPTS)


def test_vllm_workers_of_one_machine_get_their_own_cores(farm):
    """Two vLLM CPU engines on one machine would both bind to the same core (vLLM's `auto`); the farm gives
    each worker its own share."""
    binds = {p.name: p.env.get("VLLM_CPU_OMP_THREADS_BIND") for p in farm.procs if p.role in ("prefill", "decode")}
    assert len(binds) == 2 and None not in binds.values() and len(set(binds.values())) == 2
    # and each worker's engine core (vLLM's scheduler, which busy-waits for its executor) stays on that share
    for proc in farm.procs:
        if proc.role not in ("prefill", "decode"):
            continue
        cores = set(parse_cpu_list(binds[proc.name]))
        engine_cores = [c for c in psutil.Process(proc.pid).children() if "EngineCore" in " ".join(c.cmdline())
                        or "EngineCore" in c.name()]
        assert engine_cores, f"{proc.name}: no vLLM engine core among {psutil.Process(proc.pid).children()}"
        for c in engine_cores:
            assert {frozenset(os.sched_getaffinity(t.id)) for t in c.threads()} == {frozenset(cores)}, proc.name
