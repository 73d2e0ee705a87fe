"""Response shapes, worker headers, SSE streaming and cancellation, against a scripted worker.

The worker is played by a thread on the real Redis: it takes the task from the worker's queue as
Celery would (kombu's list, JSON body) and writes the scripted events to the reply stream the request names
(one reply batch per event), so the API runs exactly its production path (gateway, reply reader, cancel keys)
without loading a model.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from flask import Flask

from farm.models.tokenization import chat_prompt_ids
from farm.protocol import EVENT_FIELD, GenerationRequest, cancel_key, encode_reply, reply_stream_key
from farm.protocol.queues import direct_queue
from farm.telemetry.prometheus import ITL_SECONDS
from tests.ghosts import ghost_alive
from tests.test_api_errors import GHOST, assert_error, chat, farm_app, post

USAGE = {"prompt_tokens": 9, "completion_tokens": 2, "cached_tokens": 4}


@pytest.fixture(scope="module")
def app(redis_url, tmp_path_factory) -> Iterator[Flask]:
    with farm_app(redis_url, tmp_path_factory.mktemp("api-stream")) as app:
        yield app


@contextlib.contextmanager
def live_ghost(app: Flask, redis_client: redis.Redis) -> Iterator[Any]:
    """One live worker (GHOST) of the app's default model, whose tasks a ScriptedWorker takes; the app's config."""
    cfg = app.extensions["farm"].cfg
    app.extensions["farm"].semantic()  # loaded before the first request
    with ghost_alive(redis_client, GHOST, cfg.default_model, cfg.engine.block_size):
        yield cfg


@pytest.fixture
def client(app, redis_client):
    """A test client, the config, and one live worker (GHOST) whose tasks the scripted worker takes."""
    with live_ghost(app, redis_client) as cfg:
        yield app.test_client(), cfg


class ScriptedWorker(threading.Thread):
    """Takes one task from GHOST's queue and writes `events` to that request's reader.

    On a connection of its own: the API can read the last event and the test end before this thread has read
    the reply to its XADD, and the test's client, closed at teardown, would cut that read."""

    def __init__(self, r: redis.Redis, events: list[dict[str, Any]] | Callable[[GenerationRequest], list[dict[str, Any]]],
                 gap_s: float = 0.0):
        super().__init__(daemon=True)
        self.gap_s = gap_s  # between one event and the next, as a worker's tokens come
        pool = r.connection_pool
        self.r = redis.Redis(connection_pool=type(pool)(connection_class=pool.connection_class, **pool.connection_kwargs))
        self.events = events
        self.request: GenerationRequest | None = None
        self.start()

    def run(self) -> None:
        try:
            popped = self.r.brpop([direct_queue(GHOST)], timeout=10)
            assert popped, "no task was queued"
            msg = json.loads(popped[1])
            args = json.loads(base64.b64decode(msg["body"]))[0]
            self.request = GenerationRequest.from_dict(args[0])
            writer = "scripted-" + uuid.uuid4().hex  # a reader skips sequence numbers it has seen from a writer
            events = self.events(self.request) if callable(self.events) else self.events
            for seq, ev in enumerate(events, start=1):
                if seq > 1:
                    time.sleep(self.gap_s)
                batch = encode_reply(writer, seq, {self.request.request_id: [ev]})
                self.r.xadd(reply_stream_key(self.request.reply_to), {EVENT_FIELD: batch})
        finally:
            self.r.connection_pool.disconnect()

    @property
    def request_id(self) -> str:
        self.join(10)
        assert self.request is not None
        return self.request.request_id


def both_start(worker: str = GHOST) -> dict[str, Any]:
    return {"type": "start", "role": "both", "worker": worker, "prefill_worker": worker, "prefill": "local"}


def deltas(*texts: str) -> list[dict[str, Any]]:
    return [{"type": "delta", "text": t, "n": 1, "ids": [100 + i]} for i, t in enumerate(texts)]


def done(reason: str = "stop", prefill_worker: str = GHOST, prefill: str = "local") -> dict[str, Any]:
    return {"type": "done", "finish_reason": reason, "usage": USAGE, "prefill_worker": prefill_worker,
            "decode_worker": GHOST, "prefill": prefill}


