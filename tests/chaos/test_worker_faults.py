"""Workers die: kill -9 mid-stream (migration), before prefill, while idle with work queued for them."""

from __future__ import annotations

import os
import signal
import time

import pytest

from farm.models.tokenization import chat_prompt_ids, get_tokenizer
from farm.protocol import TASK_DECODE
from farm.protocol.queues import direct_queue
from tests.chaos.harness import MODEL, ChaosFarm, collect, kill, wait_all_blocks_free
from tests.procs import send_and_read

pytestmark = pytest.mark.slow

N = 600  # greedy tokens per request (ignore_eos): long enough to kill a worker in the middle


@pytest.fixture(scope="module")
def farm(chaos_farm_factory) -> ChaosFarm:
    f = chaos_farm_factory()
    f.start_workers(("prefill", "prefill-1"), ("decode", "decode-1"), ("decode", "decode-2"))
    return f


@pytest.fixture(scope="module")
def prompt(farm) -> list[int]:
    return chat_prompt_ids(get_tokenizer(farm.cfg, MODEL), [{"role": "user", "content": "Tell me a long story."}])


@pytest.fixture(scope="module")
def reference(farm, prompt):
    """The request's greedy output with no fault: (token ids, text)."""
    events, text = collect(farm.gw.submit(farm.request(prompt, max_tokens=N, ignore_eos=True)))
    assert events[-1].type == "done" and events[-1].usage.completion_tokens == N
    return [i for e in events if e.type == "delta" for i in e.ids], text


def ids_of(events) -> list[int]:
    return [i for e in events if e.type == "delta" for i in e.ids]


def test_decode_worker_killed_mid_stream_migrates_with_identical_greedy_output(farm, prompt, reference):
    sub = farm.gw.submit(farm.request(prompt, max_tokens=N, ignore_eos=True))
    events, seen, victim, t_kill = [], 0, None, 0.0
    for ev in sub.events(first_timeout_s=60, idle_timeout_s=60):
        events.append(ev)
        if ev.type == "start" and ev.role == "decode" and victim is None:
            victim = ev.worker
        seen += ev.n if ev.type == "delta" else 0
        if victim and seen >= 20 and not t_kill:
            kill(farm.worker(victim))
            t_kill = time.monotonic()
    recovered_s = time.monotonic() - t_kill
    done = events[-1]
    assert done.type == "done", events[-3:]
    assert done.migrations == 1 and done.decode_worker != victim
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == N and done.usage.prompt_tokens == len(prompt)
    ref_ids, ref_text = reference
    assert ids_of(events) == ref_ids  # exactly the tokens of the run without the fault
    assert "".join(e.text for e in events if e.type == "delta") == ref_text
    assert recovered_s < 30
    farm.start_workers(("decode", "decode-3"))  # the next tests need two decode workers again


def test_beyond_the_migration_limit_the_stream_ends_with_a_clean_error(farm, prompt):
    from farm.gateway import Gateway

    cfg = farm.cfg.model_copy(update={"reliability": farm.cfg.reliability.model_copy(update={"max_migrations": 0})})
    gw = Gateway(cfg, farm.r, router=farm.gw.router)
    sub = gw.submit(farm.request(prompt, max_tokens=N, ignore_eos=True))
    victim, t0 = None, time.monotonic()
    events = []
    for ev in sub.events(first_timeout_s=60, idle_timeout_s=60):
        events.append(ev)
        if ev.type == "start" and ev.role == "decode" and victim is None:
            victim = farm.worker(ev.worker)
            kill(victim)
    assert events[-1].type == "error" and events[-1].code == "worker_lost", events[-1]
    assert time.monotonic() - t0 < 30  # never a hang


def test_idle_worker_that_vanishes_leaves_routing_and_its_queued_work_is_resent(farm, prompt, reference):
    spare = farm.start_workers(("decode", "decode-4"))[0]
    kill(spare)  # dies idle; a router that still sees its heartbeat places work on its own queue
    req = farm.request(prompt, max_tokens=N, ignore_eos=True)
    sub = send_and_read(farm.gw, req, TASK_DECODE, [None], direct_queue(spare.name))
    t0 = time.monotonic()
    while spare.name in farm.live():
        assert time.monotonic() - t0 < 10, "a dead worker stays in routing"
        time.sleep(0.2)
    events, text = collect(sub, 60)
    assert events[-1].type == "done" and events[-1].decode_worker != spare.name
    assert text == reference[1]
    assert farm.r.llen(direct_queue(spare.name)) == 0


def test_prefill_worker_killed_before_prefill_the_request_completes(farm, prompt, reference):
    prefill = farm.workers["prefill-1"]
    os.kill(prefill.pid, signal.SIGSTOP)  # placed on it while it still looks alive ...
    sub = farm.gw.submit(farm.request(prompt, max_tokens=N, ignore_eos=True))
    assert sub.dispatch.worker_id == prefill.name
    kill(prefill)  # ... and it dies before prefilling
    events, text = collect(sub, 60)
    assert events[-1].type == "done", events[-1]
    assert events[-1].prefill == "local" and events[-1].usage.completion_tokens == N
    assert text == reference[1]


def test_every_kv_block_is_free_after_the_faults(farm):
    clean, stats = wait_all_blocks_free(farm.r)
    assert clean, stats
