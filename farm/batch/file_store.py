"""Files of the Batch API: metadata in Redis (`farm:file:<id>`, listed in `farm:files`: farm.protocol.keys) and
bodies behind one interface, on disk (`DiskBodies`) or in Redis (`RedisBodies`), chosen by
`batch.files_backend`."""

from __future__ import annotations

import io
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import redis

from farm.batch.store import clean_filename, index_by_owner, is_file_id, new_file_id, owner_page
from farm.batch.upload_room import OwnerQuota, UploadRoom
from farm.config import FarmConfig
from farm.infra.filemodes import open_private, private_dir
from farm.infra.redis_client import as_str
from farm.protocol.keys import (
    BATCH_SEQ_KEY,
    FILE_BYTES_KEY,
    FILES_EXPIRING_KEY,
    FILES_KEY,
    file_body_key,
    file_key,
    file_upload_key,
    owner_file_bytes_key,
    owner_files_key,
)
from farm.tenancy.api_keys import OWNER_ANONYMOUS

# -- files ------------------------------------------------------------------------------------------------
UPLOAD_EXPIRY_PURPOSES = ("batch",)  # a client's uploads; the farm's output files go with their batch (retention)
CHUNK_BYTES = 1 << 20  # bodies are streamed in and out in pieces of this size


class FileStorageFull(Exception):
    """An upload would take the Redis file storage past `batch.files_redis_max_mb`."""


def _within(chunks: Iterable[bytes], room: int, full: Exception) -> Iterator[bytes]:
    """The chunks, refused (`full` raised) as soon as they pass `room` bytes: nothing past it is stored."""
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > room:
            raise full
        yield chunk


def _chunks(src: IO[bytes] | bytes | Iterable[bytes]) -> Iterator[bytes]:
    if isinstance(src, bytes):
        for i in range(0, len(src), CHUNK_BYTES):
            yield src[i:i + CHUNK_BYTES]
    elif hasattr(src, "read"):
        yield from iter(lambda: src.read(CHUNK_BYTES), b"")  # type: ignore[union-attr]
    else:
        yield from src


class DiskBodies:
    """File bodies as files under `root` (written to a temp name, then renamed). Every API replica and batch
    driver must see the same directory: one machine, or a shared (ReadWriteMany) volume. They are tenants'
    prompts and answers: the directory is 0700 and every body 0600, whatever the process's umask."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, file_id: str) -> Path:
        if not is_file_id(file_id):
            raise ValueError(f"bad file id {file_id!r}")
        return self.root / file_id

    def write(self, file_id: str, chunks: Iterable[bytes], capped: bool) -> int:
        private_dir(self.root)
        dest = self.path(file_id)
        tmp = dest.with_name(f".{file_id}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
        size = 0
        try:
            with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    def open(self, file_id: str) -> IO[bytes]:
        return open(self.path(file_id), "rb")

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)


# KEYS: the upload's temp key, the body key, FILE_BYTES_KEY. ARGV: cap in bytes (0: none). Moves a finished
# upload into place and keeps the total; -1 (and the upload dropped) when it would pass the cap.
_COMMIT_BODY = """
local size = redis.call('STRLEN', KEYS[1])
local old = redis.call('STRLEN', KEYS[2])
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local cap = tonumber(ARGV[1])
if cap > 0 and used - old + size > cap then
  redis.call('DEL', KEYS[1])
  return -1
