"""The load mirror: each API process's copy of the farm's load, fed by the load stream, reset from the hash,
counting its own changes at once and never twice; and a follower that yields to gevent's hub."""

from __future__ import annotations

import json
import subprocess
import sys

import redis

from farm.cluster import registry
from farm.config import load_config
from farm.router.index import IndexFollower, forget_worker
from farm.router.load import LoadMirror, LoadTracker, empty_load
from farm.router.router import Router
from tests.procs import ROOT


def load(p=0, pn=0, d=0, dn=0):
    return {"p": p, "pn": pn, "d": d, "dn": dn}


def test_mirror_follows_other_replicas_and_counts_its_own_changes_once(redis_client, redis_url):
    r = redis_client
    mirror = LoadMirror()
    mine = LoadTracker(r, 60, mirror)
    other = LoadTracker(redis.Redis.from_url(redis_url), 60)  # another API replica
    follower = IndexFollower(r, load_mirror=mirror, follow_kv=False)
    assert not mirror.live
    other.begin("p", "w1", "early", 50)  # before the mirror's first reset: in the hash it is reset from
    follower.snapshot()
    assert mirror.live and mine.loads() == {"w1": load(p=50, pn=1)}
    other.begin("p", "w1", "r1", 100)
    assert mine.loads()["w1"] == load(p=50, pn=1)  # not read yet
    follower.poll(block_ms=100)
    assert mine.loads()["w1"] == load(p=150, pn=2)
    mine.begin("d", "w2", "r2", 7)
    assert mine.loads()["w2"] == load(d=7, dn=1)  # its own change counts at once
    follower.poll(block_ms=100)
    assert mine.loads()["w2"] == load(d=7, dn=1)  # and not again when its entry comes back
    assert mine.end("d", "w2", "r2") and not mine.end("d", "w2", "r2")
    other.end("p", "w1", "r1")
    other.end("p", "w1", "early")
    follower.poll(block_ms=100)
    assert mine.loads() == mine.read() == {"w1": empty_load(), "w2": empty_load()}


def test_mirror_reset_agrees_with_redis_after_changes_it_could_not_see(redis_client):
    r = redis_client
    mirror = LoadMirror()
    tracker = LoadTracker(r, 60, mirror)
    follower = IndexFollower(r, load_mirror=mirror, follow_kv=False)
    follower.snapshot()
    tracker.begin("d", "gone", "r1", 9)
    tracker.begin("d", "stays", "r2", 3)
    forget_worker(r, "gone")  # a departed worker's load is deleted from the hash, not through the stream
    assert mirror.view()["gone"] == load(d=9, dn=1)
    follower.reset_loads()
    assert mirror.view() == tracker.read() == {"stays": load(d=3, dn=1)}
    follower.poll(block_ms=50)  # entries older than the reset are not applied again
    assert mirror.view() == {"stays": load(d=3, dn=1)}


def entry(f, a, n, origin=b"elsewhere", k=0):
    return {b"f": f.encode(), b"a": str(a).encode(), b"n": str(n).encode(), b"o": origin, b"k": str(k).encode()}


def test_mirror_counts_each_own_change_once_whatever_the_order():
    m = LoadMirror()
    me = m.origin.encode()
    m.reset({b"w|p": b"10", b"w|pn": b"1"}, b"5-0")
    k = m.expect("w|d", 4, 1)  # a placement counts before its script runs (the next decision sees it)
    assert m.view()["w"] == load(p=10, pn=1, d=4, dn=1)
    m.apply(b"6-0", entry("w|d", 4, 1, me, k))  # its entry read before its script returned
    m.settle(k, b"6-0")
    assert m.view()["w"] == load(p=10, pn=1, d=4, dn=1)
    k = m.expect("w|d", 9, 1)
    m.settle(k, None)  # the script changed nothing (placed already): taken back
    assert m.view()["w"] == load(p=10, pn=1, d=4, dn=1)
    k = m.next_seq()
    m.settle(k, b"8-0", "w|p", -10, -1)  # an end counts when its script returns...
    assert m.view()["w"] == load(d=4, dn=1)
    m.apply(b"7-0", entry("v|d", 2, 1))  # (another process's change)
    m.apply(b"8-0", entry("w|p", -10, -1, me, k))  # ...and not again when its entry is read
    assert m.view() == {"w": load(d=4, dn=1), "v": load(d=2, dn=1)}
    k = m.expect("v|d", 3, 1)
    m.reset({b"w|d": b"4", b"w|dn": b"1", b"v|d": b"5", b"v|dn": b"2"}, b"9-0")  # the hash has it already
    assert m.view()["v"] == load(d=8, dn=3)  # counted twice until its script returns with entry 9-0
    m.settle(k, b"9-0")
    assert m.view()["v"] == load(d=5, dn=2)
    k = m.next_seq()
    m.apply(b"10-0", entry("v|d", -3, -1, me, k))  # an end's entry read before its script returned
    m.settle(k, b"10-0", "v|d", -3, -1)
    assert m.view()["v"] == load(d=2, dn=1)
    m.apply(b"9-0", entry("v|d", 100, 1))  # older than the mirror's position: ignored
    assert m.view()["v"] == load(d=2, dn=1)


def test_router_reads_its_mirror_once_live_and_redis_before(redis_client):
    r = redis_client
    cfg = load_config(environ={})
    info = registry.WorkerInfo("w0", "both", "m", "h", 1, 16, num_blocks=1000)
    registry.register(r, info)
    LoadTracker(r).begin("d", "w0", "x", 5)
    router = Router(cfg, r, follow=True)
    try:
        assert router.loads.loads()["w0"] == load(d=5, dn=1)  # from Redis, or from the mirror once it is reset
        router.follower.synced.wait(10)
        assert router.loads.mirror.live and router.loads.loads()["w0"] == load(d=5, dn=1)

        def no_round_trip():
            raise AssertionError("a live mirror decides without reading Redis")

        router.loads.read = no_round_trip
        assert router.choose([info], [], 16, "both").worker.worker_id == "w0"
    finally:
        router.stop()


GEVENT_READER = """
from gevent import monkey
monkey.patch_all()
import json, sys
import gevent, redis
from farm.cluster import registry
from farm.router.kv_publisher import KVEventPublisher
from farm.router.index import IndexFollower
r = redis.Redis.from_url(sys.argv[1])
registry.register(r, registry.WorkerInfo("g", "both", "m", "h", 1, 16, num_blocks=100))
pub = KVEventPublisher(r, "g")
pub("cleared", [], None)
pub.flush()
follower = IndexFollower(r)
follower.snapshot()
for i in range(300):  # a backlog: 300 stream entries of 50 blocks
    pub("stored", list(range(i * 50, i * 50 + 50)), None)
    pub.flush()
order = []
apply = follower.index.apply
def traced(ev):
    order.append("f")
    return apply(ev)
follower.index.apply = traced
def ticker():
    while True:
        order.append("t")
        gevent.sleep(0)
g = gevent.spawn(ticker)
gevent.sleep(0)
n = follower.poll(block_ms=100)
g.kill()
first, last = order.index("f"), len(order) - 1 - order[::-1].index("f")
print(json.dumps({"applied": n, "blocks": follower.index.num_blocks(), "ticks_between": order[first:last].count("t")}))
"""


def test_follower_yields_to_other_greenlets_while_it_applies_a_backlog(redis_client, redis_url):
    out = subprocess.run([sys.executable, "-c", GEVENT_READER, redis_url], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["applied"] == 300 and res["blocks"] == 300 * 50
    assert res["ticks_between"] >= 250  # another greenlet ran between (nearly) every two entries
