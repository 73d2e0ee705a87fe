"""An owner's uploads under way, counted against its file quota as their bytes arrive.

Checking the quota once before an upload let two uploads at once each take an owner's last room (each saw the
room free), so a key streaming N files together stored N times its share. Each upload now enters (a file of the
owner's `batch.owner_files_max`) and reserves every chunk before it is stored, in one Lua call each, against what
the owner's files hold plus what its other uploads under way have reserved. The reservation is handed back when
the upload ends: stored (its bytes then count in the owner's files) or refused. Each upload's reservation is its
own entry: one left by an API process that died mid-upload (or whose hand-back Redis refused) is dropped
UPLOAD_TTL_S after it last reserved, as its partial body expires, however often the owner uploads meanwhile.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import redis

from farm.config import FarmConfig
from farm.protocol.keys import (
    owner_file_bytes_key,
    owner_files_key,
    owner_upload_bytes_key,
    owner_uploads_key,
)

UPLOAD_TTL_S = 3600  # as an upload's partial body: a reservation not touched for this long is dropped

# Each upload under way is one entry: KEYS[1] a zset upload id -> when it last reserved, KEYS[2] a hash upload id ->
# its bytes. Every call first drops the entries not touched for the TTL (an API process that died mid-upload, or a
# hand-back Redis refused), so a reservation never outlives its upload by more than that, however busy the owner.
_PRUNE = """
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[2]))
for _, id in ipairs(stale) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
end
"""

# KEYS: uploads zset, uploads' bytes hash, the owner's files zset; ARGV: now, ttl, upload id, max files.
# 1 entered, 0 no file left.
_ENTER = _PRUNE + """
if redis.call('ZCARD', KEYS[3]) + redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]), ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], 0)
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
return 1
"""

# KEYS: uploads zset, uploads' bytes hash, the owner's bytes counter; ARGV: now, ttl, upload id, chunk bytes,
# max bytes. 1 reserved, 0 no room.
_RESERVE = _PRUNE + """
local held = tonumber(redis.call('GET', KEYS[3]) or '0')
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do held = held + tonumber(v) end
if held + tonumber(ARGV[4]) > tonumber(ARGV[5]) then return 0 end
redis.call('ZADD', KEYS[1], tonumber(ARGV[1]), ARGV[3])
redis.call('HINCRBY', KEYS[2], ARGV[3], tonumber(ARGV[4]))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
return 1
"""


class FileQuotaExceeded(Exception):
    """An upload would take its owner past `batch.owner_files_max_mb` or `batch.owner_files_max`."""


@dataclass(frozen=True)
class OwnerQuota:
    """What one owner's files may hold: bytes and files (batch.owner_files_max_mb, batch.owner_files_max)."""

    max_bytes: int
    max_files: int

    @classmethod
    def from_config(cls, cfg: FarmConfig) -> OwnerQuota:
        mb = cfg.batch.owner_files_max_mb
        assert mb is not None  # BatchConfig fills in its default for the backend
        return cls(mb << 20, cfg.batch.owner_files_max)


class UploadRoom:
    """One upload's share of its owner's quota: `enter`, stream the body through `within`, then `leave`."""

    def __init__(self, r: redis.Redis, owner: str, quota: OwnerQuota):
        self.r = r
        self.owner = owner
        self.quota = quota
        self.upload_id = uuid.uuid4().hex
        self._keys = [owner_uploads_key(self.owner), owner_upload_bytes_key(self.owner)]

    def enter(self) -> None:
        """Take one of the owner's files; FileQuotaExceeded when its files and uploads under way hold them all."""
        if not int(self.r.register_script(_ENTER)(
                keys=[*self._keys, owner_files_key(self.owner)],
                args=[time.time(), UPLOAD_TTL_S, self.upload_id, self.quota.max_files])):
            raise FileQuotaExceeded(f"this key holds {self.quota.max_files} files with those being uploaded, the "
                                    "most it may (batch.owner_files_max); delete files you no longer need "
                                    "(DELETE /v1/files/{id})")

    def within(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """The chunks, each reserved before it is passed on; FileQuotaExceeded once one would pass the quota."""
        reserve = self.r.register_script(_RESERVE)
        keys = [*self._keys, owner_file_bytes_key(self.owner)]
        for chunk in chunks:
            if chunk and not int(reserve(keys=keys, args=[time.time(), UPLOAD_TTL_S, self.upload_id, len(chunk),
                                                         self.quota.max_bytes])):
                raise FileQuotaExceeded(f"this key's files would pass {self.quota.max_bytes >> 20} MB "
                                        "(batch.owner_files_max_mb); delete files you no longer need "
                                        "(DELETE /v1/files/{id})")
            yield chunk

    def leave(self, pipe: redis.client.Pipeline | None = None) -> None:
        """Hand this upload's reservation back (idempotent); in `pipe` when given, so it goes with the stored
        file's own counts."""
        client = pipe if pipe is not None else self.r
        client.zrem(self._keys[0], self.upload_id)
        client.hdel(self._keys[1], self.upload_id)
