"""KV-block index on a real Redis: interleaved events, gaps, restarts, dead workers, two readers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

from farm.cluster import registry
from farm.protocol.keys import EVENTS_STREAM, worker_blocks_key
from farm.router.index import IndexFollower, KVIndex
from farm.router.kv_publisher import KVEventPublisher
from tests.procs import ROOT


def register(r, wid, block_size=16):
    registry.register(r, registry.WorkerInfo(wid, "both", "m", "h", 1, block_size, num_blocks=100))


def live_with_blocks(r, workers, blocks):
    """Each worker registered (a current heartbeat) with a clean cache holding `blocks`."""
    for w in workers:
        register(r, w)
        p = KVEventPublisher(r, w)
        p("cleared", [], None)
        p("stored", blocks, None)
        p.flush()


def sync(follower, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if follower.poll(block_ms=50) == 0:
            return
    raise AssertionError("follower did not catch up")


def truth(r, workers):
    return {w: {int(h) for h in r.smembers(worker_blocks_key(w))} for w in workers}


def index_view(index: KVIndex, workers):
    return {w: set(index.worker_blocks.get(w, set())) for w in workers}


def test_interleaved_events_from_many_workers_match_ground_truth(redis_client):
    r = redis_client
    workers = [f"w{i}" for i in range(6)]
    pubs = {w: KVEventPublisher(r, w) for w in workers}
    for w in workers:
        register(r, w)
        pubs[w]("cleared", [], None)
    follower = IndexFollower(r)
    follower.snapshot()
    rng = random.Random(7)
    model = {w: set() for w in workers}
    for step in range(3000):
        w = rng.choice(workers)
        if model[w] and rng.random() < 0.35:
            gone = rng.sample(sorted(model[w]), k=min(len(model[w]), rng.randint(1, 4)))
            pubs[w]("removed", gone, None)
            model[w] -= set(gone)
        else:
            new = [rng.randrange(1 << 40) for _ in range(rng.randint(1, 5))]
            pubs[w]("stored", new, None)
            model[w] |= set(new)
        if step % 97 == 0:
            pubs[rng.choice(workers)].flush()
            follower.poll(block_ms=1)
    for p in pubs.values():
        p.flush()
    sync(follower)
    assert truth(r, workers) == model
    assert index_view(follower.index, workers) == model


def test_overlap_counts_leading_blocks_only():
    idx = KVIndex()
    idx.store("a", [1, 2, 3])
    idx.store("b", [1, 2])
    idx.store("c", [2, 3])  # holds later blocks but not the first: no usable prefix
    assert idx.overlaps([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert idx.overlaps([1, 2, 3, 4], workers=["b", "c"]) == {"b": 2}
    assert idx.overlaps([9]) == {}


def test_gap_in_stream_triggers_resync_from_snapshot(redis_client):
    r = redis_client
    register(r, "g1")
    pub = KVEventPublisher(r, "g1")
    pub("cleared", [], None)
    pub("stored", [1, 2, 3], None)
    pub.flush()
    follower = IndexFollower(r)
    follower.snapshot()
    sync(follower)
    pub("stored", [4], None)
    pub.flush()
    lost = r.xrevrange(EVENTS_STREAM, count=1)[0][0]
    r.xdel(EVENTS_STREAM, lost)  # this batch never reaches the reader
    pub("removed", [1], None)
    pub.flush()
    before = follower.resyncs
    sync(follower)
    assert follower.resyncs == before + 1
    assert set(follower.index.worker_blocks["g1"]) == {2, 3, 4}


def test_restarted_worker_starts_clean(redis_client):
    r = redis_client
    register(r, "re1")
    old = KVEventPublisher(r, "re1")
    old("cleared", [], None)
    old("stored", [10, 11], None)
    old.flush()
    follower = IndexFollower(r)
    follower.snapshot()
    sync(follower)
    assert follower.index.overlaps([10, 11]) == {"re1": 2}
    new = KVEventPublisher(r, "re1")  # same name, new process: ids restart at 1
    new.start()
    new("stored", [20], None)
    new.stop()
    sync(follower)
    assert set(follower.index.worker_blocks["re1"]) == {20}
    assert r.smembers(worker_blocks_key("re1")) == {b"20"}


def test_dead_worker_leaves_index_within_seconds(redis_client):
    r = redis_client
    live_with_blocks(r, ("alive", "dying"), [100, 101])
    follower = IndexFollower(r, prune_interval_s=0.1).start()
    try:
        deadline = time.time() + 5
        while follower.index.overlaps([100, 101]) != {"alive": 2, "dying": 2} and time.time() < deadline:
            time.sleep(0.05)
        assert follower.index.overlaps([100, 101]) == {"alive": 2, "dying": 2}
        r.delete(registry.alive_key("dying"))  # heartbeat expired
        deadline = time.time() + registry.HEARTBEAT_TTL_S
        while "dying" in follower.index.worker_bits and time.time() < deadline:
            time.sleep(0.05)
        assert follower.index.overlaps([100, 101]) == {"alive": 2}
        assert not r.exists(worker_blocks_key("dying"))
    finally:
        follower.stop()


def test_a_prune_on_a_stale_view_keeps_a_worker_that_registered_again(redis_client):
    """The follower prunes against the live workers it read a moment before: a worker that registered again in
    between (a restart under its id) keeps its index and its keys in Redis; a lapsed one loses both."""
    r = redis_client
    live_with_blocks(r, ("back", "gone"), [200, 201])
    follower = IndexFollower(r)
    follower.snapshot()
    sync(follower)
    stale_view: list[registry.WorkerInfo] = []  # read when both heartbeats had lapsed
    r.delete(registry.alive_key("gone"))
    follower.prune(stale_view)  # "back" has its heartbeat again by the time the prune runs
    assert follower.index.overlaps([200, 201]) == {"back": 2}
    assert r.exists(worker_blocks_key("back")) and not r.exists(worker_blocks_key("gone"))


READER = """
import json, sys, time, redis
from farm.router.index import IndexFollower
r = redis.Redis.from_url(sys.argv[1])
f = IndexFollower(r)
f.snapshot()
while f.poll(block_ms=200):
    pass
print(json.dumps({w: sorted(b) for w, b in f.index.worker_blocks.items()}))
"""


def test_two_router_processes_agree_on_the_index(redis_client, redis_url):
    r = redis_client
    rng = random.Random(3)
    for w in ("x1", "x2", "x3"):
        register(r, w)
        p = KVEventPublisher(r, w)
        p("cleared", [], None)
        for _ in range(50):
            p("stored", [rng.randrange(1 << 50) for _ in range(3)], None)
        p.flush()
    outs = [
        subprocess.run([sys.executable, "-c", READER, redis_url], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, check=True).stdout
        for _ in range(2)
    ]
    a, b = (json.loads(o) for o in outs)
    assert a == b and set(a) == {"x1", "x2", "x3"} and all(len(v) == 150 for v in a.values())


def test_a_failed_publish_is_sent_again_whole(redis_client, pipeline_fails_once):
    """A publish that failed (Redis restarting, or a timeout across a partition) is retried with its commands:
    a failed execute() empties a redis-py pipeline, so retrying the same one would send nothing."""
    pub = KVEventPublisher(redis_client, "t1")
    pub("stored", [7, 8], None)
    pub.flush()
    assert len(pipeline_fails_once) == 2 and pub.published == 2
    assert {int(m.split(b":")[0]) for m in redis_client.smembers(worker_blocks_key("t1"))} == {7, 8}
    assert redis_client.xlen(EVENTS_STREAM) == 1