def sse(resp) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    out = []
    for block in resp.get_data(as_text=True).split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_chat_completion(client, redis_client):
    c, cfg = client
    w = ScriptedWorker(redis_client, [both_start(), *deltas("Hel", "lo"), done("length")])
    resp = post(c, "/v1/chat/completions", chat(cfg, max_tokens=2, temperature=0, seed=5, stop=["x"]))
    assert resp.status_code == 200, resp.data
    body = resp.get_json()
    assert body["id"] == w.request_id and body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion" and body["model"] == cfg.default_model
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert resp.headers["x-request-id"] == body["id"]
    assert (resp.headers["x-farm-prefill-worker"], resp.headers["x-farm-decode-worker"],
            resp.headers["x-farm-prefill"]) == (GHOST, GHOST, "local")
    s = w.request.sampling
    assert (s.max_tokens, s.temperature, s.seed, s.stop) == (2, 0.0, 5, ["x"])
    assert w.request.model == cfg.default_model and w.request.prompt_token_ids


def test_text_completion_and_default_max_tokens(client, redis_client):
    c, cfg = client
    w = ScriptedWorker(redis_client, [both_start(), *deltas(" world"), done()])
    resp = post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [1, 2, 3]})
    assert resp.status_code == 200, resp.data
    body = resp.get_json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": " world", "logprobs": None, "finish_reason": "stop"}]
    assert w.request.prompt_token_ids == [1, 2, 3]
    assert w.request.sampling.max_tokens == cfg.model(cfg.default_model).max_model_len - 3


def test_a_later_choice_is_timed_by_when_its_tokens_came_not_when_its_turn_to_be_read_came(client, redis_client):
    """Choices are generated together and read one after another: the second choice's tokens are all in when its
    turn comes, and timed at that moment they looked 0 s apart (farm_itl_seconds, and the planner's observations,
    saw half a request's inter-token latency)."""
    c, cfg = client
    hist = ITL_SECONDS.labels(model=cfg.default_model)

    def sum_and_count() -> tuple[float, float]:
        samples = {s.name: s.value for m in hist.collect() for s in m.samples}
        return samples["farm_itl_seconds_sum"], samples["farm_itl_seconds_count"]

    for stream in (False, True):
        before = sum_and_count()
        workers = [ScriptedWorker(redis_client, [both_start(), *deltas("a", "b", "c", "d", "e", "f"), done()],
                                  gap_s=0.05) for _ in range(2)]
        resp = post(c, "/v1/completions", {"model": cfg.default_model, "prompt": "x", "n": 2, "stream": stream})
        assert resp.status_code == 200 and resp.get_data(as_text=True)
        for w in workers:
            w.join(10)
        after = sum_and_count()
        assert after[1] - before[1] == 2
        assert (after[0] - before[0]) / 2 >= 0.045, "each choice's tokens came 50 ms apart"


def test_disaggregated_headers_name_both_workers(client, redis_client):
    """Stream: headers come from the decode start event; non-stream: from the done event."""
    c, cfg = client
    prefill_start = {"type": "start", "role": "prefill", "worker": "pre@x"}
    decode_start = {"type": "start", "role": "decode", "worker": GHOST, "prefill_worker": "pre@x",
                    "prefill": "remote"}
    finish = done(prefill_worker="pre@x", prefill="remote")
    ScriptedWorker(redis_client, [prefill_start, decode_start, *deltas("a"), finish])
    streamed = post(c, "/v1/chat/completions", chat(cfg, stream=True))
    ScriptedWorker(redis_client, [prefill_start, *deltas("a"), finish])
    whole = post(c, "/v1/chat/completions", chat(cfg))
    for resp in (streamed, whole):
        assert resp.status_code == 200
        assert (resp.headers["x-farm-prefill-worker"], resp.headers["x-farm-decode-worker"],
                resp.headers["x-farm-prefill"]) == ("pre@x", GHOST, "remote")


