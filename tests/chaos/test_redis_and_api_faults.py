"""Redis restarts mid-stream (AOF on) and an API process dies mid-stream: nothing lost, nothing orphaned."""

from __future__ import annotations

import time

import pytest
import redis

from farm.models.tokenization import chat_prompt_ids, get_tokenizer
from tests.chaos.harness import MODEL, ChaosFarm, collect, kill, per_request_keys_without_ttl, reader_process

pytestmark = pytest.mark.slow

N = 300


@pytest.fixture(scope="module")
def farm(chaos_farm_factory) -> ChaosFarm:
    f = chaos_farm_factory()
    f.start_workers(("prefill", "prefill-1"), ("decode", "decode-1"))
    return f


@pytest.fixture(scope="module")
def prompt(farm) -> list[int]:
    return chat_prompt_ids(get_tokenizer(farm.cfg, MODEL), [{"role": "user", "content": "Tell me a long story."}])


def test_redis_restart_mid_stream_loses_no_token_and_workers_consume_again(farm, prompt):
    ref_events, ref_text = collect(farm.gw.submit(farm.request(prompt, max_tokens=N, ignore_eos=True)))
    assert ref_events[-1].type == "done"
    sub = farm.gw.submit(farm.request(prompt, max_tokens=N, ignore_eos=True))
    events, seen, restarted = [], 0, False
    for ev in sub.events(first_timeout_s=90, idle_timeout_s=90):
        events.append(ev)
        seen += ev.n if ev.type == "delta" else 0
        if seen >= 20 and not restarted:
            farm.redis.stop()
            time.sleep(1.5)
            farm.redis.start()
            restarted = True
    assert restarted and events[-1].type == "done", events[-1]
    assert events[-1].usage.completion_tokens == N  # counted once, nothing missing
    assert "".join(e.text for e in events if e.type == "delta") == ref_text
    # Celery's Redis transport in a worker that was acking when the connection dropped can fail
    # unrecoverably (kombu: the connection's client is gone); such a worker finishes its requests (above)
    # and exits, and its supervisor starts it again. Either way, workers consume new work afterwards.
    farm.heal()
    events, text = collect(farm.gw.submit(farm.request(prompt, max_tokens=N, ignore_eos=True)), 90)
    assert events[-1].type == "done" and text == ref_text, events[-1]


def test_api_killed_mid_stream_stops_the_orphaned_generation(farm, prompt):
    req = farm.request(prompt, max_tokens=1800, ignore_eos=True)  # minutes of work if nobody stops it
    reader = reader_process(farm.env, req)
    assert reader.stdout is not None
    for _ in range(5):
        assert reader.stdout.readline()  # it is generating
    kill(reader)
    t0 = time.monotonic()
    while any(farm.stats(w).get("running", 0) for w in farm.live()):
        assert time.monotonic() - t0 < 30, "the worker kept generating for a dead reader"
        time.sleep(0.2)
    assert time.monotonic() - t0 < farm.cfg.reliability.lease_ttl_s * 2 + 10


def test_no_per_request_key_outlives_its_ttl(farm):
    try:
        assert per_request_keys_without_ttl(farm.r) == []
    except redis.RedisError as e:  # pragma: no cover - Redis must be up here
        pytest.fail(f"redis: {e}")
