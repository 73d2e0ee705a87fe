"""Redis restarts mid-stream (AOF on) and an API process dies mid-stream: nothing lost, nothing orphaned."""

from __future__ import annotations

import signal
import time

import pytest
import redis

from farm.models.tokenization import chat_prompt_ids, get_tokenizer
from farm.protocol import ErrorEvent
from farm.worker.stream_writer import StreamWriter
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


def test_a_decode_task_redis_refused_is_sent_again(farm, prompt):
    """Redis refused writes (a full Redis under `noeviction` answers OOM) just as the prefill sent the decode task:
    the hand-over's exception was logged and the request was lost, with both workers alive, until the reader's idle
    timeout (600 s by default, then a 504). The prefill now sends the task again until Redis takes it."""
    farm.heal()  # every worker in routing (the test before restarted Redis)
    ref_events, ref_text = collect(farm.gw.submit(farm.request(prompt, max_tokens=48, ignore_eos=True)))
    assert ref_events[-1].type == "done"
    prefill = farm.workers["prefill-1"]
    prefill.proc.send_signal(signal.SIGSTOP)  # the request waits in its queue ...
    try:
        sub = farm.gw.submit(farm.request(prompt, max_tokens=48, ignore_eos=True))
        farm.r.config_set("maxmemory", 1)  # ... while Redis refuses every write
    finally:
        prefill.proc.send_signal(signal.SIGCONT)  # the prefill runs and hands over inside the refusal
    time.sleep(1.5)  # well within the workers' heartbeat TTL: nobody is judged lost, nothing migrates
    farm.r.config_set("maxmemory", 0)
    t0 = time.monotonic()
    events, text = collect(sub, timeout=40)  # a GatewayTimeout before
    assert events[-1].type == "done" and text == ref_text and sub.migrations == 0, events[-1]
    assert time.monotonic() - t0 < 30


def test_a_failed_hand_over_places_the_request_again(farm, prompt):
    """When the hand-over fails for good (Redis refusing past HANDOVER_SEND_S, or anything else), the prefill says so
    (an `error` with ErrorEvent.HANDOVER_FAILED) and the reader places the request again instead of ending it or
    waiting out its timeout. Here that error is written as the prefill writes it, while the prefill is stopped."""
    farm.heal()
    ref_events, ref_text = collect(farm.gw.submit(farm.request(prompt, max_tokens=48, ignore_eos=True)))
    prefill = farm.workers["prefill-1"]
    prefill.proc.send_signal(signal.SIGSTOP)
    try:
        sub = farm.gw.submit(farm.request(prompt, max_tokens=48, ignore_eos=True))
        writer = StreamWriter(farm.r)
        writer.emit_once(sub.attempt_id, sub.req.reply_to, ErrorEvent("hand-over failed", ErrorEvent.HANDOVER_FAILED))
        assert writer.flush()
    finally:
        prefill.proc.send_signal(signal.SIGCONT)
    events, text = collect(sub, timeout=40)
    assert events[-1].type == "done" and text == ref_text, events[-1]
    assert sub.migrations == 1 and not any(e.type == "error" for e in events)
    farm.heal()  # the stopped worker's heartbeat may have lapsed: back in routing for the tests after


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
