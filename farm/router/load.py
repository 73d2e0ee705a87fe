"""Active load per worker, in Redis, so every API replica sees the same load.

Two kinds: `p` = prompt tokens placed on a worker and not yet prefilled, `d` = KV blocks of requests
decoding on a worker. A router adds load when it places a request, moves it from `p` to `d` when the
prefill is done, and removes it at the end. Each contribution is recorded per request (a zset member per
worker and kind) and the sums are kept in one hash, so one HGETALL reads the whole farm's load. Updates
are Lua scripts: idempotent (ending twice subtracts once) and atomic. Every contribution has a deadline;
`reap` ends expired ones, so an API process that died mid-request cannot leak load forever.
"""

from __future__ import annotations

import time

import redis

from farm.router.keys import DEADLINES_KEY, LOAD_KEY, active_key

_BEGIN = """
local amount = tonumber(ARGV[2])
if redis.call('ZADD', KEYS[1], 'NX', amount, ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], amount)
  redis.call('HINCRBY', KEYS[2], ARGV[3] .. 'n', 1)
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[5])
end
return 1
"""

_END = """
local amount = redis.call('ZSCORE', KEYS[1], ARGV[1])
if amount then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HINCRBY', KEYS[2], ARGV[2], -tonumber(amount))
  redis.call('HINCRBY', KEYS[2], ARGV[2] .. 'n', -1)
  redis.call('ZREM', KEYS[3], ARGV[3])
  return 1
end
return 0
"""


def empty_load() -> dict[str, int]:
    return {"p": 0, "pn": 0, "d": 0, "dn": 0}


class LoadTracker:
    def __init__(self, r: redis.Redis, max_request_s: float = 1800):
        self.r = r
        self.max_request_s = max_request_s
        self._begin = r.register_script(_BEGIN)
        self._end = r.register_script(_END)

    def begin(self, kind: str, worker: str, request_id: str, amount: int) -> None:
        member = f"{kind}|{worker}|{request_id}"
        self._begin(keys=[active_key(kind, worker), LOAD_KEY, DEADLINES_KEY],
                    args=[request_id, int(amount), f"{worker}|{kind}", time.time() + self.max_request_s, member])

    def end(self, kind: str, worker: str, request_id: str) -> bool:
        member = f"{kind}|{worker}|{request_id}"
        return bool(self._end(keys=[active_key(kind, worker), LOAD_KEY, DEADLINES_KEY],
                              args=[request_id, f"{worker}|{kind}", member]))

    def loads(self) -> dict[str, dict[str, int]]:
        """{worker: {"p": pending prefill tokens, "pn": pending prefill requests, "d": active decode
        blocks, "dn": decoding requests}} for the whole farm, in one round trip."""
        out: dict[str, dict[str, int]] = {}
        for field, value in self.r.hgetall(LOAD_KEY).items():
            w, _, kind = field.decode().rpartition("|")
            out.setdefault(w, empty_load())[kind] = max(0, int(value))
        return out

    def reap(self, now: float | None = None) -> int:
        """End every contribution past its deadline; returns how many."""
        expired = self.r.zrangebyscore(DEADLINES_KEY, "-inf", now if now is not None else time.time())
        for member in expired:
            kind, worker, rid = member.decode().split("|", 2)
            if not self.end(kind, worker, rid):
                self.r.zrem(DEADLINES_KEY, member)
        return len(expired)
