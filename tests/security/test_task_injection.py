"""Item 2 (work injected through Redis): a `farm.decode` task with `prompt_token_ids=[10**9, -5, 3]` made
the engine raise OverflowError inside its step loop, which failed every active sequence: an unrelated
stream ended with `generation failed: Python integer -5 out of bounds for uint32`.

Workers now check every task as untrusted input (farm.protocol: types, ranges, token ids within the
model's vocabulary, sizes bounded by max_model_len), so a bad task fails only its own request, with an
`invalid_task` error on its stream; and the engine finishes only the offending sequence if one still
gets into a batch. Here: straight through Celery to a real worker while a legitimate stream runs; and
the engine's own guard with sequences that bypass every check."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from farm.config import EngineConfig, load_config
from farm.engine.engine import Engine
from farm.engine.scheduler import Sequence
from farm.gateway import Gateway
from farm.infra.broker import make_celery
from farm.models.tokenization import IncrementalDetokenizer, chat_prompt_ids, get_tokenizer
from farm.protocol import (
    EVENT_FIELD,
    TASK_DECODE,
    TASK_GENERATE,
    Event,
    GenerationRequest,
    InvalidTask,
    SamplingParams,
    decode_reply,
    queue_name,
    reply_stream_key,
)
from tests.conftest import make_farm_env
from tests.procs import WorkerProc, wait_registered
from tests.test_engine import Collector

LEGIT = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)


INJECTED_READER = "inject-reader"  # where the workers report on the tasks sent by hand


def good_message(**kw) -> dict:
    d = GenerationRequest(uuid.uuid4().hex, "m", [1, 2, 3], SamplingParams(max_tokens=8),
                          reply_to=INJECTED_READER).to_dict()
    d.update(kw)
    return d


# -- the task message, as untrusted input -----------------------------------------------------------------
@pytest.mark.parametrize("change", [
    {"prompt_token_ids": [10**9, -5, 3]}, {"prompt_token_ids": [49152]}, {"prompt_token_ids": []},
    {"prompt_token_ids": [1] * 4097}, {"prompt_token_ids": [1.5]}, {"prompt_token_ids": [True]},
    {"prompt_token_ids": "123"}, {"request_id": 5}, {"request_id": "x" * 300}, {"request_id": "a b"},
    {"request_id": ""}, {"model": None}, {"decode_queue": "celery"}, {"decode_queue": ["farm.x"]},
    {"created": "now"}, {"lease_s": -1}, {"lease_s": float("nan")}, {"origin": "../x"},
    {"sampling": None}, {"sampling": {"max_tokens": 0}}, {"sampling": {"max_tokens": 5000}},
    {"sampling": {"max_tokens": "8"}}, {"sampling": {"temperature": -1}}, {"sampling": {"temperature": "hot"}},
    {"sampling": {"temperature": float("inf")}}, {"sampling": {"top_p": 0}}, {"sampling": {"top_p": 2}},
    {"sampling": {"seed": 1.5}}, {"sampling": {"seed": 10**30}}, {"sampling": {"stop": "x"}},
    {"sampling": {"stop": ["a"] * 5}}, {"sampling": {"stop": ["x" * 2000]}}, {"sampling": {"ignore_eos": 1}},
    {"sampling": {"top_k": -1}}, {"sampling": {"min_p": 2}}, {"sampling": {"repetition_penalty": 0}},
    {"sampling": {"presence_penalty": 3}}, {"sampling": {"min_tokens": 5000}}, {"sampling": {"logprobs": 21}},
    {"sampling": {"stop_token_ids": [49152]}}, {"sampling": {"stop_token_ids": [1] * 65}},
    {"sampling": {"logit_bias": {"-5": 1}}}, {"sampling": {"logit_bias": {"5": 1000}}},
    {"sampling": {"logit_bias": {"60000": 1}}}, {"sampling": {"response_format": {"type": "xml"}}},
    {"sampling": {"logit_bias": {"\u00b2": 1}}},  # a digit to str.isdigit, not to int(): once a ValueError
    {"sampling": {"temperature": 10**400}},
    {"sampling": {"response_format": {"type": ["json_object"]}}},  # unhashable: once a TypeError, not refused
    {"sampling": {"response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}}},
    {"sampling": {"response_format": {"type": "regex", "regex": ["a"]}}},
    {"sampling": {"response_format": {"type": "grammar"}}},
    {"sampling": {"response_format": {"type": "choice", "choice": []}}},
    {"sampling": {"response_format": {"type": "choice", "choice": ["a", 2]}}},
])
def test_bad_task_messages_are_refused(change):
    with pytest.raises(InvalidTask):
        GenerationRequest.from_dict(good_message(**change), vocab_size=49152, max_model_len=4096)


def test_good_task_messages_pass_unchanged():
    msg = good_message(decode_queue="farm.w.decode-1@host", lease_s=10.0, origin="chatcmpl-abc.m1",
                       sampling={"max_tokens": 4096, "temperature": 2, "top_p": 1, "seed": -5, "stop": ["\n"],
                                 "ignore_eos": True})
    req = GenerationRequest.from_dict(msg, vocab_size=49152, max_model_len=4096)
    assert req.to_dict() == {**msg, "sampling": {**SamplingParams().to_dict(), **msg["sampling"], "temperature": 2.0,
                                                 "top_p": 1.0}}
    extras = {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.2, "presence_penalty": -0.5, "min_tokens": 3,
              "stop_token_ids": [2, 7], "logprobs": 5, "logit_bias": {"17": -100}, "response_format": None}
    req = GenerationRequest.from_dict(json.loads(json.dumps(good_message(sampling=extras))), vocab_size=49152)
    assert req.sampling.logit_bias == {17: -100.0} and req.sampling.top_k == 40 and req.sampling.logprobs == 5
    with pytest.raises(InvalidTask):
        GenerationRequest.from_dict(["not", "an", "object"])


def test_what_the_api_accepts_a_worker_accepts(redis_url, tmp_path):
    """The worker's checks never refuse a request the API let through (that would be a 5xx): the API's
    extremes pass them, and the API refuses what they refuse with a 400 of its own."""
    from tests.security_helpers import assert_openai_error, farm_app

    edge = {"max_tokens": 4096, "temperature": 2, "top_p": 1e-9, "seed": (1 << 64) - 1, "stop": ["s" * 1024] * 4,
            "ignore_eos": True}
    GenerationRequest.from_dict(good_message(sampling=edge), vocab_size=49152, max_model_len=4096)
    GenerationRequest.from_dict(good_message(sampling={**edge, "seed": -(1 << 63)}), vocab_size=49152)
    with farm_app(redis_url, tmp_path) as app:
        c = app.test_client()
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}
        assert_openai_error(c.post("/v1/chat/completions", json={**body, "seed": 1 << 64}), 400, param="seed")
        assert_openai_error(c.post("/v1/chat/completions", json={**body, "stop": ["s" * 1025]}), 400, param="stop")


# -- the engine's own guard: only the offending sequence ends ------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Iterator[Engine]:
    eng = Engine(tiny_model_dir, EngineConfig(block_size=4, kv_cache_mb=16, kv_tiers={"host_mb": 0, "disk_mb": 0}),
                 max_model_len=256).start()
    yield eng
    eng.stop()


def sequence(engine: Engine, rid: str, ids: list[int], c: Collector, **kw) -> Sequence:
    seq = Sequence(rid, ids, kw.pop("params", SamplingParams(max_tokens=5)), c, max_len=256, **kw)
    seq.detok = IncrementalDetokenizer(engine.tokenizer)
    return seq


def past_admission(engine: Engine, *seqs: Sequence) -> None:
    """Into the running batch as if every check had missed them (on the engine thread, between steps)."""
    def add() -> None:
        for seq in seqs:
            engine._by_id[seq.request_id] = seq
            engine.scheduler.add(seq)

    engine.call(add)


def test_a_bad_sequence_fails_alone_and_the_batch_goes_on(engine):
    legit = [Collector() for _ in range(3)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for i, c in enumerate(legit):
        engine.submit(f"legit-{i}", [5 + i, 6, 7, 8, 9], params, c)
    while not all(c.outs for c in legit):  # decoding together now
        time.sleep(0.005)
    # 1. checked at admission
    admitted = Collector()
    engine._post(("add", sequence(engine, "bad-ids", [10**9, -5, 3], admitted)))
    # 2. the issue's OverflowError, raised by the step loop itself (block hashing): only that one ends
    overflow = Collector()
    past_admission(engine, sequence(engine, "overflow", [10**9, -5, 3] * 3, overflow))
    # 3. valid ids and parameters, but its sampling raises inside a batch it shares with a good newcomer
    poisoned, late = Collector(), Collector()
    past_admission(engine, sequence(engine, "late", [21, 22, 23, 24], late, params=params),
                   sequence(engine, "poisoned", [11, 12, 13], poisoned, generator=object(),
                            params=SamplingParams(max_tokens=5, temperature=1.0)))
    assert admitted.wait().last.finish_reason.startswith("error:invalid request: token ids")
    assert overflow.wait().last.finish_reason.startswith("error:invalid request: token ids")
    assert poisoned.wait().last.finish_reason.startswith("error:")
    for c in [*legit, late]:
        assert c.wait().last.finish_reason == "length" and sum(len(o.token_ids) for o in c.outs) == 60, c.last
    deadline = time.monotonic() + 10
    while engine.scheduler.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.pool.num_free == engine.pool.num_blocks  # every block came back (cached ones are free)


@pytest.mark.parametrize("temperature", [1.0706374692559244e-308, 1e-40, 1e-6])
def test_a_subnormal_temperature_samples_greedily(engine, temperature):
    """Found by the fuzzing run: logits / 1e-308 is inf, softmax NaN, and sampling raised (a 500)."""
    c = Collector()
    engine.submit(f"tiny-t-{temperature}", [5, 6, 7], SamplingParams(max_tokens=4, temperature=temperature,
                                                                   ignore_eos=True), c)
    assert c.wait().last.finish_reason == "length" and len(c.token_ids) == 4


def test_submit_refuses_what_torch_would_choke_on(engine):
    c = Collector()
    engine.submit("bad-seed", [1, 2, 3], SamplingParams(max_tokens=2, temperature=1.0, seed="x"), c)  # type: ignore
    assert c.wait().last.finish_reason.startswith("error:invalid request")


# -- through Celery, to a real worker, while a legitimate stream runs ----------------------------------------
@pytest.fixture(scope="module")
def worker(redis_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("injection")
    env = make_farm_env(redis_url, tmp)
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    proc = WorkerProc(env, "both", "both-inject", tmp)
    try:
        wait_registered(r, [proc])
        yield load_config(environ=env), r, proc
    finally:
        proc.stop()


def first_event(r: redis.Redis, rid: str, timeout: float = 60) -> Event:
    """The first event the workers sent for `rid` to the injected tasks' reader."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _, fields in r.xrange(reply_stream_key(INJECTED_READER)):
            events = decode_reply(fields[EVENT_FIELD.encode()]).events.get(rid)
            if events:
                return events[0]
        time.sleep(0.05)
    raise AssertionError(f"no event for {rid} on {reply_stream_key(INJECTED_READER)}")


