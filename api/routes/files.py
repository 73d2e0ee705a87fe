"""OpenAI Files API, for batch input and output: POST /v1/files (multipart, purpose=batch), GET /v1/files,
GET /v1/files/{id}, GET /v1/files/{id}/content, DELETE /v1/files/{id}.

Metadata lives in Redis and bodies on disk under `<state_dir>/files/` or in Redis (`batch.files_backend`,
farm.batch.store), so every API replica and batch driver sees the same files, and they survive restarts. Each file
carries an `owner` (the API key's owner id, api.auth; "anonymous" without keys) and is only visible to
its owner: another key gets 404, as from OpenAI.
"""

from __future__ import annotations

import time

from flask import Blueprint, current_app, jsonify, request, send_file

from api.auth import current_owner
from api.bodies import require_multipart
from farm.batch.file_store import FileStorageFull, FileStore, public_file
from farm.batch.store import BatchStore, clean_filename
from farm.batch.upload_room import FileQuotaExceeded, OwnerQuota
from farm.openai.api_error import APIError, bad_request

bp = Blueprint("files", __name__, url_prefix="/v1")

UPLOAD_PURPOSES = {"batch"}


class BatchContext:
    """What the Files and Batches routes share in one API process."""

    def __init__(self, farm):
        self.farm = farm
        self.cfg = farm.cfg.batch
        self.files = FileStore.from_config(farm.redis, farm.cfg)
        self.batches = BatchStore(farm.redis)
        self.quota = OwnerQuota.from_config(farm.cfg)  # what one key's uploads may hold


def batch_ctx() -> BatchContext:
    ctx = current_app.extensions.get("farm_batch")
    if ctx is None:
        ctx = current_app.extensions["farm_batch"] = BatchContext(current_app.extensions["farm"])
    return ctx


def request_owner() -> str:
    """Who is asking: the owner recorded on what they create and required on what they read (the API
    key's owner id from api.auth; anonymous when the farm has no keys)."""
    return current_owner()


def not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")


@bp.before_request
def _upload_limit() -> None:
    request.max_content_length = batch_ctx().cfg.max_file_bytes  # batch files are larger than API bodies


EXPIRES_AFTER_S = (3600, 30 * 86400)  # OpenAI's bounds of expires_after[seconds]: an hour to 30 days


def _expires_after() -> int | None:
    """OpenAI's `expires_after` of an upload (multipart fields `expires_after[anchor]`, `created_at` only, and
    `expires_after[seconds]`): the seconds after which the retention sweep deletes the file, or None."""
    anchor, seconds = request.form.get("expires_after[anchor]"), request.form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise bad_request("'expires_after[anchor]' must be created_at", "expires_after.anchor", "invalid_value")
    lo, hi = EXPIRES_AFTER_S
    if seconds is None or not seconds.isascii() or not seconds.isdigit() or not lo <= int(seconds) <= hi:
        raise bad_request(f"'expires_after[seconds]' must be an integer from {lo} to {hi}", "expires_after.seconds",
                          "invalid_value")
    return int(seconds)


@bp.post("/files")
def upload():
    ctx = batch_ctx()
    require_multipart()
    purpose = request.form.get("purpose")
    if not purpose:
        raise bad_request("'purpose' is required", "purpose", "missing_required_parameter")
    if purpose not in UPLOAD_PURPOSES:
        raise bad_request(f"purpose {purpose!r} is not supported here; use 'batch'", "purpose", "unsupported_value")
    up = request.files.get("file")
    if up is None:
        raise bad_request("'file' is required (multipart/form-data)", "file", "missing_required_parameter")
    expires_in = _expires_after()
    try:
        meta = ctx.files.create(up.stream, up.filename or "upload.jsonl", purpose, request_owner(),
                                expires_at=None if expires_in is None else int(time.time()) + expires_in,
                                quota=ctx.quota)
    except FileStorageFull as e:
        raise APIError(413, str(e), param="file", code="file_storage_full") from None
    except FileQuotaExceeded as e:
        raise APIError(413, str(e), param="file", code="file_quota_exceeded") from None
    if meta["bytes"] == 0:
        ctx.files.delete(meta["id"])
        raise bad_request("the file is empty", "file", "invalid_value")
    return jsonify(public_file(meta))


@bp.get("/files")
def list_files():
    ctx = batch_ctx()
    limit = limit_arg(10_000, 10_000)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be asc or desc", "order", "invalid_value")
    page, has_more = ctx.files.list(request_owner(), request.args.get("purpose"), request.args.get("after"), limit,
                                    oldest_first=order == "asc")
    data = [public_file(m) for m in page]
    return jsonify({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@bp.get("/files/<file_id>")
def get_file(file_id: str):
    meta = batch_ctx().files.get(file_id, request_owner())
    if meta is None:
        raise not_found(file_id)
    return jsonify(public_file(meta))


@bp.get("/files/<file_id>/content")
def file_content(file_id: str):
    ctx = batch_ctx()
    meta = ctx.files.get(file_id, request_owner())
    if meta is None:
        raise not_found(file_id)
    try:
        f = ctx.files.open(file_id)
    except FileNotFoundError:
        raise APIError(404, f"The content of {file_id} is no longer stored", param="id", code="file_not_found") from None
    return send_file(f, mimetype="application/octet-stream", as_attachment=True,
                     download_name=clean_filename(meta.get("filename")))  # also names stored before cleaning


@bp.delete("/files/<file_id>")
def delete_file(file_id: str):
    ctx = batch_ctx()
    if ctx.files.get(file_id, request_owner()) is None:
        raise not_found(file_id)
    reader = ctx.batches.active_reading(file_id)
    if reader is not None:
        raise APIError(409, f"The file {file_id} is the input of batch {reader}, which has not ended; cancel the "
                       "batch or wait for it to end, then delete the file", param="id", code="file_in_use")
    ctx.files.delete(file_id)
    return jsonify({"id": file_id, "object": "file", "deleted": True})


def limit_arg(default: int, most: int) -> int:
    raw = request.args.get("limit")
    if raw is None:
        return default
    try:
        n = int(raw)
    except ValueError:
        raise bad_request("'limit' must be an integer", "limit") from None
    if not 1 <= n <= most:
        raise bad_request(f"'limit' must be between 1 and {most}", "limit", "invalid_value")
    return n
