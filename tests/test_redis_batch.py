"""Batched Redis writes (farm.infra.redis_batch) and the load tracker's writes through them: in order, one round
trip for many, each job told its own replies, and the load scripts still run after Redis forgot them."""

from __future__ import annotations

import time

from farm.infra.redis_batch import Job, PipelineBatcher
from farm.router.load import LoadMirror, LoadTracker


def test_jobs_go_out_in_order_in_one_pipeline_and_each_gets_its_replies(redis_client):
    b = PipelineBatcher(redis_client, window_s=0.05)
    got: dict[int, list] = {}

    def job(i: int) -> Job:
        def add(pipe) -> int:
            pipe.rpush("batch:list", i)
            pipe.incr("batch:n")
            return 2
        return Job(add, lambda replies, i=i: got.__setitem__(i, replies))

    for i in range(20):
        b.submit(job(i))
    deadline = time.monotonic() + 5
    while len(got) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    b.stop()
    assert [int(x) for x in redis_client.lrange("batch:list", 0, -1)] == list(range(20))  # in order
    assert [got[i][1] for i in range(20)] == list(range(1, 21))  # each its own replies
    assert b.sent == 20


def test_a_command_error_reaches_its_job_only(redis_client):
    redis_client.set("batch:str", "x")
    b = PipelineBatcher(redis_client, window_s=0)
    seen: list = []
    b.submit(Job(lambda p: (p.incr("batch:str"), 1)[1], seen.append))  # not an integer: an error reply
    b.submit(Job(lambda p: (p.incr("batch:ok"), 1)[1], seen.append))
    b.flush()
    b.stop()
    assert isinstance(seen[0][0], Exception) and seen[1] == [1]


def test_load_writes_through_the_batcher_count_and_survive_a_script_flush(redis_client):
    mirror = LoadMirror()
    raw = redis_client.hgetall("farm:load")
    mirror.reset(raw, None)
    b = PipelineBatcher(redis_client, window_s=0)
    loads = LoadTracker(redis_client, 60, mirror, b)
    loads.begin_soon([("p", "w1", "r1", 40), ("d", "w1", "r1", 3)])
    assert mirror.view()["w1"]["p"] == 40  # counted at once, before the script ran
    b.flush()
    assert int(redis_client.hget("farm:load", "w1|p")) == 40
    redis_client.script_flush()  # Redis restarted and forgot the scripts
    loads.end_soon("p", "w1", "r1")
    loads.end_soon("d", "w1", "r1")
    b.flush()
    b.stop()
    assert int(redis_client.hget("farm:load", "w1|p")) == 0 and int(redis_client.hget("farm:load", "w1|d")) == 0
    assert mirror.view()["w1"]["p"] == 0 and mirror.view()["w1"]["d"] == 0


def test_an_end_is_off_the_mirror_before_its_script_runs_and_back_if_nothing_ended(redis_client):
    mirror = LoadMirror()
    mirror.reset(redis_client.hgetall("farm:load"), None)
    b = PipelineBatcher(redis_client, window_s=0)
    loads = LoadTracker(redis_client, 60, mirror, b)
    loads.begin_soon([("d", "w2", "r2", 5), ("d", "w2", "r3", 7)])
    b.flush()
    loads.end_soon("d", "w2", "r2")
    assert mirror.view()["w2"]["d"] == 7 and mirror.view()["w2"]["dn"] == 1  # a sequential client sees it free
    b.flush()
    assert int(redis_client.hget("farm:load", "w2|d")) == 7
    LoadTracker(redis_client, 60).end("d", "w2", "r3")  # meanwhile another process's deadline reaper ended r3
    loads.end_soon("d", "w2", "r3")
    assert mirror.view()["w2"]["d"] == 0  # taken off at once
    b.flush()  # its script found nothing to end: taken back, the other process's end comes from the stream
    b.stop()
    assert mirror.view()["w2"]["d"] == 7
    for entry_id, fields in redis_client.xrange("farm:load:events"):
        mirror.apply(entry_id, fields)
    assert mirror.view()["w2"] == {"p": 0, "pn": 0, "d": 0, "dn": 0}
