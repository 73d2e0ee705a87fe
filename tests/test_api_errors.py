"""Bad input gets an OpenAI-shaped JSON error with the right status, and nothing is queued."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from flask import Flask

from api.app import create_app
from farm.config import get_config
from farm.protocol.queues import direct_queue
from farm.telemetry import prometheus
from tests.conftest import make_farm_env
from tests.ghosts import ghost_alive

GHOST = "ghost@test"


@contextmanager
def farm_app(redis_url: str, tmp: Path) -> Iterator[Flask]:
    """`create_app()` under the `farm_env` environment, for a module-scoped fixture: building and
    stopping an app (its router follows KV events on a thread) per test costs ~0.6 s."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in make_farm_env(redis_url, tmp).items():
            mp.setenv(k, v)
        get_config.cache_clear()
        app = create_app()
        try:
            yield app
        finally:
            app.extensions["farm"].gateway.stop()
            get_config.cache_clear()


@pytest.fixture(scope="module")
def app(redis_url, tmp_path_factory) -> Iterator[Flask]:
    with farm_app(redis_url, tmp_path_factory.mktemp("api")) as app:
        yield app


@pytest.fixture
def app_client(app, redis_client):
    """A test client on an empty Redis (no workers), and the app's config."""
    return app.test_client(), app.extensions["farm"].cfg


@pytest.fixture
def with_worker(app_client, redis_client):
    """A registered worker (its queue is never consumed): requests that pass validation get queued."""
    _, cfg = app_client
    with ghost_alive(redis_client, GHOST, cfg.default_model, cfg.engine.block_size):
        yield


def post(client, path, body, raw=False, **kw):
    data = body if raw else json.dumps(body)
    return client.post(path, data=data, content_type="application/json", **kw)


def assert_error(resp, status, param=None, code=None):
    """The exact OpenAI error shape: JSON {"error": {message, type, param, code}} with `status`."""
    assert resp.status_code == status, resp.data
    assert resp.content_type.startswith("application/json")
    body = resp.get_json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def chat(cfg, **kw):
    return {"model": cfg.default_model, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_malformed_json_and_non_object(app_client):
    c, _ = app_client
    assert_error(post(c, "/v1/chat/completions", "{not json", raw=True), 400)
    assert_error(post(c, "/v1/chat/completions", "[1, 2]", raw=True), 400)
    assert_error(post(c, "/v1/chat/completions", "", raw=True), 400)
    assert_error(post(c, "/v1/chat/completions", b"\xff\xfe", raw=True), 400)
    # Python's json would take NaN; strict JSON does not, so no NaN temperature gets through
    assert_error(post(c, "/v1/chat/completions", '{"model": "m", "temperature": NaN}', raw=True), 400)
    assert_error(c.post("/v1/completions", data="not json", content_type="text/plain"), 415, "Content-Type",
                 "unsupported_media_type")  # JSON endpoints take only JSON bodies (tests/security)


def test_missing_and_bad_messages(app_client):
    c, cfg = app_client
    assert_error(post(c, "/v1/chat/completions", {"model": cfg.default_model}), 400, "messages",
                 "missing_required_parameter")
    assert_error(post(c, "/v1/chat/completions", {"model": cfg.default_model, "messages": []}), 400, "messages")
    assert_error(post(c, "/v1/chat/completions", {"model": cfg.default_model, "messages": "hi"}), 400, "messages")
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=["hi"])), 400, "messages[0]")
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=[{"role": "wizard", "content": "x"}])),
                 400, "messages[0].role")
    for role in (["user"], {"user": 1}):  # unhashable: a 500 before (found by the fuzz test), in /tokenize too
        assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=[{"role": role, "content": "x"}])),
                     400, "messages[0].role")
        assert_error(post(c, "/tokenize", chat(cfg, messages=[{"role": role, "content": "x"}])), 400, "messages[0].role")
    assert_error(post(c, "/v1/chat/completions", chat(cfg, response_format={"type": ["json_object"]})), 400,
                 "response_format")
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=[{"role": "tool", "content": "x"}])),
                 400, "messages[0].tool_call_id", "missing_required_parameter")  # a tool's result names its call
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=[{"role": "user", "content": 5}])),
                 400, "messages[0].content")
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=[{"role": "user", "content": image}])),
                 400, "messages[0].content")


