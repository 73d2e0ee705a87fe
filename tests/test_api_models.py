"""GET /v1/models and /health, built the way gunicorn builds the app: `create_app()` in the farm's env."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from flask import Flask

from api.app import create_app
from farm.cluster import registry
from farm.config import load_config
from farm.protocol.keys import METRICS_EXPORTER_KEY
from tests.conftest import free_port, make_farm_env
from tests.test_api_errors import assert_error, post


@pytest.fixture
def app(farm_env, redis_client) -> Iterator[Flask]:
    app = create_app()  # no arguments: exactly what `gunicorn 'api.app:create_app()'` runs
    yield app
    app.extensions["farm"].gateway.stop()


def test_models_list_and_card(app):
    c = app.test_client()
    cfg = app.extensions["farm"].cfg
    resp = c.get("/v1/models")
    assert resp.status_code == 200 and resp.content_type.startswith("application/json")
    data = resp.get_json()
    assert data["object"] == "list"
    ids = [m["id"] for m in data["data"]]
    assert ids == [m.name for m in cfg.models] + list(cfg.semantic.aliases) + ["all-MiniLM-L6-v2"]
    card = next(m for m in data["data"] if m["id"] == cfg.default_model)
    assert set(card) == {"id", "object", "created", "owned_by", "max_model_len"}
    assert card["object"] == "model" and card["owned_by"] == "inference-farm" and isinstance(card["created"], int)
    assert card["max_model_len"] == cfg.model(cfg.default_model).max_model_len
    one = c.get(f"/v1/models/{cfg.default_model}")
    assert one.status_code == 200 and one.get_json() == card
    assert_error(c.get("/v1/models/no-such-model"), 404, "model", "model_not_found")
    embedding = c.get("/v1/models/all-MiniLM-L6-v2").get_json()
    assert embedding["max_model_len"] == 256 and embedding["object"] == "model"
    hf = c.get("/v1/models/sentence-transformers/all-MiniLM-L6-v2").get_json()  # the other name it is served by
    assert hf == {**embedding, "id": "sentence-transformers/all-MiniLM-L6-v2"}
    assert_error(c.get("/v1/models/sentence-transformers/nope"), 404, "model", "model_not_found")


def test_the_listed_embedding_model_generates_nothing_and_says_where_it_serves(app):
    """/v1/models lists the embedding model: asked for a generation, it is a 400 naming /v1/embeddings, not a 404
    claiming that a listed model does not exist."""
    c = app.test_client()
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                        ("/v1/completions", {"prompt": "Hi"}),
                        ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})):
        for name in ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
            resp = c.post(route, json={"model": name, **body})
            if route == "/v1/messages":
                assert resp.status_code == 400 and "/v1/embeddings" in resp.get_json()["error"]["message"]
            else:
                err = assert_error(resp, 400, "model", "model_not_supported")
                assert "/v1/embeddings" in err["message"]


def test_health_counts_live_workers_by_role(app, redis_client):
    c = app.test_client()
    cfg = app.extensions["farm"].cfg
    resp = c.get("/health")
    assert resp.status_code == 200
    h = resp.get_json()
    assert h["status"] == "degraded" and h["redis"] == "ok"  # nothing generates: still 200, the API serves
    assert h["models"] == h["unserved"] == [m.name for m in cfg.models]
    assert h["workers"] == {m.name: {"prefill": 0, "decode": 0, "both": 0} for m in cfg.models}
    registry.register(redis_client, registry.WorkerInfo("p1", "prefill", cfg.default_model, "h", 1,
                                                        cfg.engine.block_size))
    h = c.get("/health").get_json()  # a prefill worker alone answers nothing
    assert h["status"] == "degraded" and cfg.default_model in h["unserved"]
    for wid, role in (("d1", "decode"), ("d2", "decode")):
        registry.register(redis_client, registry.WorkerInfo(wid, role, cfg.default_model, "h", 1,
                                                            cfg.engine.block_size))
    redis_client.delete(registry.alive_key("d2"))  # a worker whose heartbeat expired is not counted
    h = c.get("/health").get_json()
    assert h["workers"][cfg.default_model] == {"prefill": 1, "decode": 1, "both": 0}
    assert h["unserved"] == [m.name for m in cfg.models if m.name != cfg.default_model]
    assert h["status"] == ("degraded" if h["unserved"] else "ok")


def test_redis_down_is_503(tmp_path):
    """Health says so; a generation request gets a JSON 503 with Retry-After, not a 500."""
    cfg = load_config(environ=make_farm_env(f"redis://127.0.0.1:{free_port()}/0", tmp_path))  # nothing listens
    app = create_app(cfg)
    try:
        c = app.test_client()
        resp = c.get("/health")
        assert resp.status_code == 503
        assert resp.get_json()["status"] == "unavailable" and resp.get_json()["redis"] == "down"
        err = assert_error(post(c, "/v1/completions", {"model": cfg.default_model, "prompt": [1, 2, 3]}), 503,
                           code="redis_unavailable")
        assert "Redis" in err["message"]
    finally:
        app.extensions["farm"].gateway.stop()


def test_a_hung_redis_ends_the_scrape_in_time_and_says_so(tmp_path):
    """The ops audit: with Redis stopped (not refusing: hung), /metrics waited 10 s on it, as long as Prometheus'
    scrape timeout, so farm_redis_up 0 was never recorded, and the last farm-wide series (live workers) were
    served on. It now answers within the metrics client's 2 s with farm_redis_up 0 and no farm-wide series; and
    a process that exits gives the exporter's lease up, so its successor exports at once, not 60 s later."""
    import os
    import signal

    from tests.conftest import start_redis

    proc, url = start_redis(tmp_path / "redis")
    try:
        cfg = load_config(environ=make_farm_env(url, tmp_path))
        app = create_app(cfg)
        r = redis.Redis.from_url(url)
        registry.register(r, registry.WorkerInfo("d1", "decode", cfg.default_model, "h", 1, cfg.engine.block_size))
        registry.heartbeat(r, "d1", {"running": 0, "waiting": 0})
        c = app.test_client()
        assert "farm_workers{" in c.get("/metrics").get_data(as_text=True)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            text = c.get("/metrics").get_data(as_text=True)
            assert time.monotonic() - t0 < 5
            assert "farm_redis_up 0.0" in text and "farm_workers{" not in text
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        farm = app.extensions["farm"]
        assert r.get(METRICS_EXPORTER_KEY) is not None
        farm.farm_collector.release()
        assert r.get(METRICS_EXPORTER_KEY) is None  # another replica's lease would have been left alone
        farm.gateway.stop()
    finally:
        proc.kill()
        proc.wait()