end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('PERSIST', KEYS[2])
redis.call('INCRBY', KEYS[3], size - old)
return size
"""

# KEYS: the body key, FILE_BYTES_KEY.
_DELETE_BODY = """
local size = redis.call('STRLEN', KEYS[1])
redis.call('DEL', KEYS[1])
if size > 0 then redis.call('DECRBY', KEYS[2], size) end
return size
"""


class _RedisBodyReader(io.RawIOBase):
    """A body in Redis read in ranges (GETRANGE), so a download never holds the whole file in memory."""

    def __init__(self, r: redis.Redis, key: str, size: int):
        self.r, self.key, self.size, self.pos = r, key, size, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:  # noqa: ANN001 - a writable buffer
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        data = self.r.getrange(self.key, self.pos, self.pos + n - 1)
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)


class RedisBodies:
    """File bodies as Redis strings (`farm:file:<id>:body`), so every API replica and batch driver sees them
    with nothing shared but Redis. They take Redis memory: uploads that would take all bodies together past
    `max_bytes` are refused (FileStorageFull); a batch's output files are always stored (accepted work)."""

    def __init__(self, r: redis.Redis, max_bytes: int):
        self.r, self.max_bytes = r, max_bytes
        self._commit = r.register_script(_COMMIT_BODY)
        self._delete = r.register_script(_DELETE_BODY)

    @staticmethod
    def key(file_id: str) -> str:
        if not is_file_id(file_id):
            raise ValueError(f"bad file id {file_id!r}")
        return file_body_key(file_id)

    def used(self) -> int:
        return int(self.r.get(FILE_BYTES_KEY) or 0)

    def write(self, file_id: str, chunks: Iterable[bytes], capped: bool) -> int:
        body = self.key(file_id)
        tmp = file_upload_key(file_id, uuid.uuid4().hex[:12])
        if capped:
            chunks = _within(chunks, self.max_bytes - self.used(), FileStorageFull(self._full_message()))
        self.r.set(tmp, b"", ex=3600)  # an upload cut off half-way expires on its own
        size = 0
        try:
            for chunk in chunks:
                size += len(chunk)
                pipe = self.r.pipeline(transaction=False)
                pipe.append(tmp, chunk)
                pipe.expire(tmp, 3600)
                pipe.execute()
            if int(self._commit(keys=[tmp, body, FILE_BYTES_KEY], args=[self.max_bytes if capped else 0])) < 0:
                raise FileStorageFull(self._full_message())
        except BaseException:
            self.r.delete(tmp)
            raise
        return size

    def _full_message(self) -> str:
        return (f"the farm's file storage (Redis, batch.files_redis_max_mb = {self.max_bytes >> 20} MB) has no "
                "room for this file; delete files you no longer need (DELETE /v1/files/{id})")

    def open(self, file_id: str) -> IO[bytes]:
        key = self.key(file_id)
        size = self.r.strlen(key)
        if not size and not self.r.exists(key):
            raise FileNotFoundError(file_id)
        return io.BufferedReader(_RedisBodyReader(self.r, key, size), buffer_size=CHUNK_BYTES)

    def delete(self, file_id: str) -> None:
        self._delete(keys=[self.key(file_id), FILE_BYTES_KEY])


