"""Real Celery worker processes on a real Redis: the disaggregated path, its fallback, aggregation."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from farm.config import load_config
from farm.gateway import Gateway
from farm.models.tokenization import chat_prompt_ids, get_tokenizer
from farm.protocol import TASK_DECODE, GenerationRequest, SamplingParams, queue_name
from farm.transfer.handle import sign_handle
from tests.conftest import free_port, make_farm_env
from tests.procs import WorkerProc, send_and_read, wait_registered


@pytest.fixture(scope="module")
def farm(redis_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers")
    env = make_farm_env(redis_url, tmp)
    env["FARM_DISAGGREGATION__MODE"] = "always"  # every request takes the handle path here
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    procs = [WorkerProc(env, "prefill", "prefill-t1", tmp), WorkerProc(env, "decode", "decode-t1", tmp)]
    try:
        wait_registered(r, procs)
        cfg = load_config(environ=env)
        yield cfg, r, procs
    finally:
        for p in procs:
            p.stop()


def request(cfg, text, **sampling) -> GenerationRequest:
    tok = get_tokenizer(cfg, cfg.default_model)
    ids = chat_prompt_ids(tok, [{"role": "user", "content": text}])
    return GenerationRequest(uuid.uuid4().hex, cfg.default_model, ids,
                             SamplingParams(**{"max_tokens": 40, "temperature": 0, **sampling}))


def collect(sub, timeout=120):
    events = list(sub.events(first_timeout_s=timeout, idle_timeout_s=timeout))
    text = "".join(e.text for e in events if e.type == "delta")
    return events, text


def test_disaggregated_request_uses_handle_across_processes(farm):
    cfg, r, (prefill, decode) = farm
    gw = Gateway(cfg, r)
    assert gw.layout(cfg.default_model) == "disaggregated"
    events, text = collect(gw.submit(request(cfg, "What is 2+2?")))
    done = events[-1]
    assert done.type == "done", events
    assert "4" in text
    assert done.prefill == "remote"
    assert done.prefill_worker == prefill.name and done.decode_worker == decode.name
    assert prefill.pid != decode.pid
    starts = [e for e in events if e.type == "start"]
    assert [s.role for s in starts] == ["prefill", "decode"]


def test_unpullable_handle_falls_back_to_local_prefill(farm):
    cfg, r, (prefill, decode) = farm
    gw = Gateway(cfg, r)
    req = request(cfg, "What is 2+2?")
    dead = sign_handle({
        "request_id": req.request_id, "worker_id": prefill.name, "endpoint": f"127.0.0.1:{free_port()}",
        "transport": "tcp", "block_ids": [0, 1, 2], "block_hashes": [], "num_tokens": len(req.prompt_token_ids),
        "first_token": 0, "cached_tokens": 0,
        "layout": {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "block_size": 16, "dtype": "float32"},
        "checksum": "0", "expires_at": time.time() + 60,
    }, b"test-secret-not-for-production")
    events, text = collect(send_and_read(gw, req, TASK_DECODE, [dead], queue_name(req.model, "decode")))
    assert events[-1].type == "done" and events[-1].prefill == "local"
    assert events[-1].prefill_worker == decode.name
    assert "4" in text


def test_disaggregated_output_equals_aggregated_engine(farm, real_model_dir):
    """Greedy parity: the handle path yields the same tokens as a local engine run."""
    from farm.engine.engine import Engine
    from tests.test_engine import run

    cfg, r, _ = farm
    req = request(cfg, "Write two sentences about the sea.", max_tokens=30)
    _, text = collect(Gateway(cfg, r).submit(req))
    eng = Engine(real_model_dir, cfg.engine.model_copy(update={"kv_cache_mb": 64}), 2048).start()
    try:
        local = run(eng, req.prompt_token_ids, req.sampling)
    finally:
        eng.stop()
    assert text == local.text


def test_cancel_stops_generation_on_the_worker(farm):
    cfg, r, _ = farm
    gw = Gateway(cfg, r)
    sub = gw.submit(request(cfg, "Tell me a very long story.", max_tokens=2000, ignore_eos=True))
    n = 0
    for ev in sub.events(first_timeout_s=120, idle_timeout_s=60):
        if ev.type == "delta":
            n += ev.n
            if n >= 5:
                sub.cancel()
        if ev.type == "done":
            assert ev.finish_reason == "abort"
            assert ev.usage.completion_tokens < 2000
            break
    else:
        pytest.fail("stream ended without done")


def with_disagg(cfg, **kw):
    return cfg.model_copy(update={"disaggregation": cfg.disaggregation.model_copy(update=kw)})


def test_conditional_disaggregation_prefills_short_prompts_locally_long_ones_remotely(farm):
    cfg, r, (prefill, decode) = farm
    gw = Gateway(with_disagg(cfg, mode="conditional", remote_min_uncached_tokens=300), r)
    assert gw.layout(cfg.default_model) == "conditional"
    short, _ = collect(gw.submit(request(cfg, "What is 2+2?", max_tokens=4)))
    assert short[-1].prefill == "local" and short[-1].prefill_worker == decode.name
    long_text = "Summarize the following notes. " + " ".join(f"Note {i}: the shipment {i} left on time." for i in range(60))
    long, _ = collect(gw.submit(request(cfg, long_text, max_tokens=4)))
    assert long[-1].prefill == "remote" and long[-1].prefill_worker == prefill.name


def test_never_mode_and_enforced_mode_without_prefill_workers(farm):
    cfg, r, (prefill, decode) = farm
    gw = Gateway(with_disagg(cfg, mode="never"), r)
    events, text = collect(gw.submit(request(cfg, "What is 2+2?")))
    assert events[-1].prefill == "local" and "4" in text
    from farm.gateway import NoWorkersError

    r2 = redis.Redis.from_url(str(cfg.redis.url).rsplit("/", 1)[0] + "/5")
    r2.flushdb()
    from farm.cluster import registry

    registry.register(r2, registry.WorkerInfo("lonely-decode", "decode", cfg.default_model, "h", 1, 16))
    with pytest.raises(NoWorkersError, match="always"):
        Gateway(with_disagg(cfg, mode="always"), r2).layout(cfg.default_model)


def test_block_pools_return_to_their_starting_state(farm):
    """After every request above (including cancelled and fallen-back ones) nothing is held or leaked."""
    import json

    from farm.cluster import registry

    cfg, r, procs = farm
    deadline = time.time() + 15
    while True:
        stats = {p.name: json.loads(r.get(registry.alive_key(p.name)) or "{}") for p in procs}
        clean = all(s.get("held") == 0 and s.get("running") == 0 and s.get("waiting") == 0
                    and s.get("blocks_free") == s.get("blocks_total") for s in stats.values())
        if clean or time.time() > deadline:
            break
        time.sleep(0.5)
    assert clean, stats


def test_worker_with_another_block_size_refuses_to_start(farm, tmp_path, redis_url):
    """Every worker of a model uses one block size: a worker that differs from the live ones exits loudly."""
    env = make_farm_env(redis_url, tmp_path)
    proc = WorkerProc(env, "decode", "odd-block", tmp_path, extra_env={"FARM_ENGINE__BLOCK_SIZE": "32"})
    assert proc.proc.wait(60) == 3
    assert "KV block size mismatch" in proc.tail()
    cfg, r, _ = farm
    from farm.cluster import registry

    assert proc.name not in {w.worker_id for w in registry.live_workers(r)}


def test_a_stage_that_fails_unexpectedly_fails_its_request_at_once():
    """A task's stage raising (a bug, a dependency's surprise) ends that request with an engine_error event for its
    reader and aborts its engine work, instead of leaving the client waiting for its timeout."""
    from types import SimpleNamespace

    from farm.protocol import ErrorEvent
    from farm.worker.runtime import WorkerRuntime

    calls: list[tuple] = []
    rt = SimpleNamespace(engine=SimpleNamespace(abort=lambda rid: calls.append(("abort", rid))),
                         streams=SimpleNamespace(emit_once=lambda rid, reader, ev: calls.append(("emit", rid, reader, ev))))
    req = GenerationRequest("r-1", "m", [1, 2], SamplingParams(max_tokens=2), reply_to="api-1")

    def broken() -> None:
        raise AttributeError("no such thing")

    WorkerRuntime.run(rt, req, broken)
    assert calls[0] == ("abort", "r-1")
    _, rid, reader, ev = calls[1]
    assert (rid, reader) == ("r-1", "api-1") and isinstance(ev, ErrorEvent) and ev.code == "engine_error"
    assert "AttributeError" in ev.message
    calls.clear()
    WorkerRuntime.run(rt, req, lambda: None)
    assert calls == []


def test_a_last_token_without_text_still_reaches_the_reader(farm):
    """The last output of a request went unsent when its text was empty (a special token the detokenizer skips, or
    bytes of an unfinished character): its id and log-probability were missing, so `logprobs.content` had one entry
    fewer than `completion_tokens`. Every token the engine counted now arrives, with its log-probability."""
    cfg, r, _ = farm
    tok = get_tokenizer(cfg, cfg.default_model)
    special = tok.convert_tokens_to_ids("<|im_start|>")  # skipped in text (skip_special_tokens), never EOS
    assert special not in (tok.eos_token_id, None)
    req = request(cfg, "Say something.", max_tokens=3, ignore_eos=True, logit_bias={special: 100.0}, logprobs=0)
    events, text = collect(Gateway(cfg, r).submit(req))
    done = events[-1]
    assert done.type == "done" and done.usage.completion_tokens == 3, events
    ids = [i for e in events if e.type == "delta" for i in e.ids]
    assert ids == [special] * 3 and text == ""
    assert sum(len(e.lp or []) for e in events if e.type == "delta") == 3