def test_valid_message_forms_pass_validation(app_client):
    """developer role and text parts are accepted: with no worker the answer is 503, not 400."""
    c, cfg = app_client
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=msgs, max_completion_tokens=5, max_tokens=7,
                                                      presence_penalty=1, frequency_penalty=-1, user="u", seed=3,
                                                      stop="\n", n=1)), 503, code="no_workers")
    assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [1, 2, 3], "max_tokens": 3}),
                 503, code="no_workers")
    assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": ["Once upon a time"]}),
                 503, code="no_workers")


def test_unknown_and_missing_model(app_client):
    c, cfg = app_client
    assert_error(post(c, "/v1/chat/completions", chat(cfg, model="gpt-9")), 404, "model", "model_not_found")
    assert_error(post(c, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model", "model_not_found")
    body = chat(cfg)
    del body["model"]
    assert_error(post(c, "/v1/chat/completions", body), 400, "model")
    assert_error(post(c, "/v1/chat/completions", chat(cfg, model=7)), 400, "model")


@pytest.mark.parametrize("field,value", [
    ("temperature", 3), ("temperature", -0.1), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5),
    ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", True), ("max_completion_tokens", -5), ("n", 0),
    ("n", 17), ("n", "1"), ("stop", ["a", "b", "c", "d", "e"]), ("stop", 7), ("stop", [1]), ("presence_penalty", 3),
    ("frequency_penalty", -2.5), ("seed", "x"), ("stream", "yes"), ("stream_options", "x"), ("logprobs", 1),
    ("top_logprobs", 21), ("top_logprobs", 2), ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0),
    ("min_tokens", -1), ("min_tokens", 10**6), ("stop_token_ids", [10**9]), ("stop_token_ids", "2"),
    ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"99999999": 1}),
    ("logit_bias", {"\u00b2": 1}), ("logit_bias", {"\u0663": 1}),  # digits to str.isdigit, not to int()
    ("temperature", 10**400), ("top_p", -(10**400)), ("min_p", 10**400), ("presence_penalty", 10**400),  # past a float
    ("response_format", {"type": "yaml"}), ("response_format", {"type": "json_schema"}),
    ("tools", [{"type": "function"}]),
])
def test_out_of_range_or_unsupported_parameters(app_client, field, value):
    c, cfg = app_client
    err = assert_error(post(c, "/v1/chat/completions", chat(cfg, **{field: value})), 400, field)
    if field == "tools":
        assert "tools[0]" in err["message"]


def test_a_schema_structured_output_cannot_use_is_a_400_naming_it(app_client):
    """Both engines constrain decoding to the schema; one the grammar library refuses is the client's 400 here,
    not a worker's error later."""
    c, cfg = app_client
    err = assert_error(post(c, "/v1/chat/completions", chat(cfg, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})), 400, "response_format",
        "invalid_value")
    assert "objectx" in err["message"]


@pytest.mark.parametrize(("so", "param", "code"), [
    ({"regex": "[0-9"}, "structured_outputs.regex", "invalid_value"),
    ({"grammar": "this is no grammar"}, "structured_outputs.grammar", "invalid_value"),
    ({"json": "{not json"}, "structured_outputs.json", "invalid_value"),
    ({"json": {"type": "objectx"}}, "structured_outputs.json", "invalid_value"),
    ({"choice": []}, "structured_outputs.choice", "invalid_value"),
    ({"choice": ["a", 1]}, "structured_outputs.choice[1]", "invalid_value"),
    ({"choice": ["a"], "regex": "a"}, "structured_outputs", "invalid_value"),
    ({}, "structured_outputs", "invalid_value"),
    ({"choice": ["a"], "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern", "unsupported_parameter"),
    ({"regex": "a", "guided_choice": ["a"]}, "structured_outputs.guided_choice", "unknown_parameter"),
    ("a", "structured_outputs", "invalid_value"),
])
def test_vllms_structured_outputs_a_bad_one_is_a_400_naming_it(app_client, so, param, code):
    """vLLM's `structured_outputs` is compiled when the request arrives, on both routes: a constraint the grammar
    library refuses, or not exactly one, is the client's 400 naming where."""
    c, cfg = app_client
    assert_error(post(c, "/v1/chat/completions", chat(cfg, structured_outputs=so)), 400, param, code)
    assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": "x", "structured_outputs": so}),
                 400, param, code)


