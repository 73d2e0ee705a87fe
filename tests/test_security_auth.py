"""API keys, the no-key loopback rule, per-key rate limits and token quotas, tenant isolation of files
and batches: a real app on a real Redis."""

from __future__ import annotations

import hashlib
import io
import json

import pytest

from farm.config import ConfigError, load_config
from farm.supervisor import Farm
from farm.tenancy.api_keys import KeyRing, owner_of
from farm.tenancy.quota import Limiter, Refusal
from tests.security_helpers import KEY_A, KEY_B, assert_openai_error, bearer, farm_app

REMOTE = {"REMOTE_ADDR": "10.9.8.7"}


@pytest.fixture(scope="module")
def keyed_app(redis_url, tmp_path_factory):
    with farm_app(redis_url, tmp_path_factory.mktemp("keyed"), FARM_API_KEYS=f" {KEY_A}, {KEY_B} ,",
                  FARM_METRICS_TOKEN="scrape-token") as app:
        yield app


@pytest.fixture
def client(keyed_app, redis_client):
    return keyed_app.test_client()


def test_missing_or_wrong_key_is_401_in_openai_shape(client):
    for headers in ({}, bearer("sk-wrong"), {"Authorization": KEY_A}, {"Authorization": f"Basic {KEY_A}"}):
        resp = client.get("/v1/models", headers=headers)
        assert_openai_error(resp, 401, "invalid_api_key", "invalid_request_error")
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    # before any body is read: an unauthenticated generation is refused, not validated
    resp = client.post("/v1/chat/completions", data="{bad json", content_type="application/json")
    assert_openai_error(resp, 401, "invalid_api_key")
    assert client.get("/v1/models", headers=bearer(KEY_A)).status_code == 200
    assert client.get("/v1/models", headers={"authorization": f"bearer {KEY_B}"}).status_code == 200


def test_public_and_metrics_routes(client):
    assert client.get("/health", environ_base=REMOTE).status_code == 200
    assert client.get("/openapi.json", environ_base=REMOTE).status_code == 200
    assert_openai_error(client.get("/metrics", environ_base=REMOTE), 401, "invalid_api_key")
    assert client.get("/metrics", headers=bearer("scrape-token"), environ_base=REMOTE).status_code == 200
    # a tenant's key does not read every tenant's series (categories, guard blocks, cache hits)
    err = assert_openai_error(client.get("/metrics", headers=bearer(KEY_A), environ_base=REMOTE), 403,
                              "permission_denied")
    assert "FARM_METRICS_TOKEN" in err["message"]
    # the scrape token is not an API key
    assert_openai_error(client.get("/v1/models", headers=bearer("scrape-token")), 401)


def test_no_keys_serves_loopback_only_unless_allowed(redis_url, tmp_path, redis_client):
    with farm_app(redis_url, tmp_path / "a") as app:
        c = app.test_client()
        assert c.get("/v1/models").status_code == 200  # 127.0.0.1: a local tool
        assert c.get("/v1/models", environ_base={"REMOTE_ADDR": "::1"}).status_code == 200
        err = assert_openai_error(c.get("/v1/models", environ_base=REMOTE), 401, "invalid_api_key")
        assert "FARM_API_KEYS" in err["message"]
        assert_openai_error(c.get("/v1/models", environ_base={"REMOTE_ADDR": "::ffff:10.0.0.1"}), 401)
        assert c.get("/health", environ_base=REMOTE).status_code == 200
    with farm_app(redis_url, tmp_path / "b", FARM_API__ALLOW_UNAUTHENTICATED="true") as app:
        assert app.test_client().get("/v1/models", environ_base=REMOTE).status_code == 200
        # /metrics stays local (the ops audit: it was open to anyone here): its series count every request
        assert_openai_error(app.test_client().get("/metrics", environ_base=REMOTE), 401, "invalid_api_key")
        assert app.test_client().get("/metrics").status_code == 200


def test_keys_are_held_hashed_and_config_may_hold_only_digests(redis_url, tmp_path, redis_client):
    ring = KeyRing([KEY_A, "sha256:" + hashlib.sha256(KEY_B.encode()).hexdigest()])
    assert KEY_A not in repr(vars(ring)) and KEY_B not in repr(vars(ring))
    assert ring.owner(KEY_A) == owner_of(hashlib.sha256(KEY_A.encode()).hexdigest())
    assert ring.owner(KEY_B) and ring.owner(KEY_B) != ring.owner(KEY_A)
    assert ring.owner("") is None and ring.owner(KEY_A + "x") is None
    with pytest.raises(ValueError):
        KeyRing(["sha256:nothex"])
    digest_only = "sha256:" + hashlib.sha256(b"sk-from-config").hexdigest()
    with farm_app(redis_url, tmp_path, FARM_API__API_KEYS=json.dumps([digest_only])) as app:
        c = app.test_client()
        assert c.get("/v1/models", headers=bearer("sk-from-config")).status_code == 200
        assert_openai_error(c.get("/v1/models", headers=bearer(digest_only)), 401)