def test_chat_stream_with_usage(client, redis_client):
    c, cfg = client
    w = ScriptedWorker(redis_client, [both_start(), *deltas("Hel", "lo"), done()])
    resp = post(c, "/v1/chat/completions", chat(cfg, stream=True, stream_options={"include_usage": True}))
    assert resp.status_code == 200
    assert resp.mimetype == "text/event-stream"
    assert resp.headers["Cache-Control"] == "no-cache" and resp.headers["X-Accel-Buffering"] == "no"
    assert resp.headers["x-request-id"] == w.request_id and resp.headers["x-farm-decode-worker"] == GHOST
    chunks = sse(resp)
    assert chunks[-1] == "[DONE]"
    objs = chunks[:-1]
    for ch in objs:
        assert ch["id"] == w.request_id and ch["object"] == "chat.completion.chunk"
        assert ch["model"] == cfg.default_model and isinstance(ch["created"], int)
    assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in objs[:-1]) == "Hello"
    assert [ch["choices"][0]["finish_reason"] for ch in objs[:-2]] == [None, None, None]
    assert objs[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["total_tokens"] == 11
    assert not redis_client.exists(cancel_key(w.request_id)), "a finished request is not cancelled"


def test_completion_stream_without_usage(client, redis_client):
    c, cfg = client
    ScriptedWorker(redis_client, [both_start(), *deltas("a", "b"), done("length")])
    resp = post(c, "/v1/completions", {"model": cfg.default_model, "prompt": "x", "stream": True})
    chunks = sse(resp)
    assert chunks[-1] == "[DONE]"
    assert all(ch["object"] == "text_completion" and "usage" not in ch for ch in chunks[:-1])
    assert [ch["choices"][0]["text"] for ch in chunks[:-1]] == ["a", "b", ""]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_return_token_ids_as_vllm_returns_them(client, redis_client):
    """vLLM's `return_token_ids`: chat puts the prompt's ids on the response (streamed: on the role chunk), a text
    completion on each choice (streamed: on its first chunk); every choice, and every streamed delta, its own ids,
    a token whose text is still held (an empty delta) included."""
    c, cfg = client
    events = [both_start(), *deltas("Hel", "", "lo"), done()]
    w = ScriptedWorker(redis_client, events)
    body = post(c, "/v1/chat/completions", chat(cfg, return_token_ids=True)).get_json()
    assert body["prompt_token_ids"] == w.request.prompt_token_ids
    assert body["choices"][0]["token_ids"] == [100, 101, 102] and body["choices"][0]["message"]["content"] == "Hello"
    w = ScriptedWorker(redis_client, events)
    chunks = sse(post(c, "/v1/chat/completions", chat(cfg, return_token_ids=True, stream=True)))[:-1]
    assert chunks[0]["prompt_token_ids"] == w.request.prompt_token_ids and "prompt_token_ids" not in chunks[1]
    assert [i for ch in chunks for i in ch["choices"][0].get("token_ids", [])] == [100, 101, 102]
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == "Hello"
    w = ScriptedWorker(redis_client, events)
    body = post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [5, 6, 7],
                                       "return_token_ids": True}).get_json()
    assert "prompt_token_ids" not in body
    assert (body["choices"][0]["prompt_token_ids"], body["choices"][0]["token_ids"]) == ([5, 6, 7], [100, 101, 102])
    w = ScriptedWorker(redis_client, events)
    chunks = sse(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [5, 6, 7], "stream": True,
                                             "return_token_ids": True}))[:-1]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert all("prompt_token_ids" not in ch["choices"][0] for ch in chunks[1:])
    assert [i for ch in chunks for i in ch["choices"][0].get("token_ids", [])] == [100, 101, 102]
    w = ScriptedWorker(redis_client, events)  # not asked: OpenAI's shapes, no ids
    body = post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [5, 6, 7]}).get_json()
    assert set(body["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    w.join(10)


def test_prompt_logprobs_as_vllm_shows_them(client, redis_client):
    """vLLM's `prompt_logprobs`: a text completion's choice (a chat's response) holds null for the first prompt
    token, then {id: {logprob, rank, decoded_token}}: the token's own first, then the k most likely; -inf is
    -9999.0. Without `echo` they stay out of the choice's `logprobs`; with it, the echoed part keeps `logprobs`'
    own k. The worker computes the larger k. Not streamed, and -1 (the whole vocabulary) is refused."""
    c, cfg = client
    prompt_lp = [None, [-2.5, [[7, -0.5], [8, -1.0], [9, -2.0]], 4], [-0.5, [[3, -0.5], [1, -1.5], [2, -3.0]], 1],
                 [float("-inf"), [[4, -0.1], [5, -3.0], [6, -4.0]], 49000]]
    first = {"type": "delta", "text": "x", "n": 1, "ids": [11], "lp": [[-0.3, [[11, -0.3], [12, -2.0]]]],
             "prompt_lp": prompt_lp}
    events = [both_start(), first, done()]
    w = ScriptedWorker(redis_client, events)
    body = post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [1, 3, 3, 9], "prompt_logprobs": 2,
                                       "logprobs": 1}).get_json()
    assert w.request.sampling.prompt_logprobs == 2
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and list(got[1]) == ["3", "7", "8"]  # its own, then the best two
    assert got[1]["3"]["rank"] == 4 and got[1]["7"] == {"logprob": -0.5, "rank": 1, "decoded_token": got[1]["7"][
        "decoded_token"]} and isinstance(got[1]["7"]["decoded_token"], str)
    assert list(got[2]) == ["3", "1"] and got[2]["3"]["rank"] == 1  # its own is the best: one entry, rank 1
    assert got[3]["9"]["logprob"] == -9999.0 and got[3]["9"]["rank"] == 49000
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 1  # no echo: the completion's own only
    w = ScriptedWorker(redis_client, events)
    body = post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [1, 3, 3, 9], "prompt_logprobs": 0,
                                       "logprobs": 2, "echo": True}).get_json()
    assert w.request.sampling.prompt_logprobs == 2  # the larger of the two
    choice = body["choices"][0]
    assert [list(x) if x else x for x in choice["prompt_logprobs"]] == [None, ["3"], ["3"], ["9"]]
    assert [len(t) if t else t for t in choice["logprobs"]["top_logprobs"]] == [None, 3, 2, 3, 2]
    w = ScriptedWorker(redis_client, events)
    body = post(c, "/v1/chat/completions", chat(cfg, prompt_logprobs=1)).get_json()
    assert body["prompt_logprobs"][0] is None
    assert list(body["prompt_logprobs"][1]) == [str(w.request.prompt_token_ids[1]), "7"]  # the templated prompt's
    assert "prompt_logprobs" not in body["choices"][0]
    # n > 1: the prompt's first choice computes them (a worker sends them only when asked), every choice shows them
    def computed_if_asked(req: GenerationRequest) -> list[dict[str, Any]]:
        return [both_start(), first if req.sampling.prompt_logprobs is not None else {**first, "prompt_lp": None},
                done()]
    workers = [ScriptedWorker(redis_client, computed_if_asked) for _ in range(2)]
    body = post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [1, 3, 3, 9], "prompt_logprobs": 1,
                                       "n": 2}).get_json()
    assert sorted(w.request.sampling.prompt_logprobs is None for w in workers) == [False, True]
    assert [list(ch["prompt_logprobs"][1]) for ch in body["choices"]] == [["3", "7"], ["3", "7"]]
    workers = [ScriptedWorker(redis_client, computed_if_asked) for _ in range(2)]
    chunks = sse(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [1, 3, 3, 9], "echo": True,
                                             "logprobs": 1, "n": 2, "stream": True}))[:-1]  # streamed: an echo's
    assert sorted(w.request.sampling.prompt_logprobs is None for w in workers) == [False, True]
    echoed: dict[int, list] = {}
    for ch in chunks:
        for choice in ch["choices"]:
            echoed.setdefault(choice["index"], []).extend((choice.get("logprobs") or {}).get("token_logprobs", []))
    assert echoed[0] == echoed[1] == [None, -2.5, -0.5, -9999.0, -0.3]
    # a token a mask ruled out has -inf, which JSON cannot hold: -9999.0, as vLLM clamps it, streamed or not
    ruled_out = {**first, "lp": [[-0.3, [[11, -0.3], [12, float("-inf")]]]], "prompt_lp": None}
    for stream in (False, True):
        ScriptedWorker(redis_client, [both_start(), ruled_out, done()])
        resp = post(c, "/v1/chat/completions", chat(cfg, logprobs=True, top_logprobs=2, stream=stream))
        assert "Infinity" not in resp.get_data(as_text=True)
        assert [-0.3, -9999.0] == [t["logprob"] for t in ([ch for ch in sse(resp)[:-1] if ch["choices"]][1]["choices"]
                                                          if stream else resp.get_json()["choices"])[0]["logprobs"][
            "content"][0]["top_logprobs"]]
    for bad in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": -1}, {"prompt_logprobs": 21},
                {"prompt_logprobs": "2"}):
        assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": "x", **bad}), 400,
                     "prompt_logprobs")