def test_vllms_beam_search_pair_false_and_a_penalty_pass_true_is_a_400_naming_it(app_client):
    """vLLM's use_beam_search / length_penalty: false and a penalty pass validation (503 with no worker, as any
    valid request), true is refused as unsupported rather than silently sampled, and a wrong type is a 400."""
    c, cfg = app_client
    for route, body in (("/v1/chat/completions", chat(cfg)), ("/v1/completions", {"model": cfg.default_model,
                                                                                  "prompt": "Hi"})):
        assert_error(post(c, route, {**body, "use_beam_search": False, "length_penalty": 0.5}), 503,
                     code="no_workers")
        err = assert_error(post(c, route, {**body, "use_beam_search": True}), 400, "use_beam_search",
                           "unsupported_parameter")
        assert "beam search" in err["message"]
        assert_error(post(c, route, {**body, "use_beam_search": "yes"}), 400, "use_beam_search")
        assert_error(post(c, route, {**body, "length_penalty": "1"}), 400, "length_penalty")
        assert_error(post(c, route, {**body, "length_penalty": True}), 400, "length_penalty")


def test_allowed_token_ids_are_checked_against_the_vocabulary(app_client):
    c, cfg = app_client
    for bad in ([], [-1], [10**9], ["5"], 5):
        assert_error(post(c, "/v1/chat/completions", chat(cfg, allowed_token_ids=bad)), 400, "allowed_token_ids")


def test_logprob_token_ids_are_checked_as_vllm_checks_them(app_client):
    """vLLM's logprob_token_ids: at most 128 ids of the vocabulary, only with logprobs asked, and not with echo and
    max_tokens 0 (no token is answered); each a 400 naming the field."""
    c, cfg = app_client
    for extra in ({"logprob_token_ids": [5]}, {"logprob_token_ids": [-1], "logprobs": True},
                  {"logprob_token_ids": [10**9], "logprobs": True}, {"logprob_token_ids": [1] * 129, "logprobs": True},
                  {"logprob_token_ids": ["5"], "logprobs": True}):
        assert_error(post(c, "/v1/chat/completions", chat(cfg, **extra)), 400, "logprob_token_ids")
    assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": "Hi", "logprob_token_ids": [5]}),
                 400, "logprob_token_ids")
    assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": "Hi", "logprob_token_ids": [5],
                                             "logprobs": 0, "echo": True, "max_tokens": 0}), 400, "logprob_token_ids")


def test_bad_words_are_checked_as_vllm_checks_them(app_client):
    """vLLM's bad_words: a list of non-empty strings of at most 256 characters, at most 128 token sequences once
    tokenized (100 words make about 200: each alone and after a space) and 1,024 tokens in all (vLLM's model runner
    checks that where its failure ends the engine core: four 256-character words of CJK and emoji make 4,000);
    else a 400 naming the field."""
    c, cfg = app_client
    huge = ["".join(chr(0x4E00 + 97 * i + j) + "\U0001F600" for j in range(128)) for i in range(4)]  # 4,000+ tokens
    for bad in ("Paris", [""], [5], ["x" * 257], ["w"] * 129, [f"word{i}" for i in range(100)], huge):
        for path, body in (("/v1/chat/completions", chat(cfg, bad_words=bad)),
                           ("/v1/completions", {"model": cfg.default_model, "prompt": "Hi", "bad_words": bad})):
            assert_error(post(c, path, body), 400, "bad_words")


def test_structured_outputs_with_another_constraint_is_a_400(app_client):
    c, cfg = app_client
    assert_error(post(c, "/v1/chat/completions", chat(cfg, structured_outputs={"choice": ["a"]},
                                                      response_format={"type": "json_object"})),
                 400, "structured_outputs", "invalid_value")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert_error(post(c, "/v1/chat/completions", chat(cfg, structured_outputs={"choice": ["a"]}, tools=[tool],
                                                      tool_choice="required")), 400, "structured_outputs")


