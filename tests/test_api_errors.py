"""Bad input gets an OpenAI-shaped JSON error with the right status, and nothing is queued."""

from __future__ import annotations

import json

import pytest

from api.app import create_app
from farm import registry
from farm.config import get_config


@pytest.fixture
def app_client(farm_env, redis_client):
    app = create_app(get_config())
    yield app.test_client(), get_config()
    app.extensions["farm"].gateway.router.stop()


@pytest.fixture
def with_worker(app_client, redis_client):
    """A registered worker (its queue is never consumed): requests that pass validation get queued."""
    _, cfg = app_client
    registry.register(redis_client, registry.WorkerInfo("ghost@test", "both", cfg.default_model, "h", 1,
                                                        cfg.engine.block_size, num_blocks=1000))


def post(client, path, body, raw=False, **kw):
    data = body if raw else json.dumps(body)
    return client.post(path, data=data, content_type="application/json", **kw)


def assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.data
    assert resp.content_type.startswith("application/json")
    err = resp.get_json()["error"]
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


def test_missing_and_bad_messages(app_client):
    c, cfg = app_client
    assert_error(post(c, "/v1/chat/completions", {"model": cfg.default_model}), 400, "messages",
                 "missing_required_parameter")
    assert_error(post(c, "/v1/chat/completions", {"model": cfg.default_model, "messages": []}), 400, "messages")
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=[{"role": "wizard", "content": "x"}])),
                 400, "messages[0].role")
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=[{"role": "user", "content": 5}])),
                 400, "messages[0].content")


def test_unknown_and_missing_model(app_client):
    c, cfg = app_client
    assert_error(post(c, "/v1/chat/completions", chat(cfg, model="gpt-9")), 404, "model", "model_not_found")
    body = chat(cfg)
    del body["model"]
    assert_error(post(c, "/v1/chat/completions", body), 400, "model")


@pytest.mark.parametrize("field,value", [
    ("temperature", 3), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5), ("max_tokens", 0),
    ("max_completion_tokens", -5), ("n", 2), ("stop", ["a", "b", "c", "d", "e"]), ("stop", 7),
    ("presence_penalty", 3), ("seed", "x"), ("stream", "yes"), ("logprobs", True), ("tools", [{"type": "function"}]),
])
def test_out_of_range_or_unsupported_parameters(app_client, field, value):
    c, cfg = app_client
    assert_error(post(c, "/v1/chat/completions", chat(cfg, **{field: value})), 400, field)


def test_prompt_longer_than_context(app_client):
    c, cfg = app_client
    long = "word " * (cfg.model(cfg.default_model).max_model_len + 10)
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=[{"role": "user", "content": long}])),
                 400, "messages", "context_length_exceeded")
    assert_error(post(c, "/v1/chat/completions", chat(cfg, max_tokens=10**6)), 400, "max_tokens",
                 "context_length_exceeded")
    assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": long}), 400, None,
                 "context_length_exceeded")


def test_oversized_body_is_413_json(app_client):
    c, cfg = app_client
    big = "x" * (cfg.api.max_body_bytes + 10)
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=[{"role": "user", "content": big}])), 413)


def test_unknown_route_and_wrong_method(app_client):
    c, _ = app_client
    assert_error(c.get("/v1/nope"), 404)
    assert_error(c.get("/v1/chat/completions"), 405)


def test_completion_specific_errors(app_client):
    c, cfg = app_client
    m = cfg.default_model
    assert_error(post(c, "/v1/completions", {"model": m}), 400, "prompt")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": ["a", "b"]}), 400, "prompt")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": [1, -4]}), 400, "prompt")
    assert_error(post(c, "/v1/completions", {"model": m, "prompt": "x", "echo": True}), 400, "echo")


def test_no_live_workers_is_503_with_retry_after(app_client):
    c, cfg = app_client
    resp = post(c, "/v1/chat/completions", chat(cfg))
    assert_error(resp, 503, code="no_workers")
    assert int(resp.headers["Retry-After"]) > 0


def test_valid_request_is_queued_and_invalid_ones_are_not(app_client, with_worker, redis_client):
    """Validation happens before anything reaches a queue."""
    c, cfg = app_client
    from farm.router.keys import direct_queue

    q = direct_queue("ghost@test")
    post(c, "/v1/chat/completions", chat(cfg, temperature=9))
    assert redis_client.llen(q) == 0
    # a valid request is placed on the (never consuming) worker's queue, then times out as 504
    cfg.api.first_event_timeout_s = 1
    resp = post(c, "/v1/chat/completions", chat(cfg, max_tokens=4))
    assert redis_client.llen(q) == 1
    assert_error(resp, 504, code="timeout")


def test_models_and_health(app_client):
    c, cfg = app_client
    data = c.get("/v1/models").get_json()
    assert data["object"] == "list" and cfg.default_model in [m["id"] for m in data["data"]]
    assert c.get(f"/v1/models/{cfg.default_model}").get_json()["id"] == cfg.default_model
    assert_error(c.get("/v1/models/nope"), 404, "model")
    h = c.get("/health")
    assert h.status_code == 200 and h.get_json()["redis"] == "ok"
    assert h.get_json()["workers"][cfg.default_model] == {"prefill": 0, "decode": 0, "both": 0}


def test_every_worker_busy_is_shed_with_503_and_retry_after(app_client, with_worker, redis_client):
    """Busy shedding: the API answers at once instead of queueing without bound."""
    from farm.router.keys import direct_queue
    from farm.router.load import LoadTracker

    c, cfg = app_client
    LoadTracker(redis_client).begin("d", "ghost@test", "someone-else", 990)  # 99% of its 1000 blocks
    resp = post(c, "/v1/chat/completions", chat(cfg, max_tokens=4))
    assert_error(resp, 503, code="overloaded")
    assert int(resp.headers["Retry-After"]) == cfg.router.retry_after_s
    assert redis_client.llen(direct_queue("ghost@test")) == 0
