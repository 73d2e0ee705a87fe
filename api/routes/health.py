"""Health: `/health/live` (the process serves HTTP), `/health/ready` (it can serve requests: Redis answers),
and `/health` (Redis reachable, and which live workers serve each model in which role).

Liveness never touches Redis: a Redis outage makes every API replica unready (taken out of the Service, so
clients get a fast 503 elsewhere or wait) but never restarts them, which would drop every stream in flight
and gain nothing, since a new process cannot reach Redis either. `/health` keeps its old answer for the
clients and tools that read it.
"""

from __future__ import annotations

import redis
from flask import Blueprint, Response, current_app, jsonify

from farm.cluster import registry

bp = Blueprint("health", __name__)

ROLES = ("prefill", "decode", "both")


def _redis_down(e: redis.RedisError) -> Response:
    resp = jsonify({"status": "unavailable", "redis": "down", "error": str(e)})
    resp.status_code = 503
    resp.headers["Retry-After"] = "2"
    return resp


@bp.get("/health/live")
def live() -> Response:
    """200 while this process answers HTTP: what a liveness probe asks, and all it asks."""
    return jsonify({"status": "ok"})


@bp.get("/health/ready")
def ready() -> Response:
    """200 when Redis answers (this replica can place and stream requests); 503 with Retry-After otherwise.
    Workers are not required: without one a request gets a clean 503 from the API itself."""
    try:
        current_app.extensions["farm"].redis.ping()
    except redis.RedisError as e:
        return _redis_down(e)
    return jsonify({"status": "ok", "redis": "ok"})


@bp.get("/health")
def health() -> Response:
    """200 with live worker counts per model and role; `status` "degraded" (still 200: the API serves, and
    answers those models' requests with a clean 503) when a model has no worker that generates (decode or
    aggregated: prefill workers alone answer nothing), named in `unserved`; 503 when Redis (the farm's
    backbone) is down."""
    farm = current_app.extensions["farm"]
    try:
        workers = registry.live_workers(farm.redis)
    except redis.RedisError as e:
        return _redis_down(e)
    by_model: dict[str, dict[str, int]] = {m.name: dict.fromkeys(ROLES, 0) for m in farm.cfg.models}
    for w in workers:
        by_model.setdefault(w.model, dict.fromkeys(ROLES, 0))[w.role] += 1
    unserved = [m.name for m in farm.cfg.models if not (by_model[m.name]["decode"] or by_model[m.name]["both"])]
    return jsonify({"status": "degraded" if unserved else "ok", "redis": "ok", "workers": by_model,
                    "unserved": unserved, "models": [m.name for m in farm.cfg.models],
                    "router_mode": farm.cfg.router.mode})
