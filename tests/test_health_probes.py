"""Liveness apart from readiness, against a real redis-server that goes away and comes back: /health/live
answers 200 throughout (what the chart's livenessProbe and the image's HEALTHCHECK ask, so a Redis outage
restarts no API pod), /health/ready and /health answer 503 with Retry-After while Redis is down (the readiness
probe takes the pod out of the Service) and 200 again once it is back."""

from __future__ import annotations

import time

from api.app import create_app
from farm.config import load_config
from tests.conftest import start_redis


def _until(check, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_liveness_never_asks_redis_readiness_does(tmp_path):
    proc, url = start_redis(tmp_path / "redis")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    cfg = load_config(environ={"FARM_REDIS__URL": url, "FARM_STATE_DIR": str(tmp_path / "state"),
                               "FARM_SEMANTIC__ENABLED": "false"})
    app = create_app(cfg, warm_semantic=False)
    c = app.test_client()
    try:
        assert c.get("/health/live").status_code == 200
        assert c.get("/health/ready").get_json() == {"status": "ok", "redis": "ok"}
        proc.terminate()
        proc.wait(10)
        ready = c.get("/health/ready")
        assert ready.status_code == 503 and ready.headers["Retry-After"] and ready.get_json()["redis"] == "down"
        assert c.get("/health").status_code == 503
        t = time.monotonic()
        live = c.get("/health/live")
        assert live.status_code == 200 and live.get_json() == {"status": "ok"}
        assert time.monotonic() - t < 0.5, "liveness does not wait on Redis either"
        proc, _ = start_redis(tmp_path / "redis", port=port)
        assert _until(lambda: c.get("/health/ready").status_code == 200), "ready again once Redis is back"
        assert c.get("/health/live").status_code == 200
    finally:
        app.extensions["farm"].gateway.stop()
        proc.kill()
        proc.wait(10)
