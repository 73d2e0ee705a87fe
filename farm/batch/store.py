"""Durable state of batches (metadata and progress in Redis), and the ids files and batches share; files
themselves (metadata and bodies) are in file_store.py.

Keys (farm.protocol.keys, all under `farm:file:` / `farm:batch:`):
- `farm:file:<id>` hash: the file's metadata; `farm:files` zset lists them. The body is at `<files_dir>/<id>`
  (`batch.files_backend: disk`) or in `farm:file:<id>:body` (`redis`; `farm:files:bytes` = all bodies'
  bytes, held under `batch.files_redis_max_mb`).
- `farm:batch:<id>` hash: every field of the batch object, JSON-encoded, plus counters (total,
  completed, failed, token usage) updated with HINCRBY; `farm:batches` zset lists them (score = a
  creation sequence number, so the order is total); `farm:batch:active` is the set not yet final.
- `farm:batch:<id>:results` hash custom_id -> the line's result. Written once per custom_id (HSETNX,
  in the same Lua script that bumps the counters), so a line that runs twice (a redelivered driver, a
  retried line) is recorded and counted once: the output and error files are built from this hash.
- `farm:batch:<id>:lease`: the driver that owns the batch (token, TTL refreshed while it runs).
- `farm:batch:<id>:kick`: set when the batch was (re-)sent to the driver queue, to send it once.
- `farm:batch:inflight` zset request id -> deadline: batch lines in flight, farm-wide (the driver
  subtracts them from the farm's load to see interactive load).

Status changes are compare-and-set scripts, so the API (cancel) and a driver never overwrite each other.
"""

from __future__ import annotations

import json
import re
import time
import unicodedata
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import redis

from farm.infra.redis_client import as_str
from farm.protocol.keys import (
    BATCH_ACTIVE_KEY,
    BATCH_INFLIGHT_KEY,
    BATCH_SEQ_KEY,
    BATCHES_ENDED_KEY,
    BATCHES_KEY,
    batch_answered_key,
    batch_key,
    batch_kick_key,
    batch_lease_key,
    batch_results_key,
    owner_batches_key,
)
from farm.tenancy.api_keys import OWNER_ANONYMOUS

TERMINAL = ("completed", "failed", "expired", "cancelled")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
COUNTERS = ("total", "completed", "failed", "input_tokens", "cached_tokens", "output_tokens")

# Client-supplied ids address Redis keys and files: only ids of the shapes made here are looked up, so no
# id reaches an internal key ("seq" would be farm:batch:seq) or another batch's sub-key ("<id>:results").
FILE_ID = re.compile(r"file-[0-9a-f]{24}(?:out|err)?")  # uploads; a batch's output and error files
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")


def is_file_id(file_id: str) -> bool:
    return isinstance(file_id, str) and FILE_ID.fullmatch(file_id) is not None


def is_batch_id(batch_id: str) -> bool:
    return isinstance(batch_id, str) and BATCH_ID.fullmatch(batch_id) is not None


MAX_FILENAME_CHARS = 255
_UNSAFE_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")  # control and format characters, line and paragraph separators


def clean_filename(name: str | None, default: str = "upload.jsonl") -> str:
    """A client's file name made safe to store and to send back in Content-Disposition: no control
    characters (CR/LF would break the header, NUL the server's own response), no path, bounded length."""
    name = "".join(c for c in (name or "") if unicodedata.category(c) not in _UNSAFE_CATEGORIES)
    name = name.replace("/", "_").replace("\\", "_").strip().lstrip(".")
    return name[:MAX_FILENAME_CHARS] or default


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex[:24]


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex


# KEYS: batch hash, active set, ended zset. ARGV: allowed from-states (JSON list), new status, batch id, n, then
# n field/JSON-value pairs. Returns {1, new} when changed, {0, current} otherwise ({0, false} if missing).
_TRANSITION = """
local raw = redis.call('HGET', KEYS[1], 'status')
if not raw then return {0, false} end
local cur = cjson.decode(raw)
local allowed = false
for _, s in ipairs(cjson.decode(ARGV[1])) do
  if s == cur then allowed = true end
end
if not allowed then return {0, cur} end
redis.call('HSET', KEYS[1], 'status', cjson.encode(ARGV[2]))
local n = tonumber(ARGV[4])
for i = 1, n do
  redis.call('HSET', KEYS[1], ARGV[3 + 2 * i], ARGV[4 + 2 * i])
end
local terminal = {completed = true, failed = true, expired = true, cancelled = true}
if terminal[ARGV[2]] then
  redis.call('SREM', KEYS[2], ARGV[3])
  redis.call('ZADD', KEYS[3], redis.call('TIME')[1], ARGV[3])
end
return {1, ARGV[2]}
"""