def test_truncate_prompt_tokens_keeps_what_vllm_keeps(app, client, redis_client, monkeypatch):
    """vLLM's `truncate_prompt_tokens`: the worker gets the prompt's last k tokens ('left', vLLM's default for
    generation) or its first ('right'); -1 keeps what the context leaves beside max_tokens. A prompt past the
    context, even past its character limit, is cut instead of refused; an echo is the prompt the model read."""
    c, cfg = client
    tok = app.extensions["farm"].tokenizer(cfg.default_model)
    max_len = cfg.model(cfg.default_model).max_model_len
    events = [both_start(), *deltas("x"), done()]
    ids = list(range(10, 30))
    for extra, kept in (({}, ids[-5:]), ({"truncation_side": "right"}, ids[:5])):
        w = ScriptedWorker(redis_client, events)
        body = post(c, "/v1/completions", {"model": cfg.default_model, "prompt": ids, "truncate_prompt_tokens": 5,
                                           "return_token_ids": True, **extra}).get_json()
        assert w.request.prompt_token_ids == kept == body["choices"][0]["prompt_token_ids"]
    w = ScriptedWorker(redis_client, events)  # past the context: cut to what max_tokens leaves
    post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [7] * (max_len + 50) + [8, 9],
                                "truncate_prompt_tokens": -1, "max_tokens": 4})
    assert len(w.request.prompt_token_ids) == max_len - 4 and w.request.prompt_token_ids[-2:] == [8, 9]
    text = "".join(f"w{i} " for i in range(max_len * 25))  # past the character limit: without truncation a 400
    assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": text}), 400, "prompt",
                 "context_length_exceeded")
    w = ScriptedWorker(redis_client, events)
    body = post(c, "/v1/completions", {"model": cfg.default_model, "prompt": text, "truncate_prompt_tokens": 12,
                                       "echo": True, "max_tokens": 1}).get_json()
    assert w.request.prompt_token_ids == tok.encode(text[-2000:], add_special_tokens=False)[-12:]
    assert body["choices"][0]["text"] == tok.decode(w.request.prompt_token_ids) + "x"
    layer = app.extensions["farm"].semantic()  # the semantic layer reads what a model may read, not the whole text
    seen, before = [], layer.before
    monkeypatch.setattr(layer, "before", lambda model, messages, **kw: seen.append(messages) or before(
        model, messages, **kw))
    w = ScriptedWorker(redis_client, events)  # a chat: the templated conversation's last tokens
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert post(c, "/v1/chat/completions", chat(cfg, messages=messages, truncate_prompt_tokens=16)).status_code == 200
    # the turns stay (a template checking the order of roles renders them as it would the whole), emptied past the cut
    assert [(m["role"], m["content"]) for m in seen[0][:1]] == [("system", "")] and len(seen[0]) == 2
    assert text.endswith(seen[0][1]["content"]) and len(seen[0][1]["content"]) < 1000
    whole = chat_prompt_ids(tok, [{"role": "user", "content": text[-3000:]}])
    assert w.request.prompt_token_ids == whole[-16:]
    for bad in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2}, {"truncate_prompt_tokens": "5"},
                {"truncate_prompt_tokens": True}, {"truncate_prompt_tokens": max_len, "max_tokens": 1},
                {"truncate_prompt_tokens": 5, "truncation_side": "middle"}):
        param = "truncation_side" if "truncation_side" in bad else "truncate_prompt_tokens"
        assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": ids, **bad}), 400, param)
        assert_error(post(c, "/v1/chat/completions", chat(cfg, **bad)), 400, param)


