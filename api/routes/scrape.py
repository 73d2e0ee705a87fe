"""GET /metrics: Prometheus text format, the API's own metrics plus farm-wide gauges read at scrape
time from Redis (queue depths, worker KV blocks), so one endpoint shows the whole farm."""

from __future__ import annotations

from flask import Blueprint, Response, current_app
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
def prometheus():
    farm = current_app.extensions["farm"]
    farm.farm_collector.refresh()
    return Response(generate_latest(), mimetype=CONTENT_TYPE_LATEST)
