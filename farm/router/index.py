"""The router's local view of the KV-block index, following the workers' event stream.

`KVIndex` maps each block hash to a bitmask of the workers holding it, so the overlap of a request's
hash chain with every worker is one pass over the chain (a few microseconds per block). `IndexFollower`
keeps it current: it snapshots every worker's block set from Redis (consistent with that worker's last
event id), then applies the shared stream, skipping events already in the snapshot and resyncing a
worker whose event ids show a gap. Workers whose heartbeat expired are dropped, and their Redis state is
deleted, so a dead worker leaves the index within seconds. The same follower keeps the process's load
mirror (farm.router.load) current.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis

from farm.cluster import registry
from farm.protocol.keys import (
    EVENTS_STREAM,
    LOAD_EVENTS_STREAM,
    LOAD_KEY,
    active_key,
    alive_key,
    worker_blocks_key,
    worker_seq_key,
)
from farm.protocol.kv_events import KVEvent, KVEventKind
from farm.router.load import LoadMirror

log = logging.getLogger(__name__)


TIER_BITS = {"device": 1, "host": 2, "disk": 4}


def member(h: int, tier: str) -> str:
    """How a block is kept in a worker's Redis snapshot set: `hash` on the device, `hash@tier` below."""
    return str(h) if tier == "device" else f"{h}@{tier}"


def parse_member(m: bytes | str) -> tuple[int, str]:
    s = m.decode() if isinstance(m, bytes) else m
    h, _, tier = s.partition("@")
    return int(h), tier or "device"