# KEYS: results hash, batch hash. ARGV: custom_id, result JSON, ok (1/0), input, cached, output tokens.
# Only while the batch runs (in_progress or cancelling, not yet sealed for its files); returns 1 recorded,
# 0 already there, -1 not running.
_RECORD = """
local raw = redis.call('HGET', KEYS[2], 'status')
if not raw then return -1 end
local st = cjson.decode(raw)
if st ~= 'in_progress' and st ~= 'cancelling' then return -1 end
if redis.call('HGET', KEYS[2], 'sealed') == 'true' then return -1 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
if ARGV[3] == '1' then
  redis.call('HINCRBY', KEYS[2], 'completed', 1)
else
  redis.call('HINCRBY', KEYS[2], 'failed', 1)
end
redis.call('HINCRBY', KEYS[2], 'input_tokens', tonumber(ARGV[4]))
redis.call('HINCRBY', KEYS[2], 'cached_tokens', tonumber(ARGV[5]))
redis.call('HINCRBY', KEYS[2], 'output_tokens', tonumber(ARGV[6]))
return 1
"""

_REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def owner_page(r: redis.Redis, zkey: str, key_of: Callable[[str], str], owner: str, after: str | None, limit: int,
               keep: Callable[[dict[str, Any]], bool] = lambda d: True,
               oldest_first: bool = False) -> tuple[list[dict[str, Any]], bool]:
    """One page of an owner's index (`owner_files_key`, `owner_batches_key`), newest first (or oldest first) after
    the id `after`: (the decoded hashes `key_of(id)` names, has_more), read 64 at a time in one pipeline each, until
    one more than `limit` is kept. The cost is the owner's own items, never every tenant's."""
    rank_of, window = (r.zrank, r.zrange) if oldest_first else (r.zrevrank, r.zrevrange)
    start = 0
    if after:
        rank = rank_of(zkey, after)
        if rank is not None:
            start = rank + 1
    out: list[dict[str, Any]] = []
    while len(out) <= limit:
        ids = window(zkey, start, start + 63)
        if not ids:
            break
        start += len(ids)
        pipe = r.pipeline()
        for i in ids:
            pipe.hgetall(key_of(as_str(i)))
        for raw in pipe.execute():
            if raw:
                d = {as_str(k): json.loads(v) for k, v in raw.items()}
                if d.get("owner") == owner and keep(d):
                    out.append(d)
    return out[:limit], len(out) > limit


def index_by_owner(r: redis.Redis, old_key: str, key_of: Callable[[str], str], index: Callable[[str], str],
                   bytes_of: Callable[[str], str] | None = None) -> None:
    """Move an index of every tenant's ids (`old_key`, before owner indexes) into the owners' own, once: each id
    keeps its sequence; an id whose hash is gone is dropped; with `bytes_of`, each owner's total of the hashes'
    `bytes` is added there (files: the owner's storage quota). Run by every store as it starts; the first to
    take the old index moves it (RENAME: one process, and never twice)."""
    if not r.exists(old_key):
        return
    taken = f"{old_key}:moving:{uuid.uuid4().hex}"
    try:
        r.rename(old_key, taken)
    except redis.ResponseError:  # another process took it first
        return
    entries = r.zrange(taken, 0, -1, withscores=True)
    for i in range(0, len(entries), 256):
        chunk = entries[i:i + 256]
        pipe = r.pipeline()
        for member, _ in chunk:
            pipe.hmget(key_of(as_str(member)), ["owner", "bytes"])
        found = pipe.execute()
        pipe = r.pipeline()
        for (member, score), (owner, size) in zip(chunk, found, strict=True):
            if owner is not None:
                pipe.zadd(index(json.loads(owner)), {member: score})
                if bytes_of is not None:
                    pipe.incrby(bytes_of(json.loads(owner)), int(json.loads(size or b"0")))
        pipe.execute()
    r.delete(taken)


