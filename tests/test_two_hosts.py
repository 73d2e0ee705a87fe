"""Two hosts for real: prefill and decode workers in two network namespaces joined by the test network's switch
(tests/netns.py), so the KV pull crosses an actual network interface over TCP (shared memory is not offered across
namespaces). Skipped, with the reason, only where namespaces cannot be created (not root, no iproute2, no TAP)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests import netns
from tests.conftest import make_farm_env
from tests.procs import ROOT

CLIENT = """
import json, sys, time, uuid, redis
from farm.config import get_config
from farm.gateway import Gateway
from farm.protocol import GenerationRequest, SamplingParams
from farm.models.tokenization import chat_prompt_ids, get_tokenizer
from farm.cluster import registry
cfg = get_config()
r = redis.Redis.from_url(cfg.redis.url)
deadline = time.time() + 120
while len(registry.live_workers(r)) < 2:
    assert time.time() < deadline, "workers did not register"
    time.sleep(0.2)
gw = Gateway(cfg, r)
ids = chat_prompt_ids(get_tokenizer(cfg, cfg.default_model), [{"role": "user", "content": "What is 2+2?"}])
sub = gw.submit(GenerationRequest(uuid.uuid4().hex, cfg.default_model, ids, SamplingParams(max_tokens=30, temperature=0)))
events = list(sub.events(first_timeout_s=120, idle_timeout_s=60))
print(json.dumps({"events": [e.to_dict() for e in events], "workers": [w.__dict__ for w in registry.live_workers(r)]}))
"""


@pytest.fixture
def two_namespaces(tmp_path):
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.Net(["a", "b"], log_dir=tmp_path) as net:
        yield net


def test_kv_pull_crosses_a_real_network_interface(two_namespaces, tmp_path):
    net = two_namespaces
    ns_a, ns_b, ip_a = net.ns("a"), net.ns("b"), net.ip("a")
    port = 6390
    redis_proc = net.popen("a", [shutil.which("redis-server"), "--port", str(port), "--bind", ip_a, "--save", "",
                                 "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", "two-hosts-pw"])
    procs = [redis_proc]
    try:
        env = make_farm_env(f"redis://:two-hosts-pw@{ip_a}:{port}/0", tmp_path)  # Redis off loopback: password
        env["FARM_DISAGGREGATION__MODE"] = "always"
        base = {**os.environ, **env}

        def worker(host, role, name):
            ip = net.ip(host)
            e = {**base, "FARM_TRANSFER__ADVERTISE_HOST": ip, "FARM_TRANSFER__BIND_HOST": ip}
            return net.popen(host, [sys.executable, "-m", "tasks.worker", "--role", role, "--name",
                                    f"{name}@{net.ns(host)}", "--concurrency", "4", "--loglevel", "WARNING"],
                             env=e, log=tmp_path / f"{name}.log")

        time.sleep(0.5)
        procs.append(worker("a", "prefill", "prefill-a"))
        procs.append(worker("b", "decode", "decode-b"))
        out = subprocess.run(net.argv("b", [sys.executable, "-c", CLIENT]), cwd=ROOT, env=base,
                             capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-3000:] + "\n".join(
            (tmp_path / f).read_text()[-2000:] for f in ("prefill-a.log", "decode-b.log"))
        result = json.loads(out.stdout.strip().splitlines()[-1])
        events = result["events"]
        done = events[-1]
        assert done["type"] == "done" and done["prefill"] == "remote"
        assert done["prefill_worker"] == f"prefill-a@{ns_a}" and done["decode_worker"] == f"decode-b@{ns_b}"
        text = "".join(e.get("text", "") for e in events if e["type"] == "delta")
        assert "4" in text
        decode_start = next(e for e in events if e["type"] == "start" and e["role"] == "decode")
        assert decode_start["kv_transfer"]["transport"] == "tcp" and decode_start["kv_transfer"]["bytes"] > 0
        endpoints = {w["role"]: w["transfer_endpoint"] for w in result["workers"]}
        assert endpoints["prefill"].startswith(ip_a + ":")
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
