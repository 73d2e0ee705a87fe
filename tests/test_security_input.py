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
    err = assert_openai_error(post(c, CHAT, '{"n": ' + "9" * 5000 + "}"), 400, "invalid_json")
    assert "digits" in err["message"] and "sys." not in err["message"]  # not Python's advice to the client


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


def test_more_messages_than_a_request_may_have_is_400_before_the_layer(c, app):
    """Thousands of one-token messages added nothing to the prompt's token floor and each was embedded and scanned
    by the semantic layer: 20,000 system messages held the encoder for 27 s. At most MAX_MESSAGES now."""
    from farm.openai.schemas import MAX_MESSAGES

    embedder = app.extensions["farm"].semantic().embedder
    encode, seen = embedder.encode_texts, []
    embedder.encode_texts = lambda texts: seen.extend(texts) or encode(texts)
    try:
        many = [{"role": "system", "content": f"s{i}"} for i in range(MAX_MESSAGES)] + \
            [{"role": "user", "content": "hi"}]
        err = assert_openai_error(post(c, CHAT, chat(messages=many)), 400, "array_above_max_length", param="messages")
        assert str(MAX_MESSAGES) in err["message"] and str(MAX_MESSAGES + 1) in err["message"]
        assert seen == []
    finally:
        embedder.encode_texts = encode


def test_an_assistant_turn_past_the_context_is_refused_before_the_layer(c, app):
    """An earlier assistant answer was left out of the prompt's token floor (a reasoning template drops its
    reasoning), so 160 KB of it reached the semantic layer's PII pass whole before the template refused the
    prompt. What follows the answer's last `</think>` counts now; the reasoning before it still does not."""
    embedder = app.extensions["farm"].semantic().embedder
    encode, seen = embedder.encode_texts, []
    embedder.encode_texts = lambda texts: seen.extend(texts) or encode(texts)
    huge = "".join(f"u{i}@ex.com " for i in range(16_000))
    try:
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": huge},
                {"role": "user", "content": "and?"}]
        assert_openai_error(post(c, CHAT, chat(messages=msgs)), 400, "context_length_exceeded", param="messages")
        assert seen == []
    finally:
        embedder.encode_texts = encode
    from farm.models.tokenization import get_tokenizer, prompt_tokens_at_least

    tok = get_tokenizer(app.extensions["farm"].cfg, "SmolLM2-135M-Instruct")
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Fine."}]
    reasoned = [short[0], {"role": "assistant", "content": "<think>" + huge + "</think>Fine."}]
    assert prompt_tokens_at_least(tok, reasoned) == prompt_tokens_at_least(tok, short)  # still a floor