def test_stream_options_need_stream(app_client):
    c, cfg = app_client
    opts = {"include_usage": True}
    assert_error(post(c, "/v1/chat/completions", chat(cfg, stream_options=opts)), 400, "stream_options")
    for name in ("include_usage", "continuous_usage_stats"):
        assert_error(post(c, "/v1/chat/completions", chat(cfg, stream=True, stream_options={name: 1})),
                     400, f"stream_options.{name}")


def test_prompt_longer_than_context(app_client):
    c, cfg = app_client
    max_len = cfg.model(cfg.default_model).max_model_len
    long = "word " * (max_len + 10)
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=[{"role": "user", "content": long}])),
                 400, "messages", "context_length_exceeded")
    assert_error(post(c, "/v1/chat/completions", chat(cfg, max_tokens=10**6)), 400, "max_tokens",
                 "context_length_exceeded")
    assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": long}), 400, "prompt",
                 "context_length_exceeded")
    # exactly max_model_len prompt tokens leaves no room for one more
    assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [1] * max_len}), 400,
                 "prompt", "context_length_exceeded")
    assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [1] * (max_len - 4),
                                             "max_tokens": 5}), 400, "max_tokens", "context_length_exceeded")


def test_a_prompt_past_the_context_by_its_tokens_is_refused_before_the_semantic_layer(app, app_client, monkeypatch):
    """Within the character limit (the longest vocabulary entry per token: 81 characters here) a prompt can still
    hold twenty times the context: one long message of ordinary words, or thousands of empty turns. A floor
    under its tokens refuses it before the semantic layer (seconds of embedding and PII per request) or the
    template sees it; a conversation near the context still goes through to the layer."""
    c, cfg = app_client
    layer = app.extensions["farm"].semantic()
    seen, before = [], layer.before
    monkeypatch.setattr(layer, "before", lambda *a, **kw: seen.append(a) or before(*a, **kw))
    max_len = cfg.model(cfg.default_model).max_model_len
    words = "word " * (max_len * 3)  # 15 characters a token here: far under the 81-character limit
    turns = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * 1000  # within MAX_MESSAGES
    for messages in ([{"role": "user", "content": words}], [*turns, {"role": "user", "content": "hi"}]):
        for model in (cfg.default_model, "MoM"):
            err = assert_error(post(c, "/v1/chat/completions", chat(cfg, model=model, messages=messages)), 400,
                               "messages", "context_length_exceeded")
            assert "at least" in err["message"]
    assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": words}), 400, "prompt",
                 "context_length_exceeded")
    assert not seen
    near = [{"role": "user", "content": "word " * (max_len // 2 - 50)}]  # fits: the layer is asked (no worker: 503)
    assert post(c, "/v1/chat/completions", chat(cfg, messages=near)).status_code == 503 and len(seen) == 1


def test_oversized_body_is_413_json(app_client):
    c, cfg = app_client
    big = "x" * (cfg.api.max_body_bytes + 10)
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=[{"role": "user", "content": big}])), 413,
                 code="request_too_large")


def test_unknown_route_and_wrong_method(app_client):
    c, _ = app_client
    assert_error(c.get("/v1/nope"), 404, code="not_found")
    assert_error(c.post("/", data="x"), 404)
    resp = c.get("/v1/chat/completions")
    assert_error(resp, 405, code="method_not_allowed")
    assert "POST" in resp.headers["Allow"]
    assert_error(c.delete("/v1/models"), 405)