def _upload(c, key: str) -> str:
    line = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}}
    resp = c.post("/v1/files", headers=bearer(key), content_type="multipart/form-data",
                  data={"purpose": "batch", "file": (io.BytesIO(json.dumps(line).encode() + b"\n"), "in.jsonl")})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()["id"]


def test_files_and_batches_belong_to_the_key_that_created_them(client, redis_client):
    fid = _upload(client, KEY_A)
    resp = client.post("/v1/batches", headers=bearer(KEY_A), json={
        "input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert resp.status_code == 200, resp.get_data(as_text=True)
    bid = resp.get_json()["id"]
    a, b = bearer(KEY_A), bearer(KEY_B)
    # the owner sees them
    assert [f["id"] for f in client.get("/v1/files", headers=a).get_json()["data"]] == [fid]
    assert [x["id"] for x in client.get("/v1/batches", headers=a).get_json()["data"]] == [bid]
    assert client.get(f"/v1/files/{fid}/content", headers=a).status_code == 200
    # another key cannot list, read, use, cancel or delete them: 404, as OpenAI answers
    assert client.get("/v1/files", headers=b).get_json()["data"] == []
    assert client.get("/v1/batches", headers=b).get_json()["data"] == []
    assert_openai_error(client.get(f"/v1/files/{fid}", headers=b), 404, "file_not_found")
    assert_openai_error(client.get(f"/v1/files/{fid}/content", headers=b), 404, "file_not_found")
    assert_openai_error(client.delete(f"/v1/files/{fid}", headers=b), 404, "file_not_found")
    assert_openai_error(client.get(f"/v1/batches/{bid}", headers=b), 404, "batch_not_found")
    assert_openai_error(client.post(f"/v1/batches/{bid}/cancel", headers=b), 404, "batch_not_found")
    assert_openai_error(client.post("/v1/batches", headers=b, json={
        "input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"}), 404,
        "file_not_found")
    # ... and nothing changed for the owner
    assert client.get(f"/v1/batches/{bid}", headers=a).get_json()["status"] in ("validating", "in_progress",
                                                                                 "failed", "completed")
    assert client.get(f"/v1/files/{fid}", headers=a).status_code == 200


@pytest.fixture
def limited(redis_url, tmp_path, redis_client):
    env = {"FARM_API_KEYS": f"{KEY_A},{KEY_B}", "FARM_API__LIMITS__REQUESTS_PER_MINUTE": "3",
           "FARM_API__LIMITS__TOKEN_QUOTA": "100"}
    with farm_app(redis_url, tmp_path / "one", **env) as one, farm_app(redis_url, tmp_path / "two", **env) as two:
        yield one, two


def test_request_rate_limit_per_key_is_shared_by_replicas(limited, redis_client):
    one, two = limited
    c1, c2 = one.test_client(), two.test_client()
    assert [c1.get("/v1/models", headers=bearer(KEY_A)).status_code for _ in range(2)] == [200, 200]
    assert c2.get("/v1/models", headers=bearer(KEY_A)).status_code == 200  # another replica, same count
    for c in (c1, c2):
        resp = c.get("/v1/models", headers=bearer(KEY_A))
        err = assert_openai_error(resp, 429, "rate_limit_exceeded")
        assert "Limit 3" in err["message"]
        assert 1 <= int(resp.headers["Retry-After"]) <= 60
    assert c1.get("/v1/models", headers=bearer(KEY_B)).status_code == 200  # per key
    [counter] = [k for k in redis_client.keys("farm:rl:req:*") if owner_of(
        hashlib.sha256(KEY_A.encode()).hexdigest()).encode() in k]
    assert int(redis_client.get(counter)) == 3  # refused requests are not counted
    assert 0 < redis_client.ttl(counter) <= 61


def test_token_quota_refuses_generation_once_spent(limited, redis_client):
    one, _ = limited
    c = one.test_client()
    owner = owner_of(hashlib.sha256(KEY_A.encode()).hexdigest())
    limiter: Limiter = one.extensions["farm_auth"].limiter
    # a generation reserves what it may use, and settles with what it used
    held = limiter.reserve(owner, 4096, least=10)  # more than the quota: what is left is held
    assert held.tokens == 100 and limiter.used_tokens(owner) == 100
    held.settle(70 + 40)
    assert limiter.used_tokens(owner) == 110
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}
    resp = c.post("/v1/chat/completions", headers=bearer(KEY_A), json=body)
    err = assert_openai_error(resp, 429, "insufficient_quota", "insufficient_quota")
    assert "Limit 100" in err["message"] and int(resp.headers["Retry-After"]) >= 1
    assert isinstance(limiter.reserve(owner, 4096, least=1), Refusal)
    assert c.get("/v1/models", headers=bearer(KEY_A)).status_code == 200  # only generation spends tokens
    # another key's quota is untouched: it gets through to the (worker-less) farm
    assert_openai_error(c.post("/v1/chat/completions", headers=bearer(KEY_B), json=body), 503, "no_workers")


def test_a_key_with_its_own_limits(redis_url, tmp_path, redis_client):
    """`api.api_keys` entries with their own limits: KEY_B gets 1 request a minute (quota inherited),
    a third key (configured by digest) is unlimited; KEY_A keeps `api.limits`."""
    key_c = "sk-test-unlimited-partner"
    entries = (f"[{{key: {KEY_B}, requests_per_minute: 1}}, "
               f"{{key: 'sha256:{hashlib.sha256(key_c.encode()).hexdigest()}', requests_per_minute: 0, token_quota: 0}}]")
    env = {"FARM_API_KEYS": KEY_A, "FARM_API__API_KEYS": entries, "FARM_API__LIMITS__REQUESTS_PER_MINUTE": "3",
           "FARM_API__LIMITS__TOKEN_QUOTA": "100"}
    with farm_app(redis_url, tmp_path, **env) as app:
        c = app.test_client()
        limiter: Limiter = app.extensions["farm_auth"].limiter
        owner_b, owner_c = (owner_of(hashlib.sha256(k.encode()).hexdigest()) for k in (KEY_B, key_c))
        assert limiter.limits_of(owner_b) == (1, 100) and limiter.limits_of(owner_c) == (0, 0)
        assert c.get("/v1/models", headers=bearer(KEY_B)).status_code == 200
        err = assert_openai_error(c.get("/v1/models", headers=bearer(KEY_B)), 429, "rate_limit_exceeded")
        assert "Limit 1" in err["message"]
        assert [c.get("/v1/models", headers=bearer(key_c)).status_code for _ in range(5)] == [200] * 5
        assert [c.get("/v1/models", headers=bearer(KEY_A)).status_code for _ in range(4)] == [200] * 3 + [429]
        # no quota for the unlimited key: its usage is not even counted
        limiter.reserve(owner_c, 1000).settle(1000)
        assert limiter.used_tokens(owner_c) == 0


def test_farm_up_refuses_a_public_api_without_keys(monkeypatch, tmp_path):
    monkeypatch.delenv("FARM_API_KEYS", raising=False)
    env = {"FARM_API__HOST": "0.0.0.0", "FARM_STATE_DIR": str(tmp_path)}
    cfg = load_config(environ=env)
    with pytest.raises(ConfigError, match="FARM_API_KEYS"):
        Farm(cfg, prefill=0, decode=0, flower=False, prepare=False)
    Farm(cfg, prefill=0, decode=0, flower=False, prepare=False, api=False)  # no API, nothing to guard
    Farm(load_config(environ={**env, "FARM_API__ALLOW_UNAUTHENTICATED": "true"}), prefill=0, decode=0,
         flower=False, prepare=False)
    monkeypatch.setenv("FARM_API_KEYS", KEY_A)
    Farm(cfg, prefill=0, decode=0, flower=False, prepare=False)
    Farm(load_config(environ={"FARM_STATE_DIR": str(tmp_path)}), prefill=0, decode=0, flower=False, prepare=False)


def test_the_apis_own_server_refuses_a_public_bind_without_keys(tmp_path):
    """The image and the chart start gunicorn themselves, past `farm up`'s check: on 0.0.0.0 without keys the API
    served any client whose connection came through a local proxy in its pod (a mesh sidecar connects from
    127.0.0.6, port-forward from 127.0.0.1), which a farm without keys trusts. The one gunicorn config every
    launcher names now refuses to start, as `farm up` does."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    base.update({"FARM_STATE_DIR": str(tmp_path), "FARM_API__HOST": "0.0.0.0"})

    def load(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "import api.gunicorn_conf as c; print(c.bind)"],
                              env={**base, **env}, capture_output=True, text=True, timeout=120)

    refused = load()
    assert refused.returncode != 0 and "no API key is set" in refused.stderr and "FARM_API_KEYS" in refused.stderr
    for ok in (load(FARM_API_KEYS=KEY_A), load(FARM_API__ALLOW_UNAUTHENTICATED="true"),
               load(FARM_API__HOST="127.0.0.1")):
        assert ok.returncode == 0 and ":8080" in ok.stdout, ok.stderr[-2000:]


def test_settling_after_the_window_ended_leaves_no_counter_behind(redis_client):
    """A generation that outlives its token window gives its unused tokens back into a window that is gone: INCRBY
    made its key again, negative and with no expiry (one key leaked per such generation). A rate counter given
    back late (`uncount`) did the same. Neither is touched once its window has ended."""
    import time

    from farm.config.api import ApiLimitsConfig

    limiter = Limiter(redis_client, ApiLimitsConfig(token_quota=1000, requests_per_minute=10))
    held = limiter.reserve("late-owner", 400)
    assert limiter.used_tokens("late-owner") == 400
    redis_client.delete(held.key)  # the window ends (its key expires) while the generation runs
    held.settle(20)
    assert not redis_client.exists(held.key)
    assert limiter.admit("late-owner") is None
    rate_key = limiter._keys("late-owner", time.time())[0]
    redis_client.delete(rate_key)
    limiter.uncount("late-owner", 1)
    assert not redis_client.exists(rate_key)
    fresh = limiter.reserve("late-owner", 100)  # within a live window, settling still gives back
    fresh.settle(30)
    assert limiter.used_tokens("late-owner") == 30
