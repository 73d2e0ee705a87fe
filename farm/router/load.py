"""Active load per worker, in Redis, so every API replica sees the same load, and a copy in each process.

Two kinds: `p` = prompt tokens placed on a worker and not yet prefilled, `d` = KV blocks of requests
decoding on a worker. A router adds load when it places a request, moves it from `p` to `d` when the
prefill is done, and removes it at the end. Each contribution is recorded per request (a zset member per
worker and kind) and the sums are kept in one hash, so one HGETALL reads the whole farm's load. Updates
are Lua scripts: idempotent (ending twice subtracts once) and atomic, and each change is also appended to
the stream `farm:load:events`. Every contribution has a deadline; `reap` ends expired ones, so an API
process that died mid-request cannot leak load forever.

A router decides without a round trip: `LoadMirror` is this process's copy of the hash, fed by the
stream (IndexFollower reads it with the KV events) and reset from the hash about every second (one
transaction reads the hash and the stream's last id together, so the two agree). The process's own
changes count at once: a placement before its script even runs (two requests placed at the same moment
in one process never both see an idle worker), an end when its script returns; each is tagged in the
stream with this process's origin and a sequence number, so reading it back never counts it twice.

On the request path the scripts need not run before the request goes on: with a `PipelineBatcher`, `begin_soon`
and `end_soon` count the change in the mirror at once (an end whose amount this process does not know: when
its script returns) and queue the script, which runs with the other requests' of the next few milliseconds in one round trip.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import Any

import redis

from farm.infra.redis_batch import Job, PipelineBatcher
from farm.protocol.keys import (
    DEADLINES_KEY,
    LOAD_EVENTS_KEEP_S,
    LOAD_EVENTS_MAXLEN,
    LOAD_EVENTS_STREAM,
    LOAD_KEY,
    active_key,
    stream_min_id,
)

# Both scripts return the id of the stream entry that records the change (END: with the amount ended), or 0
# when nothing changed. Stream entries: f = "<worker>|<kind>", a = amount, n = +-1 request, o/k = the
# writing process's origin and sequence number (its mirror's own bookkeeping).
_BEGIN = """
local amount = tonumber(ARGV[2])
if redis.call('ZADD', KEYS[1], 'NX', amount, ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], amount)
  redis.call('HINCRBY', KEYS[2], ARGV[3] .. 'n', 1)
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[5])
  local id = redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'f', ARGV[3], 'a', amount, 'n', 1,
                        'o', ARGV[7], 'k', ARGV[8])
  redis.call('XTRIM', KEYS[4], 'MINID', '~', ARGV[9])
  return id
end
return 0
"""

_END = """
local amount = redis.call('ZSCORE', KEYS[1], ARGV[1])
if amount then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HINCRBY', KEYS[2], ARGV[2], -tonumber(amount))
  redis.call('HINCRBY', KEYS[2], ARGV[2] .. 'n', -1)
  redis.call('ZREM', KEYS[3], ARGV[3])
  local id = redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'f', ARGV[2], 'a', -tonumber(amount),
                        'n', -1, 'o', ARGV[5], 'k', ARGV[6])
  redis.call('XTRIM', KEYS[4], 'MINID', '~', ARGV[7])
  return {id, amount}
