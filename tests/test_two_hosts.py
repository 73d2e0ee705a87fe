"""Two hosts for real: prefill and decode workers in two network namespaces joined by a veth pair,
so the KV pull crosses an actual network interface over TCP (shared memory is not offered across
namespaces). Skipped, with the reason, only where namespaces cannot be created (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

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


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture
def two_namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    tag = f"{os.getpid() % 10000}"
    a, b = f"farmA{tag}", f"farmB{tag}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    try:
        sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        sh("ip", "link", "set", f"va{tag}", "netns", a)
        sh("ip", "link", "set", f"vb{tag}", "netns", b)
        for ns, dev, ip in ((a, f"va{tag}", f"{subnet}.1"), (b, f"vb{tag}", f"{subnet}.2")):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield a, b, f"{subnet}.1", f"{subnet}.2"
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)


def test_kv_pull_crosses_a_real_network_interface(two_namespaces, tmp_path):
    ns_a, ns_b, ip_a, ip_b = two_namespaces
    port = 6390
    redis_proc = subprocess.Popen(
        ["ip", "netns", "exec", ns_a, shutil.which("redis-server"), "--port", str(port), "--bind", ip_a,
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", "two-hosts-pw"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [redis_proc]
    try:
        env = make_farm_env(f"redis://:two-hosts-pw@{ip_a}:{port}/0", tmp_path)  # Redis off loopback: password
        env["FARM_DISAGGREGATION__MODE"] = "always"
        base = {**os.environ, **env}

        def worker(ns, role, ip, name):
            e = {**base, "FARM_TRANSFER__ADVERTISE_HOST": ip, "FARM_TRANSFER__BIND_HOST": ip}
            log = (tmp_path / f"{name}.log").open("wb")
            return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "tasks.worker", "--role", role,
                                     "--name", f"{name}@{ns}", "--concurrency", "4", "--loglevel", "WARNING"],
                                    cwd=ROOT, env=e, stdout=log, stderr=subprocess.STDOUT)

        time.sleep(0.5)
        procs.append(worker(ns_a, "prefill", ip_a, "prefill-a"))
        procs.append(worker(ns_b, "decode", ip_b, "decode-b"))
        out = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, "-c", CLIENT], cwd=ROOT, env=base,
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
