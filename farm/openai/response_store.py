"""The Responses API's stored responses in Redis: each under its owner's key (farm.protocol.keys.response_key),
so one API key never reads, continues or deletes another's, and an id of another owner is simply not found; each
with a TTL (api.responses_ttl_s). A record holds the response object, its input items (as listed by
`GET /v1/responses/{id}/input_items`) and the whole conversation as chat messages (what `previous_response_id`
continues, without the instructions, which OpenAI does not carry over). Every API replica reads every record."""

from __future__ import annotations

import json
from typing import Any

import redis

from farm.protocol.keys import response_key

MAX_ID_CHARS = 256  # longer ids are not looked up: nothing was ever stored under one


class ResponseStore:
    def __init__(self, r: redis.Redis, ttl_s: int):
        self.r, self.ttl_s = r, ttl_s

    def save(self, owner: str, response: dict[str, Any], input_items: list[dict[str, Any]],
             conversation: list[dict[str, Any]]) -> None:
        record = {"response": response, "input_items": input_items, "conversation": conversation}
        self.r.set(response_key(owner, response["id"]), json.dumps(record, separators=(",", ":")), ex=self.ttl_s)

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """The record (`response`, `input_items`, `conversation`), or None when `owner` has none by that id."""
        if len(response_id) > MAX_ID_CHARS:
            return None
        raw = self.r.get(response_key(owner, response_id))
        return json.loads(raw) if raw is not None else None

    def delete(self, owner: str, response_id: str) -> bool:
        return len(response_id) <= MAX_ID_CHARS and bool(self.r.delete(response_key(owner, response_id)))
