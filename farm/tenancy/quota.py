"""Per-key request-rate limits and token quotas, counted in Redis so every API replica shares them.

Both are FIXED windows aligned to multiples of their length since the epoch (requests: 60 s; tokens:
`api.limits.token_quota_window_s`), one counter key per owner and window that expires with it. Fixed
windows cost one key and one round trip per request (a Lua script: check the token quota, then count
the request) at the price of allowing up to 2x the rate across a window boundary; that is the usual
trade for an admission limit. A request refused by the limit is not counted.

Tokens are reserved before a generation is queued and settled when it ends (`reserve` / `Reservation.settle`):
the reservation is the most the request can use (its prompt plus `n` times `max_tokens`), or what is left of the
quota when that is less (the caller then lowers `max_tokens` to fit), and a request that cannot get even its
prompt and one token per choice is refused. So concurrent requests, many choices or clients that close their
stream early can never take a key past its quota; at the end the unused part is given back, and a stream closed
early is charged for its prompt and the tokens it received. A process that dies with a reservation open leaves
it charged (the safe side).

A key configured with its own `requests_per_minute` / `token_quota` (config.ApiKeyEntry) uses those
instead of `api.limits`; the windows are the same for every key.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from farm.config import ApiKeyEntry, ApiLimitsConfig
from farm.protocol.keys import rate_key

RATE_WINDOW_S = 60

# KEYS[1] request counter, KEYS[2] token counter
# ARGV: request limit, request-window ttl, token quota (0 = none), requests to count
# -> {0} admitted | {1} rate limited | {2} quota spent
_ADMIT = """
local quota = tonumber(ARGV[3])
if quota > 0 then
  local used = tonumber(redis.call('GET', KEYS[2]) or '0')
  if used >= quota then return {2, used} end
end
local limit, count = tonumber(ARGV[1]), tonumber(ARGV[4])
if limit > 0 then
  local n = redis.call('INCRBY', KEYS[1], count)
  if n == count then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
  if n > limit then
    redis.call('DECRBY', KEYS[1], count)
    return {1, n - count}
  end
end
return {0, 0}
"""


# KEYS[1] token counter; ARGV: quota, tokens wanted, the least that will do, expiry (epoch s)
# -> {0, reserved} (the wanted tokens, or what is left when that is less) | {1, used} refused
_RESERVE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local left = tonumber(ARGV[1]) - used
if left < tonumber(ARGV[3]) then return {1, used} end
local take = math.min(tonumber(ARGV[2]), left)
redis.call('INCRBY', KEYS[1], take)
redis.call('EXPIREAT', KEYS[1], ARGV[4])
return {0, take}
"""


# KEYS[1] a counter; ARGV[1] the change. A window that ended meanwhile has nothing left to change: INCRBY would
# create its key again, with no expiry.
_ADJUST = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('INCRBY', KEYS[1], ARGV[1]) end
return 0
"""


@dataclass
class Refusal:
    """Why a request was refused: `kind` is "rate" (requests per minute) or "quota" (tokens)."""

    kind: str
    limit: int
    used: int
    retry_after_s: int


@dataclass
class Reservation:
    """Tokens held against an owner's quota for one request; `settle` once with what the request really used."""

    limiter: Limiter | None
    key: str = ""
    tokens: int = 0
    settled: bool = False

    def settle(self, used: int) -> None:
        """Give back what the request did not use (or charge what it used beyond the reservation); once."""
        if self.settled or self.limiter is None:
            return
        self.settled = True
        delta = int(used) - self.tokens
        if delta:
            try:
                self.limiter.adjust(self.key, delta)
            except redis.RedisError:
                pass  # the reservation stays charged: the safe side