end
return 0
"""

Loads = dict[str, dict[str, int]]
MAX_REMEMBERED = 100_000  # begun contributions whose amount end_soon may take off the mirror at once


def empty_load() -> dict[str, int]:
    return {"p": 0, "pn": 0, "d": 0, "dn": 0}


def stream_id(raw: bytes | str) -> tuple[int, int]:
    s = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


def parse_loads(raw: dict) -> Loads:
    """The load hash as {worker: {"p", "pn", "d", "dn"}}."""
    out: Loads = {}
    for field, value in raw.items():
        w, _, kind = (field.decode() if isinstance(field, bytes) else field).rpartition("|")
        out.setdefault(w, empty_load())[kind] = int(value)
    return out


def _clamped(ld: dict[str, int]) -> dict[str, int]:
    return {k: max(0, v) for k, v in ld.items()}


def _text(fields: dict, key: str) -> str:
    v = fields.get(key.encode(), fields.get(key))
    return v.decode() if isinstance(v, bytes) else str(v)


class LoadMirror:
    """This process's copy of the farm's load: the hash as of stream entry `position`, plus this process's
    own changes not yet seen there (`_own`, by sequence number: [field, amount, n, entry id or None while
    its script runs])."""

    def __init__(self, stale_s: float = 3.0):
        self.stale_s = stale_s  # without word from Redis for this long, readers go to Redis themselves
        self.origin = uuid.uuid4().hex[:12]
        self._raw: Loads = {}  # sums as applied (a reset can briefly make one negative)
        self._view: Loads = {}  # the same, clamped at 0, one new dict per change
        self._own: dict[int, list] = {}
        self._seq = itertools.count(1)
        self.position: tuple[int, int] | None = None  # None: never reset from Redis
        self.heard_at = 0.0
        self._lock = threading.Lock()

    @property
    def live(self) -> bool:
        return self.position is not None and time.monotonic() - self.heard_at < self.stale_s

    def _add(self, field: str, amount: int, n: int) -> None:
        w, _, kind = field.rpartition("|")
        raw = self._raw.get(w)
        if raw is None:
            raw = self._raw[w] = empty_load()
        raw[kind] = raw.get(kind, 0) + amount
        raw[kind + "n"] = raw.get(kind + "n", 0) + n
        self._view[w] = _clamped(raw)  # a new dict: a view handed out earlier never changes

    def reset(self, raw_hash: dict, last_id: bytes | str | None) -> None:
        """The hash and the stream's last entry id, read in one transaction. Own changes in the hash already
        are dropped; those whose script has not returned yet stay counted until it does (`settle`)."""
        pos = stream_id(last_id) if last_id else (0, 0)
        with self._lock:
            self._raw = parse_loads(raw_hash)
            self._view = {w: _clamped(ld) for w, ld in self._raw.items()}
            self._own = {k: c for k, c in self._own.items() if c[3] is None or c[3] > pos}
            for field, amount, n, _ in self._own.values():
                self._add(field, amount, n)
            self.position = pos
            self.heard_at = time.monotonic()

    def apply(self, entry_id: bytes | str, fields: dict) -> None:
        """One stream entry, in stream order (the follower's)."""
        i = stream_id(entry_id)
        with self._lock:
            if self.position is None or i <= self.position:
                return
            self.position = i
            if _text(fields, "o") == self.origin and self._own.pop(int(_text(fields, "k")), None) is not None:
                return  # this process's own change, counted already
            self._add(_text(fields, "f"), int(_text(fields, "a")), int(_text(fields, "n")))

    def heard(self) -> None:
        self.heard_at = time.monotonic()

    def next_seq(self) -> int:
        return next(self._seq)

    def expect(self, field: str, amount: int, n: int) -> int:
        """A change this process is about to make: counted now; returns its sequence number for `settle`."""
        k = self.next_seq()
        with self._lock:
            self._own[k] = [field, amount, n, None]
            self._add(field, amount, n)
        return k

    def settle(self, k: int, entry_id: bytes | str | None, field: str = "", amount: int = 0, n: int = 0) -> None:
        """The script of own change `k` returned `entry_id` (None: it changed nothing, or failed). An expected
        change is kept until its entry is read (or dropped, if a reset counted it meanwhile); an unexpected one
        (an end, whose amount only the script knew) is counted now unless its entry was read already."""
        i = stream_id(entry_id) if entry_id else None
        with self._lock:
            change = self._own.get(k)
            if change is None:
                if i is None or self.position is None or i <= self.position:
                    return  # read from the stream already (or nothing happened)
                self._own[k] = [field, amount, n, i]
                self._add(field, amount, n)
            elif i is None or self.position is None or i <= self.position:
                del self._own[k]  # it did not happen, or the last reset counted it
                self._add(change[0], -change[1], -change[2])
            else:
                change[3] = i

    def view(self) -> Loads:
        """The farm's load now (treat as read-only: the per-worker dicts are shared with later views)."""
        with self._lock:
            return dict(self._view)


class LoadTracker:
    def __init__(self, r: redis.Redis, max_request_s: float = 1800, mirror: LoadMirror | None = None,
                 batcher: PipelineBatcher | None = None):
        self.r = r
        self.max_request_s = max_request_s
        self.mirror = mirror
        self.batcher = batcher
        self._begun: dict[tuple[str, str, str], int] = {}  # (kind, worker, request id): amount, by begin_soon
        self._begin = r.register_script(_BEGIN)
        self._end = r.register_script(_END)

    def begin(self, kind: str, worker: str, request_id: str, amount: int) -> None:
        self.begin_many([(kind, worker, request_id, amount)])

    def begin_many(self, contributions: list[tuple[str, str, str, int]]) -> None:
        """`begin` for several (kind, worker, request id, amount) in one round trip (a placement's prefill and
        decode load)."""
        m = self.mirror
        pipe = self.r.pipeline(transaction=False)
        seqs = []
        for kind, worker, request_id, amount in contributions:
            seqs.append(m.expect(f"{worker}|{kind}", int(amount), 1) if m is not None else 0)
            keys, args = self._begin_args(kind, worker, request_id, amount, seqs[-1])
            self._begin(keys=keys, args=args, client=pipe)
        entries: list = [None] * len(seqs)
        try:
            entries = pipe.execute()
        finally:
            if m is not None:
                for k, entry in zip(seqs, entries, strict=True):
                    m.settle(k, entry or None)

    def _begin_args(self, kind: str, worker: str, request_id: str, amount: int, k: int) -> tuple[list, list]:
        field = f"{worker}|{kind}"
        m = self.mirror
        return ([active_key(kind, worker), LOAD_KEY, DEADLINES_KEY, LOAD_EVENTS_STREAM],
                [request_id, int(amount), field, time.time() + self.max_request_s, f"{kind}|{worker}|{request_id}",
                 LOAD_EVENTS_MAXLEN, m.origin if m else "", k, stream_min_id(LOAD_EVENTS_KEEP_S)])

    def begin_soon(self, contributions: list[tuple[str, str, str, int]]) -> None:
        """`begin_many` without waiting: counted in the mirror now, the scripts queued on the batcher."""
        if self.batcher is None:
            self.begin_many(contributions)
            return
        m = self.mirror
        calls = []
        for kind, worker, request_id, amount in contributions:
            k = m.expect(f"{worker}|{kind}", int(amount), 1) if m is not None else 0
            calls.append((k, *self._begin_args(kind, worker, request_id, amount, k)))
            if len(self._begun) < MAX_REMEMBERED:
                self._begun[(kind, worker, request_id)] = int(amount)

        def add(pipe: redis.client.Pipeline) -> int:
            for _k, keys, args in calls:  # EVALSHA itself: a Script in a pipeline asks SCRIPT EXISTS each time
                pipe.evalsha(self._begin.sha, len(keys), *keys, *args)
            return len(calls)

        def done(replies: list | None) -> None:
            for i, (k, keys, args) in enumerate(calls):
                entry = replies[i] if replies else None
                if isinstance(entry, redis.exceptions.NoScriptError):  # Redis restarted: load it and run it now
                    entry = self._run_now(self._begin, keys, args)
                if isinstance(entry, Exception):
                    entry = None
                if m is not None:
                    m.settle(k, entry or None)

        self.batcher.submit(Job(add, done))

    def end_soon(self, kind: str, worker: str, request_id: str) -> None:
        """`end` without waiting: the script queued on the batcher. A contribution this process began with
        `begin_soon` is taken off the mirror at once (a client's next request, sent the moment this one ended,
        sees the worker as free as it is); another one when the script returns with its amount."""
        if self.batcher is None:
            self.end(kind, worker, request_id)
            return
        field, m = f"{worker}|{kind}", self.mirror
        amount_begun = self._begun.pop((kind, worker, request_id), None)
        known = m is not None and amount_begun is not None
        k = (m.expect(field, -amount_begun, -1) if known else m.next_seq()) if m is not None else 0
        keys = [active_key(kind, worker), LOAD_KEY, DEADLINES_KEY, LOAD_EVENTS_STREAM]
        args = [request_id, field, f"{kind}|{worker}|{request_id}", LOAD_EVENTS_MAXLEN, m.origin if m else "", k,
                stream_min_id(LOAD_EVENTS_KEEP_S)]

        def add(pipe: redis.client.Pipeline) -> int:
            pipe.evalsha(self._end.sha, len(keys), *keys, *args)
            return 1

        def done(replies: list | None) -> None:
            ended = replies[0] if replies else None
            if isinstance(ended, redis.exceptions.NoScriptError):
                ended = self._run_now(self._end, keys, args)
            if isinstance(ended, Exception):
                ended = None
            if known:  # counted already: kept until its entry is read, or taken back if nothing ended
                m.settle(k, ended[0] if ended else None)  # type: ignore[union-attr]
            elif m is not None and ended:
                entry, amount = ended
                m.settle(k, entry, field, -int(float(amount)), -1)

        self.batcher.submit(Job(add, done))

    @staticmethod
    def _run_now(script: Any, keys: list, args: list) -> Any:
        try:
            return script(keys=keys, args=args)
        except redis.RedisError:
            return None  # the deadline reaper ends what this left behind

    def end(self, kind: str, worker: str, request_id: str) -> bool:
        member = f"{kind}|{worker}|{request_id}"
        field = f"{worker}|{kind}"
        m = self.mirror
        k = m.next_seq() if m is not None else 0
        ended = self._end(keys=[active_key(kind, worker), LOAD_KEY, DEADLINES_KEY, LOAD_EVENTS_STREAM],
                          args=[request_id, field, member, LOAD_EVENTS_MAXLEN, m.origin if m else "", k,
                                stream_min_id(LOAD_EVENTS_KEEP_S)])
        if not ended:
            return False
        if m is not None:
            entry, amount = ended
            m.settle(k, entry, field, -int(float(amount)), -1)
        return True

    def read(self) -> Loads:
        """The whole farm's load from Redis, in one round trip (the authority)."""
        return {w: _clamped(ld) for w, ld in parse_loads(self.r.hgetall(LOAD_KEY)).items()}

    def loads(self) -> Loads:
        """{worker: {"p": pending prefill tokens, "pn": pending prefill requests, "d": active decode blocks,
        "dn": decoding requests}}: from this process's mirror while it is live, else from Redis."""
        if self.mirror is not None and self.mirror.live:
            return self.mirror.view()
        return self.read()

    def reap(self, now: float | None = None) -> int:
        """End every contribution past its deadline; returns how many."""
        expired = self.r.zrangebyscore(DEADLINES_KEY, "-inf", now if now is not None else time.time())
        for member in expired:
            kind, worker, rid = member.decode().split("|", 2)
            if not self.end(kind, worker, rid):
                self.r.zrem(DEADLINES_KEY, member)
        return len(expired)
