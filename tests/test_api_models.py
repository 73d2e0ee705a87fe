"""GET /v1/models and /health, built the way gunicorn builds the app: `create_app()` in the farm's env."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flask import Flask

from api.app import create_app
from farm.cluster import registry
from farm.config import load_config
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
    assert [m["id"] for m in data["data"]] == [m.name for m in cfg.models] + list(cfg.semantic.aliases)
    card = next(m for m in data["data"] if m["id"] == cfg.default_model)
    assert set(card) == {"id", "object", "created", "owned_by", "max_model_len"}
    assert card["object"] == "model" and card["owned_by"] == "inference-farm" and isinstance(card["created"], int)
    assert card["max_model_len"] == cfg.model(cfg.default_model).max_model_len
    one = c.get(f"/v1/models/{cfg.default_model}")
    assert one.status_code == 200 and one.get_json() == card
    assert_error(c.get("/v1/models/no-such-model"), 404, "model", "model_not_found")


def test_health_counts_live_workers_by_role(app, redis_client):
    c = app.test_client()
    cfg = app.extensions["farm"].cfg
    resp = c.get("/health")
    assert resp.status_code == 200
    h = resp.get_json()
    assert h["status"] == "ok" and h["redis"] == "ok"
    assert h["models"] == [m.name for m in cfg.models]
    assert h["workers"] == {m.name: {"prefill": 0, "decode": 0, "both": 0} for m in cfg.models}
    for wid, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode")):
        registry.register(redis_client, registry.WorkerInfo(wid, role, cfg.default_model, "h", 1,
                                                            cfg.engine.block_size))
    redis_client.delete(registry.alive_key("d2"))  # a worker whose heartbeat expired is not counted
    assert c.get("/health").get_json()["workers"][cfg.default_model] == {"prefill": 1, "decode": 1, "both": 0}


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