def test_bad_tasks_through_celery_fail_only_themselves(worker):
    cfg, r, proc = worker
    gw = Gateway(cfg, r)
    celery = make_celery(cfg)  # messages sent by hand, as any client holding the Redis password could
    model = cfg.default_model
    ids = chat_prompt_ids(get_tokenizer(cfg, model), [{"role": "user", "content": "Count from one to fifty."}])
    legit = GenerationRequest(uuid.uuid4().hex, model, ids, LEGIT)
    sub = gw.submit(legit)
    events = sub.events(first_timeout_s=120, idle_timeout_s=120)
    seen = []
    for ev in events:  # until the legitimate request is decoding
        seen.append(ev)
        if ev.type == "delta":
            break
    bad: dict[str, tuple[str, list]] = {}

    def send(task: str, msg: dict, *extra) -> None:
        q = queue_name(model, "generate" if task == TASK_GENERATE else "decode")
        celery.send_task(task, args=[msg, *extra], queue=q)
        bad[msg["request_id"]] = (task, extra)

    rid = lambda: "evil-" + uuid.uuid4().hex  # noqa: E731
    send(TASK_DECODE, {**good_message(request_id=rid(), model=model), "prompt_token_ids": [10**9, -5, 3]}, None)
    send(TASK_GENERATE, {**good_message(request_id=rid(), model=model), "prompt_token_ids": [10**9, -5, 3]})
    send(TASK_GENERATE, good_message(request_id=rid(), model=model, sampling={"temperature": "hot"}))
    send(TASK_GENERATE, good_message(request_id=rid(), model=model, prompt_token_ids=[7] * 5000))
    send(TASK_GENERATE, good_message(request_id=rid(), model="someone-elses-model"))
    send(TASK_DECODE, good_message(request_id=rid(), model=model), "not a handle")
    celery.send_task(TASK_GENERATE, args=["not an object"], queue=queue_name(model, "generate"))
    celery.send_task(TASK_GENERATE, args=[good_message(request_id=7, model=model)],
                        queue=queue_name(model, "generate"))
    for rid_, (task, _) in bad.items():
        ev = first_event(r, rid_)
        assert ev.type == "error" and ev.code == "invalid_task", (task, ev)
        assert ev.message.startswith("invalid task: ")
    rest = list(events)  # the legitimate stream runs to its end
    assert sum(e.type == "delta" for e in rest) > 0  # it was still decoding after every bad task was refused
    seen.extend(rest)
    done = seen[-1]
    assert done.type == "done" and done.finish_reason == "length", seen[-3:]
    assert sum(e.n for e in seen if e.type == "delta") == LEGIT.max_tokens
    assert proc.proc.poll() is None
    again = gw.submit(GenerationRequest(uuid.uuid4().hex, model, ids, SamplingParams(max_tokens=4, temperature=0)))
    assert list(again.events(first_timeout_s=120, idle_timeout_s=120))[-1].type == "done"
