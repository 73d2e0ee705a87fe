"""OpenAI Batch API: POST /v1/batches, GET /v1/batches/{id}, GET /v1/batches, POST /v1/batches/{id}/cancel.

Creating a batch stores it (status `validating`) and sends it to the batch-driver queue; a batch-driver
process (`python -m tasks.batch`) validates every line up front, runs the lines below interactive
traffic, and writes the output and error files (farm.batch.driver). These routes only read and change
state in Redis, so any API replica answers for any batch, before and after restarts.

Extension: `"schedule": "prefix" | "input"` in the create body (the SDK's `extra_body`) picks the line
order for one batch (default: batch.schedule, prefix-grouped).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, current_app, jsonify, request

from api.bodies import json_body
from api.routes.files import batch_ctx, limit_arg, request_owner
from farm.batch.handoff import send_to_driver
from farm.batch.store import public_batch
from farm.batch.validate import ENDPOINT_KINDS
from farm.openai.api_error import APIError, bad_request
from farm.openai.schemas import BatchCreateRequest, reject_unknown_fields
from farm.protocol.jsonsafe import one_of

bp = Blueprint("batches", __name__, url_prefix="/v1")

COMPLETION_WINDOWS = ("24h",)


def _not_found(batch_id: str) -> APIError:
    return APIError(404, f"No such Batch object: {batch_id}", param="id", code="batch_not_found")


def _json_object() -> dict[str, Any]:
    body = json_body()
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    reject_unknown_fields(body, BatchCreateRequest)
    return body


def _metadata(v: Any) -> dict[str, str] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_request("'metadata' must be an object", "metadata")
    if len(v) > 16:
        raise bad_request("'metadata' may hold at most 16 keys", "metadata", "invalid_value")
    for k, val in v.items():
        if len(k) > 64:
            raise bad_request("'metadata' keys are at most 64 characters", "metadata", "invalid_value")
        if not isinstance(val, str) or len(val) > 512:
            raise bad_request("'metadata' values must be strings of at most 512 characters", "metadata",
                              "invalid_value")
    return v


@bp.post("/batches")
def create_batch():
    ctx = batch_ctx()
    body = _json_object()
    file_id = body.get("input_file_id")
    if not file_id:
        raise bad_request("'input_file_id' is required", "input_file_id", "missing_required_parameter")
    if not isinstance(file_id, str):
        raise bad_request("'input_file_id' must be a string", "input_file_id")
    endpoint = body.get("endpoint")
    if endpoint is None:
        raise bad_request("'endpoint' is required", "endpoint", "missing_required_parameter")
    if not one_of(endpoint, ENDPOINT_KINDS):
        raise bad_request(f"endpoint {endpoint!r} is not supported; use one of {sorted(ENDPOINT_KINDS)}",
                          "endpoint", "unsupported_value")
    window = body.get("completion_window")
    if window is None:
        raise bad_request("'completion_window' is required", "completion_window", "missing_required_parameter")
    if window not in COMPLETION_WINDOWS:
        raise bad_request("'completion_window' must be '24h'", "completion_window", "invalid_value")
    metadata = _metadata(body.get("metadata"))
    schedule = body.get("schedule")
    if schedule not in (None, "prefix", "input"):
        raise bad_request("'schedule' must be 'prefix' or 'input'", "schedule", "invalid_value")
    owner = request_owner()
    meta = ctx.files.get(file_id, owner)
    if meta is None:
        raise APIError(404, f"No such File object: {file_id}", param="input_file_id", code="file_not_found")
    if meta.get("purpose") != "batch":
        raise bad_request(f"the file {file_id} has purpose {meta.get('purpose')!r}, not 'batch'", "input_file_id",
                          "invalid_value")
    b = ctx.batches.create(file_id, endpoint, window, ctx.cfg.completion_window_s, metadata, owner, schedule)
    farm = current_app.extensions["farm"]
    send_to_driver(farm.celery, ctx.batches, b["id"], ctx.cfg, force=True)
    return jsonify(public_batch(b))


@bp.get("/batches/<batch_id>")
def get_batch(batch_id: str):
    b = batch_ctx().batches.get(batch_id, request_owner())
    if b is None:
        raise _not_found(batch_id)
    return jsonify(public_batch(b))


@bp.get("/batches")
def list_batches():
    limit = limit_arg(20, 100)
    page, has_more = batch_ctx().batches.list(request_owner(), request.args.get("after"), limit)
    data = [public_batch(b) for b in page]
    return jsonify({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@bp.post("/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    """validating/in_progress -> cancelling; the driver stops its lines, writes what finished, -> cancelled."""
    import time

    ctx = batch_ctx()
    if ctx.batches.get(batch_id, request_owner()) is None:
        raise _not_found(batch_id)
    ok, st = ctx.batches.transition(batch_id, ("validating", "in_progress"), "cancelling",
                                    cancelling_at=int(time.time()))
    if not ok and st not in ("cancelling", "cancelled"):
        raise APIError(409, f"Cannot cancel a batch with status {st!r}", param="id", code="batch_not_cancellable",
                       type="invalid_request_error")
    if ok and not ctx.batches.leased(batch_id):  # no driver holds it (queued): let one finish the cancel
        send_to_driver(current_app.extensions["farm"].celery, ctx.batches, batch_id, ctx.cfg, force=True)
    return jsonify(public_batch(ctx.batches.get(batch_id) or {}))
