"""The Responses API's stored responses in Redis: each under its owner's key (farm.protocol.keys.response_key),
so one API key never reads, continues or deletes another's, and an id of another owner is simply not found; each
with a TTL (api.responses_ttl_s). A record holds the response object, its input items (as listed by
`GET /v1/responses/{id}/input_items`) and the whole conversation as chat messages (what `previous_response_id`
continues, without the instructions, which OpenAI does not carry over). Every API replica reads every record.
Each owner's records are counted (ids by expiry, their sizes, their total: `owner_responses_key`), so a key's
stored responses stay under its quota: what a record holds beyond the tokens it was charged (ids, tool
descriptions) cannot fill Redis."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from farm.infra.redis_client import as_str
from farm.protocol.keys import owner_responses_key, response_key

MAX_ID_CHARS = 256  # longer ids are not looked up: nothing was ever stored under one


class ResponseStore:
    def __init__(self, r: redis.Redis, ttl_s: int, max_bytes: int = 64 << 20, max_records: int = 10_000):
        self.r, self.ttl_s = r, ttl_s
        self.max_bytes, self.max_records = max_bytes, max_records

    def save(self, owner: str, response: dict[str, Any], input_items: list[dict[str, Any]],
             conversation: list[dict[str, Any]]) -> None:
        record = {"response": response, "input_items": input_items, "conversation": conversation}
        data = json.dumps(record, separators=(",", ":"))
        index, sizes, total = _count_keys(owner)
        rid = response["id"]
        pipe = self.r.pipeline()
        pipe.set(response_key(owner, rid), data, ex=self.ttl_s)
        pipe.zadd(index, {rid: time.time() + self.ttl_s})
        pipe.hset(sizes, rid, len(data))
        pipe.incrby(total, len(data))
        for key in (index, sizes, total):  # gone with the owner's last record
            pipe.expire(key, self.ttl_s + 60)
        pipe.execute()

    def usage(self, owner: str) -> tuple[int, int]:
        """(bytes, records) of the owner's stored responses, after taking out those that expired."""
        index, _, total = _count_keys(owner)
        self._uncount(owner, [as_str(rid) for rid in self.r.zrangebyscore(index, "-inf", time.time())])
        pipe = self.r.pipeline()
        pipe.get(total)
        pipe.zcard(index)
        used, count = pipe.execute()
        return max(0, int(used or 0)), int(count)

    def _uncount(self, owner: str, ids: list[str]) -> None:
        """Take records (expired or deleted) out of the owner's count: their ids, sizes and bytes."""
        if not ids:
            return
        index, sizes, total = _count_keys(owner)
        gone = self.r.hmget(sizes, ids)
        pipe = self.r.pipeline()
        pipe.zrem(index, *ids)
        pipe.hdel(sizes, *ids)
        pipe.decrby(total, sum(int(x or 0) for x in gone))
        pipe.execute()

    def full(self, owner: str) -> str | None:
        """Why the owner may not store another response (its quota: api.responses_owner_max_mb and
        api.responses_owner_max), or None."""
        used, count = self.usage(owner)
        if count >= self.max_records:
            return f"this key has {count} stored responses, the most it may (api.responses_owner_max)"
        if used >= self.max_bytes:
            return f"this key's stored responses hold {used >> 20} MB, the most they may (api.responses_owner_max_mb)"
        return None

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """The record (`response`, `input_items`, `conversation`), or None when `owner` has none by that id."""
        if len(response_id) > MAX_ID_CHARS:
            return None
        raw = self.r.get(response_key(owner, response_id))
        return json.loads(raw) if raw is not None else None

    def delete(self, owner: str, response_id: str) -> bool:
        if len(response_id) > MAX_ID_CHARS or not self.r.delete(response_key(owner, response_id)):
            return False
        self._uncount(owner, [response_id])
        return True


def _count_keys(owner: str) -> tuple[str, str, str]:
    """The owner's count of stored responses: ids by expiry, their sizes, their bytes together."""
    index = owner_responses_key(owner)
    return index, f"{index}:sizes", f"{index}:bytes"
