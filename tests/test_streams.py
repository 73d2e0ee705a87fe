"""The worker's stream writer batches token deltas into few Redis entries without losing what they carry."""

from __future__ import annotations

import json
import time

import redis

from farm.protocol import EVENT_FIELD, stream_key
from farm.streams import StreamWriter
from tests.conftest import start_redis


def read(r, rid: str) -> list[dict]:
    return [json.loads(f[EVENT_FIELD.encode()]) for _id, f in r.xrange(stream_key(rid))]


def test_merged_deltas_keep_ids_and_logprobs_aligned(redis_client):
    w = StreamWriter(redis_client, flush_ms=10_000)  # never flushes on its own: the test flushes
    w.emit("r1", {"type": "start", "role": "both", "worker": "w"})
    w.emit("r1", {"type": "delta", "text": "He", "n": 1, "ids": [10], "lp": [[-0.1, []]]})
    w.emit("r1", {"type": "delta", "text": "llo", "n": 1, "ids": [11], "lp": [[-0.2, [[11, -0.2]]]]})
    w.emit("r1", {"type": "delta", "text": "!", "n": 1, "ids": [12], "lp": [[-0.3, []]]})
    w.emit("r2", {"type": "delta", "text": "a", "n": 1, "ids": [1]})
    w.emit("r2", {"type": "delta", "text": "b", "n": 1, "ids": [2]})
    w.flush()
    start, delta = read(redis_client, "r1")
    assert start["type"] == "start"
    assert (delta["text"], delta["n"], delta["ids"]) == ("Hello!", 3, [10, 11, 12])
    assert delta["lp"] == [[-0.1, []], [-0.2, [[11, -0.2]]], [-0.3, []]]
    (plain,) = read(redis_client, "r2")
    assert plain["ids"] == [1, 2] and "lp" not in plain


def test_with_a_replica_each_flush_returns_only_once_the_replica_holds_it(tmp_path, caplog):
    """redis.ha: a flush waits (WAIT) for the replica, so a failover right after it cannot lose those tokens;
    with no replica answering it warns and stops waiting for a while instead of stalling every flush."""
    primary, url = start_redis(tmp_path / "primary")
    replica, replica_url = start_redis(tmp_path / "replica")
    try:
        p, rep = redis.Redis.from_url(url), redis.Redis.from_url(replica_url)
        p.config_set("repl-diskless-sync-delay", 0)  # sync at once, as the managed primary does
        rep.execute_command("REPLICAOF", "127.0.0.1", str(p.connection_pool.connection_kwargs["port"]))
        deadline = time.monotonic() + 20
        while rep.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica did not sync"
            time.sleep(0.05)
        w = StreamWriter(p, flush_ms=10_000, replica_ack_ms=5000)
        for i in range(20):
            w.emit("ha", {"type": "delta", "text": str(i), "n": 1, "ids": [i]})
            w.flush()
            assert len(read(rep, "ha")) == i + 1  # on the replica as soon as flush() returns, every time
        assert w._no_replica_until == 0.0

        replica.kill()
        replica.wait()
        w.replica_ack_ms = 300
        w.emit("ha", {"type": "delta", "text": "x", "n": 1, "ids": [99]})
        t0 = time.monotonic()
        w.flush()
        assert 0.25 < time.monotonic() - t0 < 5  # waited for the replica, up to replica_ack_ms
        assert "no replica acknowledged" in caplog.text
        w.emit("ha", {"type": "delta", "text": "y", "n": 1, "ids": [100]})
        t0 = time.monotonic()
        w.flush()
        assert time.monotonic() - t0 < 0.25  # no waiting again at once
        assert [e["ids"] for e in read(p, "ha")][-2:] == [[99], [100]]  # the primary has them all
    finally:
        for proc in (primary, replica):
            proc.kill()
            proc.wait()
