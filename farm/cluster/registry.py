"""Worker registry in Redis: who serves which model in which role, alive by heartbeat.

Each worker process writes its record to the hash `farm:workers` and refreshes a TTL key
`farm:alive:<worker_id>` every few seconds. A worker whose alive key expired is gone: readers ignore
it (and prune it), so a killed worker leaves routing within `HEARTBEAT_TTL_S` seconds.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from farm.protocol.keys import WORKERS_KEY, alive_key

HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TTL_S = 6

# Prune a record only if its alive key is still missing when the prune runs: a worker that registered (again) between
# a reader's HGETALL and its prune must keep the record it just wrote.
_PRUNE = """
for i, wid in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then redis.call('HDEL', KEYS[1], wid) end
end
"""


@dataclass
class WorkerInfo:
    worker_id: str
    role: str  # prefill | decode | both
    model: str
    hostname: str
    pid: int
    block_size: int
    transfer_endpoint: str = ""  # host:port of the KV transfer server
    queues: list[str] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    device: str = "cpu"
    num_blocks: int = 0
    since_boot: float = 0.0  # the process's start after its host's boot (farm.infra.process_identity); 0: unknown

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerInfo:
        d: dict[str, Any] = json.loads(raw)
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def register(r: redis.Redis, info: WorkerInfo) -> None:
    pipe = r.pipeline()
    pipe.hset(WORKERS_KEY, info.worker_id, info.to_json())
    pipe.set(alive_key(info.worker_id), json.dumps({"ts": time.time()}), ex=HEARTBEAT_TTL_S)
    pipe.execute()


def deregister(r: redis.Redis, worker_id: str) -> None:
    pipe = r.pipeline()
    pipe.hdel(WORKERS_KEY, worker_id)
    pipe.delete(alive_key(worker_id))
    pipe.execute()


def heartbeat(r: redis.Redis, worker_id: str, stats: dict[str, Any] | None = None) -> None:
    r.set(alive_key(worker_id), json.dumps({"ts": time.time(), **(stats or {})}), ex=HEARTBEAT_TTL_S)


def heartbeats(r: redis.Redis, worker_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The latest heartbeat (time and engine stats) of each worker that has a current one, in one round trip."""
    if not worker_ids:
        return {}
    out = {}
    for wid, raw in zip(worker_ids, r.mget([alive_key(w) for w in worker_ids]), strict=True):
        if raw is not None:
            try:
                out[wid] = json.loads(raw)
            except ValueError:
                continue
    return out


def live_workers(r: redis.Redis, model: str | None = None, role: str | None = None) -> list[WorkerInfo]:
    """Workers whose heartbeat is current, optionally filtered; stale records are pruned."""
    records = r.hgetall(WORKERS_KEY)
    if not records:
        return []
    ids = [i.decode() if isinstance(i, bytes) else i for i in records]
    alive = r.mget([alive_key(i) for i in ids])
    out: list[WorkerInfo] = []
    stale = []
    for wid, raw, hb in zip(ids, records.values(), alive, strict=True):
        if hb is None:
            stale.append(wid)
            continue
        info = WorkerInfo.from_json(raw)
        if (model is None or info.model == model) and (role is None or info.role == role):
            out.append(info)
    if stale:
        prune(r, stale)
    return sorted(out, key=lambda w: w.worker_id)


def prune(r: redis.Redis, worker_ids: list[str]) -> None:
    """Drop the records of `worker_ids` whose heartbeat has lapsed, checked and dropped in one atomic step."""
    r.eval(_PRUNE, len(worker_ids) + 1, WORKERS_KEY, *(alive_key(w) for w in worker_ids), *worker_ids)


class Heartbeat(threading.Thread):
    """Background thread that keeps a worker's alive key fresh until stopped."""

    def __init__(self, r: redis.Redis, info: WorkerInfo, stats_fn=None):
        super().__init__(name=f"heartbeat-{info.worker_id}", daemon=True)
        self.r, self.info, self.stats_fn = r, info, stats_fn
        self._stop_evt = threading.Event()
        self.draining = False  # warm shutdown: stay alive (requests in flight are not migrated), leave routing

    def drain(self) -> None:
        """Leave routing (no new placements) but keep the alive key fresh while requests finish."""
        self.draining = True
        self.r.hdel(WORKERS_KEY, self.info.worker_id)

    def run(self) -> None:
        while not self._stop_evt.is_set():
            try:
                if not self.draining and not self.r.hexists(WORKERS_KEY, self.info.worker_id):
                    register(self.r, self.info)  # re-register after a Redis restart / prune
                heartbeat(self.r, self.info.worker_id, self.stats_fn() if self.stats_fn else None)
            except redis.RedisError:
                pass  # Redis down: keep trying; readers will see us again when it is back
            self._stop_evt.wait(HEARTBEAT_INTERVAL_S)

    def stop(self) -> None:
        self._stop_evt.set()