class Limiter:
    """Admission (`admit`) and charging (`charge`) against one farm's limits."""

    def __init__(self, r: redis.Redis, limits: ApiLimitsConfig, overrides: Mapping[str, ApiKeyEntry] | None = None):
        self.r = r
        self.limits = limits
        self.overrides = dict(overrides or {})  # owner id -> that key's own limits
        self._admit = r.register_script(_ADMIT)
        self._reserve = r.register_script(_RESERVE)
        self._adjust = r.register_script(_ADJUST)

    def adjust(self, key: str, delta: int) -> None:
        """Change a window's counter, unless that window has ended (its key expired)."""
        self._adjust(keys=[key], args=[int(delta)])

    def limits_of(self, owner: str) -> tuple[int, int]:
        """(requests per minute, token quota) of `owner`; 0 = unlimited."""
        o = self.overrides.get(owner)
        rpm = o.requests_per_minute if o is not None and o.requests_per_minute is not None else None
        quota = o.token_quota if o is not None and o.token_quota is not None else None
        return (self.limits.requests_per_minute if rpm is None else rpm,
                self.limits.token_quota if quota is None else quota)

    def quota_of(self, owner: str) -> int:
        return self.limits_of(owner)[1]

    @property
    def enabled(self) -> bool:
        return any((self.limits.requests_per_minute, self.limits.token_quota,
                    *(self.limits_of(o) != (0, 0) for o in self.overrides)))

    def _keys(self, owner: str, now: float) -> tuple[str, str, float, float]:
        tw = self.limits.token_quota_window_s
        rate_idx, tok_idx = int(now // RATE_WINDOW_S), int(now // tw)
        rate_end, tok_end = (rate_idx + 1) * RATE_WINDOW_S, (tok_idx + 1) * tw
        return rate_key("req", owner, rate_idx), rate_key("tok", owner, tok_idx), rate_end, tok_end

    def admit(self, owner: str, check_quota: bool = True, now: float | None = None, count: int = 1) -> Refusal | None:
        """Count `count` requests of `owner` (a batch of texts counts each); a Refusal (nothing counted) when a
        limit is reached."""
        rpm, quota = self.limits_of(owner)
        if not (rpm or quota):
            return None
        now = time.time() if now is None else now
        req_key, tok_key, rate_end, tok_end = self._keys(owner, now)
        code, used = self._admit(keys=[req_key, tok_key],
                                 args=[rpm, RATE_WINDOW_S + 1, quota if check_quota else 0, max(1, int(count))])
        if code == 1:
            return Refusal("rate", rpm, int(used), max(1, math.ceil(rate_end - now)))
        if code == 2:
            return Refusal("quota", quota, int(used), max(1, math.ceil(tok_end - now)))
        return None

    def uncount(self, owner: str, count: int, now: float | None = None) -> None:
        """Give back `count` requests counted in the current window (a batch refused after its first was counted)."""
        if self.limits_of(owner)[0] and count > 0:
            self.adjust(self._keys(owner, time.time() if now is None else now)[0], -int(count))

    def charge(self, owner: str, tokens: int, now: float | None = None) -> None:
        """Add `tokens` to the owner's usage in the current token window."""
        if not self.quota_of(owner) or tokens <= 0:
            return
        now = time.time() if now is None else now
        _, tok_key, _, tok_end = self._keys(owner, now)
        p = self.r.pipeline()
        p.incrby(tok_key, int(tokens))
        p.expireat(tok_key, int(tok_end) + 1)
        p.execute()

    def reserve(self, owner: str, tokens: int, least: int | None = None,
                now: float | None = None) -> Reservation | Refusal:
        """Hold `tokens` of `owner`'s quota for one request, or all that is left when that is less but at least
        `least` (default: all of `tokens`); a Refusal when not even `least` is left. With no quota, a
        reservation of `tokens` that settles nothing."""
        quota = self.quota_of(owner)
        if not quota:
            return Reservation(None, tokens=int(tokens))
        now = time.time() if now is None else now
        _, tok_key, _, tok_end = self._keys(owner, now)
        code, n = self._reserve(keys=[tok_key], args=[quota, int(tokens), int(tokens if least is None else least),
                                                      int(tok_end) + 1])
        if code == 1:
            return Refusal("quota", quota, int(n), max(1, math.ceil(tok_end - now)))
        return Reservation(self, tok_key, int(n))

    def used_tokens(self, owner: str, now: float | None = None) -> int:
        _, tok_key, _, _ = self._keys(owner, time.time() if now is None else now)
        return int(self.r.get(tok_key) or 0)