class KVIndex:
    """hash -> bitmask of workers holding it in any tier; per worker, hash -> bitmask of tiers.
    Thread-safe for one writer and many readers (GIL-atomic updates)."""

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.worker_bits: dict[str, int] = {}
        self.bit_workers: dict[int, str] = {}
        self.worker_blocks: dict[str, dict[int, int]] = {}
        self.last_event: dict[str, int] = {}
        self.epochs: dict[str, int] = {}
        self.events_applied = 0
        self._lock = threading.Lock()

    def _bit(self, worker: str) -> int:
        b = self.worker_bits.get(worker)
        if b is None:
            used = set(self.worker_bits.values())
            b = next(i for i in range(len(used) + 1) if i not in used)
            self.worker_bits[worker] = b
            self.bit_workers[b] = worker
            self.worker_blocks[worker] = {}
        return b

    def store(self, worker: str, hashes: Iterable[int], tier: str = "device") -> None:
        bit = 1 << self._bit(worker)
        tbit = TIER_BITS.get(tier, 1)
        mine = self.worker_blocks[worker]
        blocks = self.blocks
        for h in hashes:
            blocks[h] = blocks.get(h, 0) | bit
            mine[h] = mine.get(h, 0) | tbit

    def remove(self, worker: str, hashes: Iterable[int], tier: str | None = "device") -> None:
        """Remove blocks from one tier of a worker (every tier when `tier` is None)."""
        b = self.worker_bits.get(worker)
        if b is None:
            return
        mask = ~(1 << b)
        keep = 0 if tier is None else ~TIER_BITS.get(tier, 1)
        mine = self.worker_blocks[worker]
        blocks = self.blocks
        for h in hashes:
            tiers = mine.get(h)
            if tiers is None:
                continue
            tiers &= keep
            if tiers:
                mine[h] = tiers
                continue
            del mine[h]
            v = blocks.get(h, 0) & mask
            if v:
                blocks[h] = v
            else:
                blocks.pop(h, None)

    def clear_worker(self, worker: str) -> None:
        with self._lock:
            if worker in self.worker_blocks:
                self.remove(worker, list(self.worker_blocks[worker]), tier=None)

    def drop_worker(self, worker: str) -> None:
        with self._lock:
            if worker in self.worker_blocks:
                self.remove(worker, list(self.worker_blocks[worker]), tier=None)
                b = self.worker_bits.pop(worker)
                self.bit_workers.pop(b, None)
                self.worker_blocks.pop(worker, None)
            self.last_event.pop(worker, None)
            self.epochs.pop(worker, None)

    def apply(self, ev: KVEvent) -> bool:
        """Apply one event; returns False when it reveals a gap (the caller resyncs the worker)."""
        w, eid, epoch = ev.worker_id, ev.event_id, ev.epoch
        if self.epochs.get(w) != epoch:
            if w in self.epochs and epoch < self.epochs[w]:
                return True  # a late event from the worker's previous life
            self.clear_worker(w)  # a restarted worker starts clean
            self.epochs[w] = epoch
            self.last_event[w] = 0
        last = self.last_event.get(w)
        if last is not None and eid <= last:
            return True  # already in the snapshot
        if last is not None and eid != last + 1 and ev.kind is not KVEventKind.CLEARED:
            return False
        if ev.kind is KVEventKind.STORED:
            self.store(w, ev.blocks, ev.tier)
        elif ev.kind is KVEventKind.REMOVED:
            self.remove(w, ev.blocks, ev.tier)
        else:  # cleared
            self.clear_worker(w)
            self._bit(w)
        self.last_event[w] = eid
        self.events_applied += len(ev.blocks) or 1
        return True

    def overlaps(self, hashes: Sequence[int], workers: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds (workers with none are omitted)."""
        alive = -1
        if workers is not None:
            alive = 0
            for w in workers:
                b = self.worker_bits.get(w)
                if b is not None:
                    alive |= 1 << b
        out: dict[str, int] = {}
        blocks = self.blocks
        for i, h in enumerate(hashes):
            m = blocks.get(h, 0) & alive
            lost = alive & ~m
            if lost and i > 0:
                self._assign(out, lost, i)
            alive = m
            if not alive:
                return out
        if alive and hashes:
            self._assign(out, alive, len(hashes))
        return out

    def weighted(self, hashes: Sequence[int], overlaps: dict[str, int], weights: dict[str, float]) -> dict[str, float]:
        """Overlap scores where each leading block counts by the best tier it sits in on that worker
        (a device hit is worth more than a host or disk hit, which still beats recomputing)."""
        out = {}
        for w, n in overlaps.items():
            mine = self.worker_blocks.get(w, {})
            score = 0.0
            for h in hashes[:n]:
                t = mine.get(h, 0)
                score += weights["device"] if t & 1 else (weights["host"] if t & 2 else weights["disk"])
            out[w] = score
        return out

    def _assign(self, out: dict[str, int], mask: int, n: int) -> None:
        while mask:
            low = mask & -mask
            w = self.bit_workers.get(low.bit_length() - 1)
            if w is not None:
                out[w] = n
            mask ^= low

    def num_blocks(self) -> int:
        return len(self.blocks)


class IndexFollower:
    """Keeps a KVIndex (and a LoadMirror) in step with Redis; one per router process.

    One blocking XREAD follows both streams, the workers' KV events and the load changes; about every
    `prune_interval_s` it drops dead workers, resets the load mirror from the hash, and runs `maintenance`
    with the live workers. Under gevent (the API) this loop is a greenlet: it yields after every stream
    entry it applies and while it parses a snapshot, so a large backlog never holds up the streams of
    other requests."""

    def __init__(self, r: redis.Redis, index: KVIndex | None = None, prune_interval_s: float = 1.0,
                 maintenance: Callable[[list[registry.WorkerInfo]], None] | None = None,
                 load_mirror: LoadMirror | None = None, follow_kv: bool = True):
        self.r = r
        self.maintenance = maintenance  # called with the live workers at each prune (reaping, step costs)
        self.index = index or KVIndex()
        self.mirror = load_mirror
        self.follow_kv = follow_kv
        self.prune_interval_s = prune_interval_s
        self._last_id = "0-0"
        self._read_upto = 0  # how many entries the stream had ever had up to _last_id (XINFO entries-added)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-index", daemon=True)
        self._last_prune = 0.0
        self.resyncs = 0
        self.synced = threading.Event()

    def start(self) -> IndexFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def snapshot(self) -> None:
        """Rebuild from every live worker's block set, then follow the stream from before the snapshot."""
        if self.follow_kv:
            info = self._stream_info()
            self._last_id = info.get("last-generated-id") or "0-0"  # trimmed or not
            self._read_upto = info.get("entries-added", 0)
            for w in registry.live_workers(self.r):
                self.resync_worker(w.worker_id, gap=False)
                time.sleep(0)  # yield (gevent) between workers
        self.reset_loads()
        self.synced.set()

    def reset_loads(self) -> None:
        """The load mirror from the hash and the load stream's last id, read in one transaction."""
        if self.mirror is None:
            return
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(LOAD_KEY)
        pipe.xrevrange(LOAD_EVENTS_STREAM, count=1)
        raw, last = pipe.execute()
        self.mirror.reset(raw, last[0][0] if last else None)

    def resync_worker(self, worker: str, gap: bool = True) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.smembers(worker_blocks_key(worker))
        pipe.get(worker_seq_key(worker))
        members, seq = pipe.execute()
        epoch, _, last = (seq.decode() if seq else "0:0").partition(":")
        by_tier: dict[str, list[int]] = {}
        for i, m in enumerate(members):
            h, tier = parse_member(m)
            by_tier.setdefault(tier, []).append(h)
            if i % 20_000 == 19_999:
                time.sleep(0)  # yield (gevent) while parsing a large set
        self.index.drop_worker(worker)
        self.index._bit(worker)
        for tier, hs in by_tier.items():
            self.index.store(worker, hs, tier)
        self.index.epochs[worker] = int(epoch)
        self.index.last_event[worker] = int(last or 0)
        self.resyncs += gap

    def poll(self, block_ms: int = 500) -> int:
        """Apply new stream entries; returns the number of KV events applied."""
        streams: dict[str, str] = {}
        if self.follow_kv:
            streams[EVENTS_STREAM] = self._last_id
        if self.mirror is not None and self.mirror.position is not None:
            streams[LOAD_EVENTS_STREAM] = "{}-{}".format(*self.mirror.position)
        if not streams:
            self._stop.wait(block_ms / 1000)
            return 0
        resp = self.r.xread(streams, count=1000, block=block_ms)
        if self.mirror is not None:
            self.mirror.heard()
        n = 0
        for key, entries in resp or []:
            if (key.decode() if isinstance(key, bytes) else key) == LOAD_EVENTS_STREAM:
                for i, (entry_id, fields) in enumerate(entries):
                    self.mirror.apply(entry_id, fields)
                    if i % 200 == 199:
                        time.sleep(0)
                continue
            for entry_id, fields in entries:
                self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self._read_upto += 1
                batch = json.loads(fields[b"d"])
                for raw in batch:
                    try:
                        ev = KVEvent.from_dict(raw)
                    except (KeyError, TypeError, ValueError) as e:  # not a KV event: start that worker over
                        log.warning("KV index follower: unreadable KV event from %s (%s); resyncing it",
                                    fields.get(b"w"), e)
                        if fields.get(b"w"):
                            self.resync_worker(fields[b"w"].decode())
                        break
                    if not self.index.apply(ev):
                        self.resync_worker(ev.worker_id)
                        break
                    n += 1
                time.sleep(0)  # yield (gevent) after each batch of events
        return n

    def _stream_info(self) -> dict[str, Any]:
        try:
            info = self.r.xinfo_stream(EVENTS_STREAM)
        except redis.ResponseError:  # no stream yet
            return {}
        return {k: v.decode() if isinstance(v, bytes) else v for k, v in info.items()}

    def check_trimmed(self) -> bool:
        """Start over from the block sets when the stream was trimmed past this follower's position (it fell
        more than EVENTS_KEEP_S behind): events it never read would otherwise show as a gap only at a worker's
        next event, and a quiet worker's view would stay stale."""
        if not self.follow_kv:
            return False
        info = self._stream_info()
        if "entries-added" not in info:  # no stream yet, or a Redis before 7
            return False
        removed = info["entries-added"] - info["length"]  # trims remove the oldest first
        if removed <= self._read_upto:
            return False
        log.warning("KV index follower: the events stream was trimmed past its position %s; resyncing",
                    self._last_id)
        self.synced.clear()
        self.resyncs += 1
        return True

    def prune(self, live_workers: list[registry.WorkerInfo] | None = None) -> None:
        """Drop workers whose heartbeat expired, here and in Redis. `live_workers` may be a moment old: a worker
        that registered again since (a restart under its id) is kept, checked atomically in Redis."""
        live = {w.worker_id for w in (live_workers if live_workers is not None else registry.live_workers(self.r))}
        for w in list(self.index.worker_bits):
            if w not in live and forget_lapsed_worker(self.r, w):
                self.index.drop_worker(w)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.synced.is_set():
                    self.snapshot()
                self.poll()
                now = time.monotonic()
                if now - self._last_prune >= self.prune_interval_s:
                    self._last_prune = now
                    live = registry.live_workers(self.r)
                    self.prune(live)
                    self.reset_loads()
                    self.check_trimmed()
                    if self.maintenance:
                        self.maintenance(live)
            except redis.RedisError as e:
                if self.synced.is_set():
                    log.warning("KV index follower: Redis unreachable (%s); resyncing when it is back", e)
                self.synced.clear()
                self._stop.wait(1.0)


def _worker_state(worker: str) -> tuple[list[str], list[str]]:
    """A worker's index and load state in Redis: its keys, and its fields of the load hash (LOAD_KEY)."""
    keys = [worker_blocks_key(worker), worker_seq_key(worker), active_key("p", worker), active_key("d", worker)]
    return keys, [f"{worker}|{k}" for k in ("p", "pn", "d", "dn")]


def forget_worker(r: redis.Redis, worker: str) -> None:
    """Delete a departed worker's index and load state from Redis."""
    keys, fields = _worker_state(worker)
    pipe = r.pipeline()
    pipe.delete(*keys)
    pipe.hdel(LOAD_KEY, *fields)
    pipe.execute()


# forget_worker's deletes, done only while the worker's heartbeat (KEYS[1]) is missing: one atomic step
_FORGET_LAPSED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6])
redis.call('HDEL', KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
return 1
"""


def forget_lapsed_worker(r: redis.Redis, worker: str) -> bool:
    """forget_worker, unless the worker has a heartbeat again (it registered since its lapse was seen); whether
    it was forgotten."""
    keys, fields = _worker_state(worker)
    return bool(r.eval(_FORGET_LAPSED, 2 + len(keys), alive_key(worker), LOAD_KEY, *keys, *fields))