def test_an_error_names_its_request(app_client):
    """An error answer carries its request id, as a generated one does: the client's own X-Request-Id when
    usable, else a fresh `req_...`; under /v1/messages Anthropic's `request-id` too. (Before, the SDKs'
    `err.request_id` was None.) Only a 409 says not to retry."""
    c, cfg = app_client
    fresh = c.get("/v1/models/nope")
    assert fresh.status_code == 404 and re.fullmatch(r"req_[0-9a-f]{32}", fresh.headers["x-request-id"])
    assert "x-should-retry" not in fresh.headers
    own = post(c, "/v1/chat/completions", chat(cfg, temperature=9), headers={"X-Request-Id": "client-7"})
    assert own.status_code == 400 and own.headers["x-request-id"] == "client-7"
    bad = c.get("/v1/nope", headers={"X-Request-Id": "no spaces please"})
    assert bad.headers["x-request-id"].startswith("req_")
    anth = c.post("/v1/messages", json={"model": cfg.default_model, "messages": []})
    assert anth.status_code == 400 and anth.headers["request-id"] == anth.headers["x-request-id"]  # both req_<hex>
    assert anth.get_json()["request_id"] == anth.headers["request-id"]  # Anthropic's error body names it too
    anth = c.post("/v1/messages", json={"model": cfg.default_model, "max_tokens": 3,
                                        "messages": [{"role": "user", "content": "hi"}]})  # 503 once in generate
    assert anth.status_code == 503 and anth.headers["x-request-id"].startswith("chatcmpl-")
    assert anth.headers["request-id"] == "req_" + anth.headers["x-request-id"].removeprefix("chatcmpl-")
    placed = post(c, "/v1/chat/completions", chat(cfg))  # 503, no worker: after the request got its own id
    assert placed.status_code == 503 and placed.headers["x-request-id"].startswith("chatcmpl-")


def test_a_compressed_body_or_an_upload_of_the_wrong_type_is_415(app_client):
    """The fuzz audit: gzip read as JSON was a 400 "not valid UTF-8", a made-up Content-Encoding was ignored, and
    a file sent as JSON was a 400 "'purpose' is required"; each is a 415 naming what to send."""
    import gzip

    c, cfg = app_client
    raw = json.dumps(chat(cfg)).encode()
    for coding, data in (("gzip", gzip.compress(raw)), ("br", raw), ("x-made-up", raw)):
        resp = c.post("/v1/chat/completions", data=data, content_type="application/json",
                      headers={"Content-Encoding": coding})
        err = assert_error(resp, 415, "Content-Encoding", "unsupported_media_type")
        assert coding in err["message"]
    assert post(c, "/v1/chat/completions", chat(cfg), headers={"Content-Encoding": "identity"}).status_code != 415
    for kw in ({"json": {"purpose": "batch"}}, {"data": "purpose=batch", "content_type": "text/plain"}):
        assert_error(c.post("/v1/files", **kw), 415, "Content-Type", "unsupported_media_type")


def test_completion_specific_errors(app_client):
    c, cfg = app_client
    m = cfg.default_model
    assert_error(post(c, "/v1/completions", {"model": m}), 400, "prompt", "missing_required_parameter")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": ""}), 400, "prompt")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": ["a", ""]}), 400, "prompt[1]")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": ["a", [1, -4]]}), 400, "prompt[1]")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": ["a"] * 65}), 400, "prompt")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": ["a"] * 5, "n": 13}), 400, "n")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": [1, -4]}), 400, "prompt")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": [1, 10**9]}), 400, "prompt")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": {"text": "x"}}), 400, "prompt")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": "x", "echo": "yes"}), 400, "echo")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": "x", "suffix": "y"}), 400, "suffix")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": "x", "best_of": 2}), 400, "best_of")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": "x", "logprobs": 21}), 400, "logprobs")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": "x", "logprobs": True}), 400, "logprobs")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": "x", "n": 17}), 400, "n")


def test_no_live_workers_is_503_with_retry_after(app_client):
    c, cfg = app_client
    for stream in (False, True):
        resp = post(c, "/v1/chat/completions", chat(cfg, stream=stream))
        assert_error(resp, 503, code="no_workers")
        assert int(resp.headers["Retry-After"]) > 0


