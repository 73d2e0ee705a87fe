"""Item 4: keyless mode was open to DNS rebinding and cross-site requests from a browser. The Host
allow-list, JSON-only bodies and the CORS policy (none by default), with and without API keys."""

from __future__ import annotations

import io
import json

import pytest

from tests.security_helpers import KEY_A, assert_openai_error, bearer, farm_app

CHAT = "/v1/chat/completions"
EVIL = "https://evil.example"


@pytest.fixture(scope="module")
def keyless(redis_url, tmp_path_factory):
    with farm_app(redis_url, tmp_path_factory.mktemp("policy-keyless")) as app:
        yield app


@pytest.fixture(scope="module")
def keyed(redis_url, tmp_path_factory):
    with farm_app(redis_url, tmp_path_factory.mktemp("policy-keyed"), FARM_API_KEYS=KEY_A,
                  FARM_API__ALLOWED_HOSTS="farm.example.com",
                  FARM_API__CORS_ALLOWED_ORIGINS="https://app.example.com") as app:
        yield app


def body(**kw) -> str:
    return json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 0, **kw})  # max_tokens 0: a 400 proves the request was let through


@pytest.mark.parametrize("host", ["rebind.attacker.example", "rebind.attacker.example:8080", "10.1.2.3",
                                  "localhost.attacker.example", "[2001:db8::1]:8080", ""])
def test_foreign_host_headers_are_refused(keyless, host):
    c = keyless.test_client()
    resp = c.post(CHAT, data=body(), content_type="text/plain", headers={"Host": host})
    err = assert_openai_error(resp, 400, "invalid_host", param="Host")
    assert "api.allowed_hosts" in err["message"]
    assert_openai_error(c.get("/v1/models", headers={"Host": host}), 400, "invalid_host")
    assert_openai_error(c.get("/health", headers={"Host": host}), 400, "invalid_host")


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "127.0.0.1:8080", "[::1]:8080", "LOCALHOST.",
                                  "api.localhost:8080"])
def test_loopback_names_are_served(keyless, host):
    resp = keyless.test_client().post(CHAT, data=body(), content_type="application/json", headers={"Host": host})
    assert_openai_error(resp, 400, param="max_tokens")


def test_keys_do_not_lift_the_host_check_and_listed_hosts_are_served(keyed):
    c = keyed.test_client()
    h = bearer(KEY_A)
    assert_openai_error(c.get("/v1/models", headers={**h, "Host": "rebind.attacker.example"}), 400, "invalid_host")
    assert c.get("/v1/models", headers={**h, "Host": "farm.example.com:443"}).status_code == 200
    assert c.get("/v1/models", headers={**h, "Host": "localhost"}).status_code == 200


def test_any_host_when_configured(redis_url, tmp_path):
    with farm_app(redis_url, tmp_path, FARM_API__ALLOWED_HOSTS="*") as app:
        assert app.test_client().get("/v1/models", headers={"Host": "anything.example"}).status_code == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   None, "application/jsonx", "text/json"])
def test_json_endpoints_take_only_json(keyless, ctype):
    c = keyless.test_client()
    for path in (CHAT, "/v1/completions", "/v1/batches"):
        resp = c.post(path, data=body(), content_type=ctype)
        assert_openai_error(resp, 415, "unsupported_media_type", "invalid_request_error", "Content-Type")


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                   "application/vnd.api+json"])
def test_json_media_types_are_accepted(keyless, ctype):
    resp = keyless.test_client().post(CHAT, data=body(), content_type=ctype)
    assert_openai_error(resp, 400, param="max_tokens")


def test_no_cors_by_default_and_cross_site_writes_are_refused(keyless, redis_client):
    c = keyless.test_client()
    for path in ("/v1/models", "/health", "/openapi.json"):
        resp = c.get(path, headers={"Origin": EVIL})
        assert "Access-Control-Allow-Origin" not in resp.headers
    pre = c.options(CHAT, headers={"Origin": EVIL, "Access-Control-Request-Method": "POST",
                                   "Access-Control-Request-Headers": "content-type"})
    assert "Access-Control-Allow-Origin" not in pre.headers
    # requests a page can send without a preflight: a form upload, a cancel
    up = c.post("/v1/files", headers={"Origin": EVIL}, content_type="multipart/form-data",
                data={"purpose": "batch", "file": (io.BytesIO(b"{}\n"), "x.jsonl")})
    assert_openai_error(up, 403, "origin_not_allowed", param="Origin")
    assert_openai_error(c.post("/v1/batches/batch_" + "0" * 32 + "/cancel", headers={"Origin": EVIL}), 403,
                        "origin_not_allowed")
    assert_openai_error(c.post(CHAT, data=body(), content_type="application/json", headers={"Origin": "null"}),
                        403, "origin_not_allowed")
    # without an Origin (curl, SDKs) the same upload is served
    ok = c.post("/v1/files", content_type="multipart/form-data",
                data={"purpose": "batch", "file": (io.BytesIO(b"{}\n"), "x.jsonl")})
    assert ok.status_code == 200


def test_configured_origins_get_cors_even_with_keys(keyed):
    c = keyed.test_client()
    origin = "https://app.example.com"
    pre = c.options(CHAT, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                   "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204  # answered before the key check: browsers send preflights without one
    assert pre.headers["Access-Control-Allow-Origin"] == origin
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert "authorization" in pre.headers["Access-Control-Allow-Headers"]
    resp = c.get("/v1/models", headers={**bearer(KEY_A), "Origin": origin})
    assert resp.status_code == 200 and resp.headers["Access-Control-Allow-Origin"] == origin
    assert "Origin" in resp.headers["Vary"]
    denied = c.get("/v1/models", headers={**bearer(KEY_A), "Origin": EVIL})
    assert denied.status_code == 200 and "Access-Control-Allow-Origin" not in denied.headers
    no_key = c.get("/v1/models", headers={"Origin": origin})  # CORS never replaces the key
    assert_openai_error(no_key, 401, "invalid_api_key")
    assert no_key.headers["Access-Control-Allow-Origin"] == origin  # so the page can read the error
