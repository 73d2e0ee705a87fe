"""Hostile input gets a precise 4xx in OpenAI's shape: deep JSON, invalid UTF-8, unknown fields, huge n,
max_tokens beyond the context, oversized bodies (JSON routes, batches and file uploads)."""

from __future__ import annotations

import io
import json

import pytest

from tests.security_helpers import assert_openai_error, farm_app

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def app(redis_url, tmp_path_factory):
    with farm_app(redis_url, tmp_path_factory.mktemp("input"), FARM_BATCH__MAX_FILE_BYTES="2048") as app:
        yield app


@pytest.fixture
def c(app, redis_client):
    return app.test_client()


def chat(**kw):
    return {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], **kw}


def post(c, path, data):
    return c.post(path, data=data if isinstance(data, (str, bytes)) else json.dumps(data),
                  content_type="application/json")


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/batches"])
@pytest.mark.parametrize("depth", [40, 5000, 200_000])
def test_deep_json_is_400_not_500(c, path, depth):
    body = '{"model": ' + "[" * depth + "]" * depth + "}"
    assert_openai_error(post(c, path, body), 400, "json_too_deep")


def test_moderate_nesting_is_still_validated_normally(c):
    err = assert_openai_error(post(c, CHAT, chat(stop=[[[["x"]]]])), 400, param="stop")
    assert "string" in err["message"]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/batches"])
def test_invalid_utf8_is_400_invalid_encoding(c, path):
    raw = b'{"model": "SmolLM2-135M-Instruct", "prompt": "\xc3\x28 bad"}'
    err = assert_openai_error(post(c, path, raw), 400, "invalid_encoding")
    assert "UTF-8" in err["message"]
    assert_openai_error(post(c, path, b"\xff\xfe{}"), 400, "invalid_encoding")


def test_invalid_json_names_the_problem(c):
    err = assert_openai_error(post(c, CHAT, '{"model": "m",}'), 400, "invalid_json")
    assert "not valid JSON" in err["message"]
    assert_openai_error(post(c, CHAT, '{"model": "m", "temperature": Infinity}'), 400, "invalid_json")
    assert_openai_error(post(c, CHAT, '{"n": ' + "9" * 5000 + "}"), 400, "invalid_json")


@pytest.mark.parametrize("path,body", [
    (CHAT, chat(frobnicate=True)),
    (CHAT, chat(max_token=5)),  # a typo of max_tokens is not silently ignored
    ("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "x", "messages": []}),
    ("/v1/batches", {"input_file_id": "file-x", "endpoint": CHAT, "completion_window": "24h", "priority": 1}),
])
def test_unknown_fields_are_named(c, path, body):
    name = next(k for k in body if k not in ("model", "messages", "prompt", "input_file_id", "endpoint",
                                             "completion_window")) if path != "/v1/completions" else "messages"
    err = assert_openai_error(post(c, path, body), 400, "unknown_parameter", "invalid_request_error", name)
    assert name in err["message"]


def test_every_documented_field_is_accepted_as_known(c):
    """The schema's field list and the validator agree: no documented field is 'unknown'."""
    from farm.openai.schemas import ChatCompletionRequest, CompletionRequest

    for path, model in ((CHAT, ChatCompletionRequest), ("/v1/completions", CompletionRequest)):
        base = chat() if path == CHAT else {"model": "SmolLM2-135M-Instruct", "prompt": "x"}
        for name in model.model_fields:
            resp = post(c, path, {**base, name: base.get(name)})
            assert resp.get_json()["error"]["code"] != "unknown_parameter", (path, name)


@pytest.mark.parametrize("n", [17, 10**30, -1, 0, 2.5])
def test_huge_or_bad_n(c, n):
    err = assert_openai_error(post(c, CHAT, chat(n=n)), 400, param="n")
    assert "n" in err["message"] and ("16" in err["message"] or "integer" in err["message"])


@pytest.mark.parametrize("max_tokens", [4096, 10**9, 10**30])
def test_max_tokens_beyond_context(c, max_tokens):
    err = assert_openai_error(post(c, CHAT, chat(max_tokens=max_tokens)), 400, "context_length_exceeded",
                              param="max_tokens")
    assert "4096" in err["message"]


def test_oversized_bodies_are_413(c, app):
    limit = app.extensions["farm"].cfg.api.max_body_bytes
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * (limit + 1)}]))
    for path in (CHAT, "/v1/completions", "/v1/batches"):
        assert_openai_error(post(c, path, big), 413, "request_too_large")
    # file uploads have their own (larger) limit: batch.max_file_bytes, 2048 here
    resp = c.post("/v1/files", content_type="multipart/form-data",
                  data={"purpose": "batch", "file": (io.BytesIO(b"x" * 4096), "big.jsonl")})
    assert_openai_error(resp, 413, "request_too_large")


def test_non_object_bodies(c):
    for body in ("[]", '"x"', "null", "3"):
        assert_openai_error(post(c, CHAT, body), 400)
        assert_openai_error(post(c, "/v1/batches", body), 400)
