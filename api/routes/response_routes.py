"""OpenAI's Responses API: `POST /v1/responses` on the chat-completions path, and the stored responses
(`GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`).

The body is checked and translated by farm.openai.responses_api into a chat-completions body (after the stored
conversation its `previous_response_id` continues), which runs through the very path of /v1/chat/completions
(api.routes.openai.generate: model check, limits, token quota, the semantic layer, the gateway); its answer is
translated back by farm.openai.responses_output, JSON or SSE. A response with `store` (the default) is kept under
the caller's owner id (farm.openai.response_store), so another API key's id is a 404 like an unknown one. Errors
are OpenAI's shape, as on every OpenAI route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from api.auth import current_owner
from api.bodies import json_body
from api.routes.files import limit_arg
from api.routes.openai import generate
from farm.openai import responses_api as api
from farm.openai import responses_output as out
from farm.openai.api_error import APIError, bad_request
from farm.openai.response_store import ResponseStore

log = logging.getLogger(__name__)
bp = Blueprint("responses", __name__, url_prefix="/v1")
MAX_ITEMS_PAGE = 100


def _store() -> ResponseStore:
    farm = current_app.extensions["farm"]
    api_cfg = farm.cfg.api
    return ResponseStore(farm.redis, api_cfg.responses_ttl_s, api_cfg.responses_owner_max_mb << 20,
                         api_cfg.responses_owner_max)


def _not_found(response_id: str, param: str | None = None) -> APIError:
    code = "previous_response_not_found" if param else "response_not_found"
    what = "Previous response" if param else "Response"
    return APIError(404, f"{what} with id '{response_id}' not found.", param=param, code=code)


def _record(response_id: str) -> dict[str, Any]:
    record = _store().get(current_owner(), response_id)
    if record is None:
        raise _not_found(response_id)
    return record


@bp.post("/responses")
def create_response() -> Response:
    req = api.parse_request(json_body())
    store, owner = _store(), current_owner()
    if req.store is not False and (why := store.full(owner)) is not None:
        raise APIError(400, f"{why}; delete responses you no longer need (DELETE /v1/responses/{{id}}) or send "
                       "store: false", param="store", code="stored_responses_quota_exceeded")
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = store.get(owner, req.previous_response_id)
        if prev is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        history = prev["conversation"]
    body = api.to_chat_body(req, history)
    items = api.input_items(req)
    conversation = history + api.input_messages(req)

    def keep(response: dict[str, Any], turn: out.Turn) -> None:
        if req.store is not False:
            store.save(owner, response, items, [*conversation, turn.chat_message()])

    ctx = out.ResponseContext(req)
    try:
        resp = generate("chat", body)
    except APIError as e:
        raise api.renamed(e) from None
    if resp.mimetype == "text/event-stream":
        resp.response = out.translate_stream(resp.response, ctx, _logged(keep))
        return resp
    obj, turn = out.from_chat_completion(resp.get_json(), ctx)
    keep(obj, turn)
    resp.set_data(jsonify(obj).get_data())
    return resp


def _logged(keep: Callable[[dict[str, Any], out.Turn], None]) -> Callable[[dict[str, Any], out.Turn], None]:
    """`keep` for a stream, whose headers are sent: a store that fails is logged, the answer still completes."""
    def run(response: dict[str, Any], turn: out.Turn) -> None:
        try:
            keep(response, turn)
        except Exception:  # noqa: BLE001 - the client has its answer; only a later retrieve misses it
            log.exception("response %s: could not store it", response["id"])
    return run


@bp.get("/responses/<response_id>")
def get_response(response_id: str) -> Response:
    return jsonify(_record(response_id)["response"])


@bp.delete("/responses/<response_id>")
def delete_response(response_id: str) -> Response:
    if not _store().delete(current_owner(), response_id):
        raise _not_found(response_id)
    return jsonify({"id": response_id, "object": "response", "deleted": True})


@bp.get("/responses/<response_id>/input_items")
def list_input_items(response_id: str) -> Response:
    """OpenAI's list of a response's input items: `order` desc (default) or asc, `after` an item id, `limit`."""
    items = _record(response_id)["input_items"]
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be asc or desc", "order", "invalid_value")
    if order == "desc":
        items = items[::-1]
    after = request.args.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    limit = limit_arg(20, MAX_ITEMS_PAGE)
    page = items[:limit]
    return jsonify({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                    "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
