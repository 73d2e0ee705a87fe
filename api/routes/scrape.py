"""GET /metrics: Prometheus text format, the API's own metrics plus farm-wide gauges read at scrape
time from Redis (queue depths, worker KV blocks), so one endpoint shows the whole farm."""

from __future__ import annotations

import sys

from flask import Blueprint, Response, current_app
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from farm.telemetry.prometheus import API_LOOP_WATCHERS

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
def prometheus():
    farm = current_app.extensions["farm"]
    farm.farm_collector.refresh()
    API_LOOP_WATCHERS.set(loop_watchers())
    return Response(generate_latest(), mimetype=CONTENT_TYPE_LATEST)


def loop_watchers() -> int:
    """The gevent hub's active watchers (gunicorn's gevent worker); 0 where gevent is not running the app."""
    if "gevent" not in sys.modules:
        return 0
    import gevent

    return int(gevent.get_hub().loop.activecnt)
