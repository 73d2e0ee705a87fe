"""GET /health: Redis reachable, and which live workers serve each model in which role."""

from __future__ import annotations

import redis
from flask import Blueprint, Response, current_app, jsonify

from farm import registry

bp = Blueprint("health", __name__)


@bp.get("/health")
def health() -> Response:
    """200 with live worker counts per model and role; 503 when Redis (the farm's backbone) is down."""
    farm = current_app.extensions["farm"]
    try:
        workers = registry.live_workers(farm.redis)
    except redis.RedisError as e:
        resp = jsonify({"status": "unavailable", "redis": "down", "error": str(e)})
        resp.status_code = 503
        resp.headers["Retry-After"] = "2"
        return resp
    by_model: dict[str, dict[str, int]] = {m.name: {"prefill": 0, "decode": 0, "both": 0} for m in farm.cfg.models}
    for w in workers:
        by_model.setdefault(w.model, {"prefill": 0, "decode": 0, "both": 0})[w.role] += 1
    return jsonify({"status": "ok", "redis": "ok", "workers": by_model,
                    "models": [m.name for m in farm.cfg.models], "router_mode": farm.cfg.router.mode})