class FileStore:
    """Files: metadata in Redis (`farm:file:<id>`), bodies in `bodies` (DiskBodies or RedisBodies, chosen by
    `batch.files_backend`: `from_config`). Uploads (purpose `batch`) count against the Redis backend's cap."""

    def __init__(self, r: redis.Redis, root: Path | None = None, bodies: DiskBodies | RedisBodies | None = None):
        self.r = r
        if bodies is None:
            if root is None:
                raise ValueError("FileStore needs a directory or a body store")
            bodies = DiskBodies(root)
        self.bodies = bodies
        index_by_owner(r, FILES_KEY, file_key, owner_files_key, owner_file_bytes_key)  # a farm of before owner indexes

    @classmethod
    def from_config(cls, r: redis.Redis, cfg: FarmConfig) -> FileStore:
        """The file store `cfg.batch` describes (every API process and batch driver builds the same)."""
        if cfg.batch.files_backend == "redis":
            return cls(r, bodies=RedisBodies(r, cfg.batch.files_redis_max_mb << 20))
        return cls(r, bodies=DiskBodies(cfg.files_path))

    def create(self, src: IO[bytes] | bytes | Iterable[bytes], filename: str, purpose: str,
               owner: str = OWNER_ANONYMOUS, file_id: str | None = None,
               expires_at: int | None = None, quota: OwnerQuota | None = None) -> dict[str, Any]:
        """Store a body (bytes, a binary stream, or chunks) and its metadata; returns the metadata.
        With `file_id` given the file is replaced (a finalizing batch rewriting its output). `expires_at`: when
        the retention sweep deletes it (a batch's output and error files), shown to clients as OpenAI does.
        `quota` (a client's upload): FileQuotaExceeded once the owner's files, with its other uploads under way,
        would pass it, checked as the body streams in (farm.batch.upload_room)."""
        chunks = _chunks(src)
        room = None
        if quota is not None:
            room = UploadRoom(self.r, owner, quota)
            room.enter()
            chunks = room.within(chunks)
        try:
            replaced = self.r.hget(file_key(file_id), "bytes") if file_id else None
            file_id = file_id or new_file_id()
            size = self.bodies.write(file_id, chunks, capped=purpose == "batch")
            meta = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
                    "filename": clean_filename(filename), "purpose": purpose, "owner": owner, "status": "processed",
                    "expires_at": expires_at, "status_details": None}
            pipe = self.r.pipeline()
            pipe.hset(file_key(file_id), mapping={k: json.dumps(v) for k, v in meta.items()})
            pipe.zadd(owner_files_key(owner), {file_id: self.r.incr(BATCH_SEQ_KEY)})
            if expires_at is not None and purpose in UPLOAD_EXPIRY_PURPOSES:  # the retention sweep deletes it then
                pipe.zadd(FILES_EXPIRING_KEY, {file_id: expires_at})
            pipe.incrby(owner_file_bytes_key(owner), size - (int(json.loads(replaced)) if replaced else 0))
            if room is not None:
                room.leave(pipe)  # with the file's own counts: its bytes now count in the owner's files
            pipe.execute()
        except BaseException:
            if room is not None:
                room.leave()  # refused or failed: nothing of it is kept
            raise
        return meta

    def usage(self, owner: str) -> tuple[int, int]:
        """(bytes, files) an owner's files hold."""
        pipe = self.r.pipeline()
        pipe.get(owner_file_bytes_key(owner))
        pipe.zcard(owner_files_key(owner))
        used, count = pipe.execute()
        return int(used or 0), int(count)

    def get(self, file_id: str, owner: str | None = None) -> dict[str, Any] | None:
        if not is_file_id(file_id):
            return None
        raw = self.r.hgetall(file_key(file_id))
        if not raw:
            return None
        meta = {as_str(k): json.loads(v) for k, v in raw.items()}
        if owner is not None and meta.get("owner") != owner:
            return None
        return meta

    def open(self, file_id: str) -> IO[bytes]:
        """The body as a binary stream; FileNotFoundError when it is gone."""
        return self.bodies.open(file_id)

    def read(self, file_id: str) -> bytes:
        with self.open(file_id) as f:
            return f.read()

    def delete(self, file_id: str) -> bool:
        owner, size = self.r.hmget(file_key(file_id), ["owner", "bytes"])
        pipe = self.r.pipeline()
        pipe.delete(file_key(file_id))
        if owner is not None:
            who = json.loads(owner)
            pipe.zrem(owner_files_key(who), file_id)
            pipe.decrby(owner_file_bytes_key(who), int(json.loads(size or b"0")))
        pipe.zrem(FILES_EXPIRING_KEY, file_id)
        existed = bool(pipe.execute()[0])
        self.bodies.delete(file_id)
        return existed

    def expired(self, now: float, start: int = 0, limit: int = 500) -> list[str]:
        """Uploads whose `expires_after` has passed, oldest first, from the `start`-th."""
        return [as_str(x) for x in self.r.zrangebyscore(FILES_EXPIRING_KEY, "-inf", now, start=start, num=limit)]

    def list(self, owner: str, purpose: str | None = None, after: str | None = None,
             limit: int = 100, oldest_first: bool = False) -> tuple[list[dict[str, Any]], bool]:
        """Newest first (OpenAI's `order=desc`, its default) or oldest first; returns (page, has_more)."""
        return owner_page(self.r, owner_files_key(owner), file_key, owner, after, limit,
                          keep=lambda m: purpose is None or m.get("purpose") == purpose, oldest_first=oldest_first)


_FILE_FIELDS = ("id", "object", "bytes", "created_at", "filename", "purpose", "status", "expires_at",
                "status_details")


def public_file(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta.get(k) for k in _FILE_FIELDS}
