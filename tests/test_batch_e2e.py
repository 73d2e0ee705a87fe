"""The Batch API end to end with the openai SDK: a real farm (gunicorn API, two aggregated workers with the
real default model, a managed redis-server) and real batch-driver processes (`python -m tasks.batch`)."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis
import requests

from farm.cluster import registry
from farm.config import load_config
from farm.protocol.keys import batch_lease_key
from farm.supervisor import Farm
from tests.conftest import free_port, make_farm_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch-e2e")
    env = make_farm_env(f"redis://127.0.0.1:{free_port()}/0", tmp)
    env["FARM_ENGINE__TORCH_THREADS"] = "1"  # two workers share this machine's cores
    # a narrow window of lines in flight paces the batches, so "mid-run" (cancel, kill) stays mid-run on a
    # fast machine too: with the default 32 a 24-line batch can finish between two polls
    env["FARM_BATCH__MAX_INFLIGHT"] = "4"
    env["FARM_BATCH__LEASE_TTL_S"] = "5"  # a killed driver's batch is taken over sooner
    cfg = load_config(environ=env)
    with Farm(cfg, prefill=0, decode=0, both=2, batch_drivers=2, port=free_port(), flower=False, env=env,
              grace_s=10).running(240) as f:
        yield f


@pytest.fixture
def client(farm):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{farm.api_port}/v1", api_key="unused", max_retries=0)


def chat_line(model, cid, content, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], **body}}


def upload(client, rows) -> str:
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def wait_status(client, bid, statuses, timeout=120.0, until=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        b = client.batches.retrieve(bid)
        if b.status in statuses or (until and until(b)):
            return b
        time.sleep(0.3)
    raise AssertionError(f"batch {bid} still {b.status} ({b.request_counts}) after {timeout}s")


def outputs(client, b) -> tuple[list[dict], list[dict]]:
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()] if b.output_file_id else []
    err = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()] if b.error_file_id else []
    return out, err


def test_sdk_round_trip(farm, client):
    model = farm.cfg.default_model
    questions = ["What is 2+2?", "Name a color.", "What is the capital of France?", "Say hello.",
                 "What is 3+3?", "Name a fruit."]
    rows = [chat_line(model, f"q-{i}", q, max_tokens=8, temperature=0) for i, q in enumerate(questions)]
    fid = upload(client, rows)
    assert client.files.retrieve(fid).purpose == "batch"
    b = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"suite": "e2e"})
    assert b.status == "validating" and b.metadata == {"suite": "e2e"}
    b = wait_status(client, b.id, {"completed", "failed"})
    assert b.status == "completed", b
    assert b.request_counts.total == b.request_counts.completed == 6 and b.request_counts.failed == 0
    assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at
    assert b.error_file_id is None and b.model == model
    out, _ = outputs(client, b)
    assert sorted(o["custom_id"] for o in out) == sorted(r["custom_id"] for r in rows)
    by_id = {o["custom_id"]: o for o in out}
    for o in out:
        assert o["error"] is None and o["id"].startswith("batch_req_")
        resp = o["response"]
        assert resp["status_code"] == 200 and resp["request_id"] == resp["body"]["id"]
        body = resp["body"]
        assert body["object"] == "chat.completion" and body["model"] == model
        assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["finish_reason"]
        assert 0 < body["usage"]["completion_tokens"] <= 8
    assert b.usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in out)
    assert b.usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
    # the same answer as the live endpoint (greedy)
    live = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": questions[0]}])
    assert live.choices[0].message.content == by_id["q-0"]["response"]["body"]["choices"][0]["message"]["content"]
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"
    assert b.id in [x.id for x in client.batches.list(limit=5).data]
    # /v1/completions batches too
    comp = [{"custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": p, "max_tokens": 4, "temperature": 0}}
            for i, p in enumerate(["The capital of France is", "One, two, three,"])]
    b2 = client.batches.create(input_file_id=upload(client, comp), endpoint="/v1/completions",
                               completion_window="24h")
    b2 = wait_status(client, b2.id, {"completed", "failed"})
    out2, _ = outputs(client, b2)
    assert b2.status == "completed" and sorted(o["custom_id"] for o in out2) == ["c-0", "c-1"]
    assert all(o["response"]["body"]["object"] == "text_completion" for o in out2)
    client.files.delete(fid)
    import openai

    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(fid)


def test_malformed_input_fails_with_line_numbers(farm, client):
    model = farm.cfg.default_model
    rows = [chat_line(model, "a", "Hi", max_tokens=4), "not json at all", chat_line(model, "a", "dup"),
            {**chat_line(model, "u", "Hi"), "url": "/v1/completions"},
            chat_line(model, "t", "Hi", temperature=9)]
    b = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                              completion_window="24h")
    b = wait_status(client, b.id, {"failed", "completed", "in_progress"})
    assert b.status == "failed" and b.failed_at and b.in_progress_at is None
    assert [(e.line, e.code) for e in b.errors.data] == [(2, "invalid_json_line"), (3, "duplicate_custom_id"),
                                                          (4, "mismatched_url"), (5, "invalid_value")]
    assert b.request_counts.completed == 0 and b.output_file_id is None


def worker_running(farm) -> int:
    r = redis.Redis.from_url(farm.cfg.redis.url)
    return sum(json.loads(r.get(registry.alive_key(w.worker_id)) or "{}").get("running", 0)
               for w in registry.live_workers(r))


def test_cancel_mid_run(farm, client):
    model = farm.cfg.default_model
    n = 24  # several times the driver's window (4 here): lines still waiting when the cancel comes never run
    rows = [chat_line(model, f"c-{i}", f"Tell me a long story about the number {i}.", max_tokens=32,
                      ignore_eos=True, temperature=0) for i in range(n)]
    b = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                              completion_window="24h")
    wait_status(client, b.id, set(), until=lambda x: x.request_counts.completed >= 2)
    c = client.batches.cancel(b.id)
    assert c.status == "cancelling" and c.cancelling_at
    b = wait_status(client, b.id, {"cancelled"}, timeout=60)
    assert b.cancelled_at >= b.cancelling_at
    out, err = outputs(client, b)
    counts = b.request_counts
    assert counts.total == n and 2 <= counts.completed < n
    assert counts.completed == len(out) and counts.failed == len(err)
    ids = [o["custom_id"] for o in out + err]
    assert len(ids) == len(set(ids))
    time.sleep(3)  # nothing runs any more: counts frozen, workers idle
    assert client.batches.retrieve(b.id).request_counts == counts
    deadline = time.time() + 10
    while worker_running(farm) and time.time() < deadline:
        time.sleep(0.25)
    assert worker_running(farm) == 0


def test_survives_killing_a_worker_and_the_driver_mid_run(farm, client):
    """kill -9 one of the two workers and the driver holding the batch while lines run: the other driver
    takes over from Redis, lost lines run again, and every custom_id is in the output exactly once."""
    model = farm.cfg.default_model
    n = 12
    rows = [chat_line(model, f"k-{i}", f"Write a poem about the number {i}.", max_tokens=32,
                      ignore_eos=True, temperature=0) for i in range(n)]
    b = client.batches.create(input_file_id=upload(client, rows), endpoint="/v1/chat/completions",
                              completion_window="24h")
    wait_status(client, b.id, set(), until=lambda x: x.request_counts.completed >= 1)
    r = redis.Redis.from_url(farm.cfg.redis.url)
    deadline = time.time() + 15  # the lease may be between holders for a moment (a slow refresh on 2 busy cores)
    while not (holder := (r.get(batch_lease_key(b.id)) or b"").decode()) and time.time() < deadline:  # "<host>:<pid>:<token>"
        time.sleep(0.1)
    victim_driver = next((p for p in farm.procs if p.role == "batch" and f":{p.pid}:" in holder), None)
    assert victim_driver is not None, f"no batch driver of this farm holds the lease: {holder!r}"
    worker = next(p for p in farm.procs if p.role == "both" and p.alive())
    os.kill(worker.pid, signal.SIGKILL)
    os.kill(victim_driver.pid, signal.SIGKILL)
    at_kill = client.batches.retrieve(b.id).request_counts.completed
    assert at_kill < n
    b = wait_status(client, b.id, {"completed", "failed"}, timeout=150)
    assert b.status == "completed"
    out, err = outputs(client, b)
    ids = [o["custom_id"] for o in out + err]
    assert sorted(ids) == sorted(r_["custom_id"] for r_ in rows)  # each exactly once
    assert b.request_counts.completed + b.request_counts.failed == n
    assert b.request_counts.completed == len(out) and b.request_counts.failed == len(err)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 32 for o in out)
    # the batch finished under the surviving driver (the dead one's lease lapsed and was taken over)
    assert not victim_driver.alive()


def test_cli_round_trip_and_batch_metrics(farm, tmp_path):
    """`farm batch submit --wait` then `farm batch results -o`, and /metrics counts the lines farm-wide."""
    import subprocess
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    model = farm.cfg.default_model
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(chat_line(model, f"cli-{i}", f"Count to {i}.", max_tokens=6)) + "\n"
                           for i in range(3)))
    url = f"http://127.0.0.1:{farm.api_port}"
    farm_cli = [sys.executable, "-m", "farm.cli", "batch", "--url", url]
    sub = subprocess.run([*farm_cli, "submit", str(src), "--wait"], env=farm.child_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    batch_id = sub.stdout.splitlines()[0]
    assert batch_id.startswith("batch_") and "3/3 done, 0 failed  completed" in sub.stdout
    out = tmp_path / "out.jsonl"
    res = subprocess.run([*farm_cli, "results", batch_id, "-o", str(out)], env=farm.child_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == ["cli-0", "cli-1", "cli-2"]
    bad = subprocess.run([*farm_cli, "status", "batch_nope", "--once"], env=farm.child_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "HTTP 404" in bad.stderr

    text = requests.get(f"{url}/metrics", timeout=10).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("farm_batch_lines_total", (("state", "completed"),))] >= 3
    assert samples[("farm_batches_total", (("status", "completed"),))] >= 1
