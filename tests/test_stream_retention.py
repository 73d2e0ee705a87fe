"""The farm's event streams keep minutes, not a count that a quiet farm takes days to reach (issue 30's soak:
Redis grew 14 MB/h under the count caps alone). Each writer trims its stream by age as it adds."""

from __future__ import annotations

import time

import pytest
import redis

from farm.gateway.submission import add_observation
from farm.protocol.keys import (
    EVENTS_KEEP_S,
    EVENTS_STREAM,
    LOAD_EVENTS_KEEP_S,
    LOAD_EVENTS_STREAM,
    OBS_KEEP_S,
    OBS_STREAM,
    stream_min_id,
)
from farm.protocol.kv_events import KVEventKind
from farm.router.index import IndexFollower
from farm.router.kv_publisher import KVEventPublisher
from farm.router.load import LoadTracker


def fill_old(r: redis.Redis, stream: str, keep_s: float, n: int = 500) -> None:
    """`n` entries older than the stream keeps (explicit ids in the past), filling whole stream nodes: an
    approximate trim removes whole nodes only."""
    t0 = int((time.time() - keep_s - 120) * 1000)
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(stream, {"old": i}, id=f"{t0 + i}-0")
    pipe.execute()


def old_entries(r: redis.Redis, stream: str, keep_s: float) -> int:
    return len(r.xrange(stream, "-", stream_min_id(keep_s)))


def test_min_id_is_the_server_clock_in_ms_minus_the_window():
    assert stream_min_id(600, now=1_000.0) == "400000-0"


@pytest.mark.parametrize("stream, keep_s", [(EVENTS_STREAM, EVENTS_KEEP_S), (LOAD_EVENTS_STREAM, LOAD_EVENTS_KEEP_S),
                                            (OBS_STREAM, OBS_KEEP_S)])
def test_each_writer_trims_its_stream_by_age(redis_client, stream, keep_s):
    fill_old(redis_client, stream, keep_s)
    assert old_entries(redis_client, stream, keep_s) == 500
    if stream == EVENTS_STREAM:
        pub = KVEventPublisher(redis_client, "w-trim")
        pub(KVEventKind.STORED, [1, 2], None)
        pub.flush()
    elif stream == LOAD_EVENTS_STREAM:
        loads = LoadTracker(redis_client)
        loads.begin("p", "w-trim", "req-1", 10)
        assert old_entries(redis_client, stream, keep_s) <= 100
        redis_client.delete(stream)  # the end's own trim, seen apart from the begin's
        fill_old(redis_client, stream, keep_s)
        assert loads.end("p", "w-trim", "req-1")
    else:
        pipe = redis_client.pipeline(transaction=False)
        assert add_observation(pipe, {"model": "m", "ts": time.time(), "ttft": 0.1}) == 2
        pipe.execute()
    # whole nodes of old entries are gone; the node holding the newest old ones may stay (approximate trim)
    assert old_entries(redis_client, stream, keep_s) <= 100
    newest = redis_client.xrevrange(stream, count=1)[0]
    assert b"old" not in newest[1]  # what was just written is kept


def test_a_follower_the_trim_passed_by_starts_over_from_the_block_sets(redis_client):
    """Events the follower never read, trimmed away, would otherwise show only at that worker's next event."""
    follower = IndexFollower(redis_client)
    pub = KVEventPublisher(redis_client, "w-behind")
    pub(KVEventKind.STORED, [7], None)
    pub.flush()
    follower.snapshot()
    follower.poll(block_ms=10)
    assert not follower.check_trimmed()  # read up to the end: nothing missed
    pub(KVEventKind.STORED, [8], None)
    pub.flush()
    assert not follower.check_trimmed()  # not read yet, still there
    redis_client.xtrim(EVENTS_STREAM, maxlen=0, approximate=False)  # ... and now gone before it was read
    assert follower.check_trimmed()
    assert not follower.synced.is_set()
    follower.snapshot()  # from the sets, and the stream's position after what was trimmed: no loop of resyncs
    assert follower.synced.is_set() and not follower.check_trimmed()