def test_worker_error_is_json_500_before_the_stream_and_in_band_after(client, redis_client):
    c, cfg = client
    oom = {"type": "error", "message": "out of KV blocks", "code": "kv_exhausted"}
    ScriptedWorker(redis_client, [both_start(), *deltas("a"), oom])
    err = assert_error(post(c, "/v1/chat/completions", chat(cfg)), 500, code="kv_exhausted")
    assert "out of KV blocks" in err["message"]
    ScriptedWorker(redis_client, [oom])
    assert_error(post(c, "/v1/chat/completions", chat(cfg, stream=True)), 500, code="kv_exhausted")
    ScriptedWorker(redis_client, [both_start(), *deltas("a"), oom])
    chunks = sse(post(c, "/v1/chat/completions", chat(cfg, stream=True)))
    assert chunks[-1] == "[DONE]"
    assert chunks[-2] == {"error": {"message": "generation failed: out of KV blocks", "type": "server_error",
                                    "param": None, "code": "kv_exhausted"}}


def test_streamed_choices_come_interleaved_as_their_tokens_come(client, redis_client):
    """vLLM sends every choice's tokens as they come; read choice after choice, the client saw nothing of the second
    until the first had ended. A choice that fails mid-stream ends the response with an error, and the others are
    cancelled."""
    c, cfg = client
    workers = [ScriptedWorker(redis_client, [both_start(), *deltas("a", "b", "c", "d", "e", "f"), done()],
                              gap_s=0.05) for _ in range(2)]
    chunks = sse(post(c, "/v1/chat/completions", chat(cfg, n=2, stream=True)))
    assert chunks[-1] == "[DONE]"
    order = [ch["choices"][0]["index"] for ch in chunks[:-1] if ch["choices"][0]["delta"].get("content")]
    assert sorted(order) == [0] * 6 + [1] * 6 and order != sorted(order), order
    for index in (0, 1):
        mine = [ch["choices"][0] for ch in chunks[:-1] if ch["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and mine[-1]["finish_reason"] == "stop"
        assert "".join(ch["delta"].get("content", "") for ch in mine) == "abcdef"
    assert not any(redis_client.exists(cancel_key(w.request_id)) for w in workers), "finished choices are not cancelled"

    oom = {"type": "error", "message": "out of KV blocks", "code": "kv_exhausted"}
    scripts = [[both_start(), *deltas(*"abcdefghijklmnopqrst"), done()], [both_start(), *deltas("a"), oom]]
    taken: dict[str, list[dict[str, Any]]] = {}
    workers = [ScriptedWorker(redis_client, lambda req: taken.setdefault(req.request_id, scripts.pop()), gap_s=0.05)
               for _ in range(2)]
    chunks = sse(post(c, "/v1/chat/completions", chat(cfg, n=2, stream=True)))
    assert chunks[-1] == "[DONE]" and chunks[-2]["error"]["code"] == "kv_exhausted"
    assert not any(ch["choices"][0]["finish_reason"] == "stop" for ch in chunks[:-2]), "the long choice was cut"
    long_id = next(rid for rid, script in taken.items() if len(script) > 5)
    assert {w.request_id for w in workers} == set(taken) and redis_client.exists(cancel_key(long_id))


def test_a_malformed_worker_event_fails_its_request_it_does_not_leave_a_hole(client, redis_client):
    """An event the reader cannot parse (a worker's bug, or a newer worker's event type) ends the request with an
    error after the text before it, never a 200 whose text silently lacks what the event carried."""
    c, cfg = client
    ScriptedWorker(redis_client, [both_start(), *deltas("Hel"), {"type": "progress"}, *deltas("lo"), done()])
    assert_error(post(c, "/v1/chat/completions", chat(cfg)), 500, code="bad_event")
    ScriptedWorker(redis_client, [both_start(), *deltas("Hel"), {"type": "delta", "text": "lo"}, done()])
    chunks = sse(post(c, "/v1/chat/completions", chat(cfg, stream=True)))
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks[:-2] if ch.get("choices")) == "Hel"
    assert chunks[-2]["error"]["code"] == "bad_event" and chunks[-1] == "[DONE]"


def test_client_disconnect_cancels_the_request(client, redis_client):
    """Closing the response mid-stream (what the server does when the client goes) sets the cancel key."""
    c, cfg = client
    w = ScriptedWorker(redis_client, [both_start(), *deltas("a")])  # never finishes
    resp = post(c, "/v1/chat/completions", chat(cfg, stream=True), buffered=False)
    assert resp.status_code == 200
    assert b"assistant" in next(iter(resp.response))
    assert not redis_client.exists(cancel_key(w.request_id))
    resp.close()
    assert redis_client.get(cancel_key(w.request_id)) == b"1"


def test_silence_mid_stream_ends_with_timeout_error_and_cancels(client, redis_client, monkeypatch):
    c, cfg = client
    monkeypatch.setattr(cfg.api, "request_timeout_s", 0.5)
    w = ScriptedWorker(redis_client, [both_start(), *deltas("a")])  # then silence
    chunks = sse(post(c, "/v1/chat/completions", chat(cfg, stream=True)))
    assert chunks[-1] == "[DONE]" and chunks[-2]["error"]["code"] == "timeout"
    assert redis_client.get(cancel_key(w.request_id)) == b"1"
