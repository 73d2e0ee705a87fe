"""An owner's uploads under way, counted against its file quota as their bytes arrive.

Checking the quota once before an upload let two uploads at once each take an owner's last room (each saw the
room free), so a key streaming N files together stored N times its share. Each upload now enters (a file of the
owner's `batch.owner_files_max`) and reserves every chunk before it is stored, in one Lua call each, against what
the owner's files hold plus what its other uploads under way have reserved. The reservation is handed back when
the upload ends: stored (its bytes then count in the owner's files) or refused. An API process that dies
mid-upload leaves its reservation until the hash expires (UPLOAD_TTL_S after its last change), as its partial
body does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import redis

from farm.config import FarmConfig
from farm.protocol.keys import owner_file_bytes_key, owner_files_key, owner_uploads_key

UPLOAD_TTL_S = 3600  # as an upload's partial body

# KEYS: the owner's files zset, its uploads hash; ARGV: max files, ttl. 1 entered, 0 no file left.
_ENTER = """
local held = redis.call('ZCARD', KEYS[1]) + tonumber(redis.call('HGET', KEYS[2], 'files') or '0')
if held >= tonumber(ARGV[1]) then return 0 end
redis.call('HINCRBY', KEYS[2], 'files', 1)
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
return 1
"""

# KEYS: the owner's bytes counter, its uploads hash; ARGV: chunk bytes, max bytes, ttl. 1 reserved, 0 no room.
_RESERVE = """
local held = tonumber(redis.call('GET', KEYS[1]) or '0') + tonumber(redis.call('HGET', KEYS[2], 'bytes') or '0')
if held + tonumber(ARGV[1]) > tonumber(ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[2], 'bytes', tonumber(ARGV[1]))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
return 1
"""

# KEYS: the owner's uploads hash; ARGV: bytes reserved. Never below 0 (the hash may have expired meanwhile).
_LEAVE = """
local files = tonumber(redis.call('HGET', KEYS[1], 'files') or '0') - 1
local bytes = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0') - tonumber(ARGV[1])
if files <= 0 and bytes <= 0 then redis.call('DEL', KEYS[1]) return 1 end
redis.call('HSET', KEYS[1], 'files', math.max(files, 0), 'bytes', math.max(bytes, 0))
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
        self.reserved = 0

    def enter(self) -> None:
        """Take one of the owner's files; FileQuotaExceeded when its files and uploads under way hold them all."""
        if not int(self.r.register_script(_ENTER)(keys=[owner_files_key(self.owner), owner_uploads_key(self.owner)],
                                                  args=[self.quota.max_files, UPLOAD_TTL_S])):
            raise FileQuotaExceeded(f"this key holds {self.quota.max_files} files with those being uploaded, the "
                                    "most it may (batch.owner_files_max); delete files you no longer need "
                                    "(DELETE /v1/files/{id})")

    def within(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """The chunks, each reserved before it is passed on; FileQuotaExceeded once one would pass the quota."""
        reserve = self.r.register_script(_RESERVE)
        keys = [owner_file_bytes_key(self.owner), owner_uploads_key(self.owner)]
        for chunk in chunks:
            if chunk and not int(reserve(keys=keys, args=[len(chunk), self.quota.max_bytes, UPLOAD_TTL_S])):
                raise FileQuotaExceeded(f"this key's files would pass {self.quota.max_bytes >> 20} MB "
                                        "(batch.owner_files_max_mb); delete files you no longer need "
                                        "(DELETE /v1/files/{id})")
            self.reserved += len(chunk)
            yield chunk

    def leave(self, pipe: redis.client.Pipeline | None = None) -> None:
        """Hand the reservation back, once per `enter`; in `pipe` when given, so it goes with the stored file's
        own counts."""
        self.r.register_script(_LEAVE)(keys=[owner_uploads_key(self.owner)], args=[self.reserved], client=pipe)