def test_valid_request_is_queued_and_invalid_ones_are_not(app_client, with_worker, redis_client, monkeypatch):
    """Validation happens before anything reaches a queue; silence from the worker is a 504."""
    c, cfg = app_client
    q = direct_queue(GHOST)
    post(c, "/v1/chat/completions", chat(cfg, temperature=9))
    assert redis_client.llen(q) == 0
    # a valid request is placed on the (never consuming) worker's queue, then times out as 504
    monkeypatch.setattr(cfg.api, "first_event_timeout_s", 1)
    ttft = prometheus.TTFT_SECONDS.labels(model=cfg.default_model)
    before = ttft._sum.get()  # noqa: SLF001
    resp = post(c, "/v1/chat/completions", chat(cfg, max_tokens=4))
    assert redis_client.llen(q) == 1
    assert_error(resp, 504, code="timeout")
    # the TTFT objective sees the request that never got a first token, with the second it waited
    assert ttft._sum.get() - before >= 1  # noqa: SLF001
    assert redis_client.keys("farm:cancel:*"), "a timed-out request is cancelled so no worker runs it later"


def _fill_ghost(app, redis_client):
    """Another replica's request holding 99% of the ghost worker's 1000 KV blocks, seen by this app's router
    (its load reaches the router's mirror through a stream)."""
    import time

    from farm.router.load import LoadTracker

    tracker = LoadTracker(redis_client)
    tracker.begin("d", GHOST, "someone-else", 990)
    router = app.extensions["farm"].gateway.router
    deadline = time.monotonic() + 10
    while router.loads.loads().get(GHOST, {}).get("d") != 990 and time.monotonic() < deadline:
        time.sleep(0.01)
    return tracker


def test_every_worker_busy_is_shed_with_503_and_retry_after(app, app_client, with_worker, redis_client, monkeypatch):
    """Busy shedding: a request that finds every worker's KV cache full waits `router.admission_wait_s` for room
    (a bounded admission queue), then is refused with 503 and Retry-After, never queued without bound."""
    import time

    c, cfg = app_client
    _fill_ghost(app, redis_client)
    monkeypatch.setattr(cfg.router, "admission_wait_s", 1.0)
    t0 = time.monotonic()
    resp = post(c, "/v1/chat/completions", chat(cfg, max_tokens=4))
    assert 0.75 <= time.monotonic() - t0 < 5, "it waited for room about admission_wait_s, no longer"
    assert_error(resp, 503, code="overloaded")
    assert int(resp.headers["Retry-After"]) == cfg.router.retry_after_s
    assert redis_client.llen(direct_queue(GHOST)) == 0


def test_a_request_waiting_for_room_is_placed_when_the_cache_frees(app, app_client, with_worker, redis_client,
                                                                   monkeypatch):
    """The other side of the bounded wait: room coming back within `admission_wait_s` (the request holding the
    cache ended) places the waiting request instead of shedding it. The ghost never answers: a 504 after it was
    queued, where a shed request gets a 503 and is never queued."""
    import threading
    import time

    c, cfg = app_client
    tracker = _fill_ghost(app, redis_client)
    monkeypatch.setattr(cfg.router, "admission_wait_s", 30.0)
    monkeypatch.setattr(cfg.api, "first_event_timeout_s", 1)
    freed = threading.Timer(1.0, tracker.end, ("d", GHOST, "someone-else"))
    freed.start()
    t0 = time.monotonic()
    try:
        resp = post(c, "/v1/chat/completions", chat(cfg, max_tokens=4))
    finally:
        freed.join()
    assert redis_client.llen(direct_queue(GHOST)) == 1, "placed once the cache had room"
    assert_error(resp, 504, code="timeout")
    assert 1.0 <= time.monotonic() - t0 < 15


def test_unexpected_exceptions_are_json_500_without_traceback(app, app_client, monkeypatch):
    from farm.models.directories import ModelNotFoundError

    c, cfg = app_client
    farm = app.extensions["farm"]

    def boom(model):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(farm, "tokenizer", boom)
    resp = post(c, "/v1/chat/completions", chat(cfg))
    err = assert_error(resp, 500, code="internal_error")
    assert "secret" not in err["message"] and b"Traceback" not in resp.data

    def missing(model):
        raise ModelNotFoundError(f"model {model!r} is not prepared")

    monkeypatch.setattr(farm, "tokenizer", missing)
    assert_error(post(c, "/v1/chat/completions", chat(cfg)), 503, code="model_unavailable")