# -- batches ----------------------------------------------------------------------------------------------
class BatchStore:
    def __init__(self, r: redis.Redis):
        self.r = r
        self._transition = r.register_script(_TRANSITION)
        self._record = r.register_script(_RECORD)
        self._refresh = r.register_script(_REFRESH)
        self._release = r.register_script(_RELEASE)
        index_by_owner(r, BATCHES_KEY, batch_key, owner_batches_key)  # a farm of before owner indexes

    # creation and reading
    def create(self, input_file_id: str, endpoint: str, completion_window: str, window_s: int,
               metadata: dict[str, Any] | None, owner: str = OWNER_ANONYMOUS,
               schedule: str | None = None) -> dict[str, Any]:
        now = int(time.time())
        bid = new_batch_id()
        fields: dict[str, Any] = {
            "id": bid, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
            "completion_window": completion_window, "status": "validating", "output_file_id": None,
            "error_file_id": None, "created_at": now, "in_progress_at": None, "expires_at": now + window_s,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None, "metadata": metadata, "model": None, "owner": owner,
            "schedule": schedule, "final_status": None,
        }
        fields.update({c: 0 for c in COUNTERS})
        pipe = self.r.pipeline()
        pipe.hset(batch_key(bid), mapping={k: json.dumps(v) for k, v in fields.items()})
        pipe.zadd(owner_batches_key(owner), {bid: self.r.incr(BATCH_SEQ_KEY)})
        pipe.sadd(BATCH_ACTIVE_KEY, bid)
        pipe.execute()
        return self.get(bid)  # type: ignore[return-value]

    def get(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """The stored fields (decoded), or None; `owner` given: None unless it owns the batch."""
        if not is_batch_id(batch_id):
            return None
        raw = self.r.hgetall(batch_key(batch_id))
        if not raw:
            return None
        d = {as_str(k): json.loads(v) for k, v in raw.items()}
        if owner is not None and d.get("owner") != owner:
            return None
        return d

    def status(self, batch_id: str) -> str | None:
        raw = self.r.hget(batch_key(batch_id), "status")
        return json.loads(raw) if raw else None

    def list(self, owner: str, after: str | None = None, limit: int = 20) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, after the batch id `after`; returns (page, has_more)."""
        return owner_page(self.r, owner_batches_key(owner), batch_key, owner, after, limit)

    def active_ids(self) -> list[str]:
        return [as_str(b) for b in self.r.smembers(BATCH_ACTIVE_KEY)]

    def active_reading(self, file_id: str) -> str | None:
        """An unfinished batch whose input is `file_id`, or None: the file must stay while it may be read (a
        driver taking the batch over derives its lines from it again)."""
        return self.active_inputs().get(file_id)

    def active_inputs(self) -> dict[str, str]:
        """The input files of the unfinished batches -> one batch reading each, in one round trip."""
        ids = self.active_ids()
        if not ids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for bid in ids:
            pipe.hget(batch_key(bid), "input_file_id")
        return {json.loads(raw): bid for bid, raw in zip(ids, pipe.execute(), strict=True) if raw is not None}

    # status changes
    def transition(self, batch_id: str, from_states: Iterable[str], to: str,
                   **fields: Any) -> tuple[bool, str | None]:
        """Compare-and-set the status (and set `fields`); returns (changed, status now)."""
        args: list[Any] = [json.dumps(list(from_states)), to, batch_id, len(fields)]
        for k, v in fields.items():
            args += [k, json.dumps(v)]
        ok, st = self._transition(keys=[batch_key(batch_id), BATCH_ACTIVE_KEY, BATCHES_ENDED_KEY], args=args)
        return bool(ok), (as_str(st) if st else None)

    def ended_before(self, t: float, limit: int = 100) -> list[str]:
        """Batches that became final before time `t` (oldest first)."""
        return [as_str(b) for b in self.r.zrangebyscore(BATCHES_ENDED_KEY, "-inf", t, start=0, num=limit)]

    def forget(self, batch_id: str) -> None:
        """Delete a final batch and its results (its files are the file store's: farm.batch.retention)."""
        owner = self.r.hget(batch_key(batch_id), "owner")
        pipe = self.r.pipeline()
        pipe.delete(batch_key(batch_id), batch_results_key(batch_id), batch_kick_key(batch_id),
                    batch_lease_key(batch_id), batch_answered_key(batch_id))
        if owner is not None:
            pipe.zrem(owner_batches_key(json.loads(owner)), batch_id)
        pipe.zrem(BATCHES_ENDED_KEY, batch_id)
        pipe.execute()

    def set_fields(self, batch_id: str, **fields: Any) -> None:
        self.r.hset(batch_key(batch_id), mapping={k: json.dumps(v) for k, v in fields.items()})

    # line results
    def record(self, batch_id: str, custom_id: str, result: dict[str, Any], ok: bool,
               usage: dict[str, int] | None = None) -> int:
        """Record one line's result once; 1 recorded, 0 already recorded, -1 the batch is not running."""
        u = usage or {}
        return int(self._record(keys=[batch_results_key(batch_id), batch_key(batch_id)], args=[
            custom_id, json.dumps(result, separators=(",", ":")), "1" if ok else "0",
            int(u.get("prompt_tokens", 0)), int(u.get("cached_tokens", 0)), int(u.get("completion_tokens", 0))]))

    def keep_answered(self, batch_id: str, answered: dict[str, tuple[str, str | None]]) -> None:
        """Keep the semantic layer's answers to lines at validation (custom_id -> (answer, finish_reason)): a
        guard's refusal stands for every driver, whatever the guards say when another derives the lines again."""
        items = [(cid, json.dumps(list(v))) for cid, v in answered.items()]
        pipe = self.r.pipeline()
        for i in range(0, len(items), 1000):
            pipe.hset(batch_answered_key(batch_id), mapping=dict(items[i:i + 1000]))
        pipe.execute()

    def answered(self, batch_id: str) -> dict[str, tuple[str, str | None]]:
        return {as_str(k): tuple(json.loads(v))  # type: ignore[misc]
                for k, v in self.r.hscan_iter(batch_answered_key(batch_id), count=1000)}

    def recorded_ids(self, batch_id: str) -> set[str]:
        return {as_str(k) for k in self.r.hkeys(batch_results_key(batch_id))}

    def results(self, batch_id: str) -> Iterator[dict[str, Any]]:
        for _k, v in self.r.hscan_iter(batch_results_key(batch_id), count=1000):
            yield json.loads(v)

    # driver lease
    def acquire_lease(self, batch_id: str, token: str, ttl_s: float) -> bool:
        return bool(self.r.set(batch_lease_key(batch_id), token, nx=True, px=int(ttl_s * 1000)))

    def refresh_lease(self, batch_id: str, token: str, ttl_s: float) -> bool:
        return bool(self._refresh(keys=[batch_lease_key(batch_id)], args=[token, int(ttl_s * 1000)]))

    def release_lease(self, batch_id: str, token: str) -> None:
        self._release(keys=[batch_lease_key(batch_id)], args=[token])

    def leased(self, batch_id: str) -> bool:
        return bool(self.r.exists(batch_lease_key(batch_id)))

    def mark_kicked(self, batch_id: str, ttl_s: float, force: bool = False) -> bool:
        """True when the batch should be (re-)sent to the driver queue now."""
        if force:
            self.r.set(batch_kick_key(batch_id), "1", px=int(ttl_s * 1000))
            return True
        return bool(self.r.set(batch_kick_key(batch_id), "1", nx=True, px=int(ttl_s * 1000)))

    # farm-wide in-flight batch lines
    def inflight_add(self, request_id: str, deadline: float) -> None:
        self.r.zadd(BATCH_INFLIGHT_KEY, {request_id: deadline})

    def inflight_remove(self, request_id: str) -> None:
        self.r.zrem(BATCH_INFLIGHT_KEY, request_id)

    def inflight_count(self) -> int:
        now = time.time()
        pipe = self.r.pipeline()
        pipe.zremrangebyscore(BATCH_INFLIGHT_KEY, "-inf", now)
        pipe.zcard(BATCH_INFLIGHT_KEY)
        return int(pipe.execute()[1])


# -- the public objects -----------------------------------------------------------------------------------
_BATCH_FIELDS = ("id", "object", "endpoint", "errors", "input_file_id", "completion_window", "status",
                 "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at",
                 "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")


def public_batch(d: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI batch object from the stored fields."""
    out = {k: d.get(k) for k in _BATCH_FIELDS}
    out["request_counts"] = {"total": int(d.get("total", 0)), "completed": int(d.get("completed", 0)),
                             "failed": int(d.get("failed", 0))}
    out["metadata"] = d.get("metadata")
    out["model"] = d.get("model")
    i, c, o = int(d.get("input_tokens", 0)), int(d.get("cached_tokens", 0)), int(d.get("output_tokens", 0))
    out["usage"] = {"input_tokens": i, "input_tokens_details": {"cached_tokens": c}, "output_tokens": o,
                    "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": i + o}
    return out
