"""The worker's stream writer batches token deltas into one reply-stream entry per reader and flush, without
losing what they carry; readers skip a batch written twice; a lapsed reader lease aborts its requests; the pump
flushes a linger after the first unsent event (at once for a first token or an end) and sleeps while idle."""

from __future__ import annotations

import time

import redis

from farm.protocol import (
    EVENT_FIELD,
    DeltaEvent,
    DoneEvent,
    StartEvent,
    Usage,
    decode_reply,
    encode_reply,
    reader_lease_key,
    reply_stream_key,
)
from farm.worker.stream_writer import StreamWriter
from tests.conftest import start_redis


def batches(r, reader: str):
    return [decode_reply(f[EVENT_FIELD.encode()]) for _id, f in r.xrange(reply_stream_key(reader))]


def events_of(r, reader: str, rid: str) -> list:
    return [ev for b in batches(r, reader) for ev in b.events.get(rid, [])]


def test_one_entry_per_reader_and_flush_with_merged_deltas_keeping_ids_and_logprobs_aligned(redis_client):
    w = StreamWriter(redis_client, flush_ms=10_000)  # never flushes on its own: the test flushes
    w.open("r1", "api-a")
    w.open("r2", "api-a")
    w.open("r3", "api-b")
    w.emit("r1", StartEvent("both", "w"))
    w.emit("r1", DeltaEvent("He", 1, [10], [[-0.1, []]]))
    w.emit("r1", DeltaEvent("llo", 1, [11], [[-0.2, [[11, -0.2]]]]))
    w.emit("r1", DeltaEvent("!", 1, [12], [[-0.3, []]]))
    w.emit("r2", DeltaEvent("a", 1, [1]))
    w.emit("r2", DeltaEvent("b", 1, [2]))
    w.emit("r3", DeltaEvent("c", 1, [3]))
    w.flush()
    (a,) = batches(redis_client, "api-a")  # both requests of reader a in one entry
    (b,) = batches(redis_client, "api-b")
    assert a.seq == b.seq == 1 and a.writer.startswith(w.writer_id + ".")  # numbered per reader, from 1
    start, delta = a.events["r1"]
    assert isinstance(start, StartEvent)
    assert (delta.text, delta.n, delta.ids) == ("Hello!", 3, [10, 11, 12])
    assert delta.lp == [[-0.1, []], [-0.2, [[11, -0.2]]], [-0.3, []]]
    (plain,) = a.events["r2"]
    assert plain.ids == [1, 2] and plain.lp is None
    assert [e.text for e in b.events["r3"]] == ["c"]


def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_first_token_and_end_go_at_once_the_rest_after_the_linger(redis_client):
    w = StreamWriter(redis_client, flush_ms=400).start()
    try:
        w.open("r1", "api-linger")
        t0 = time.monotonic()
        w.emit("r1", StartEvent("both", "w"))  # lingers: it goes with the first token
        w.emit("r1", DeltaEvent("a", 1, [1]))  # the first token: at once
        _wait_for(lambda: len(events_of(redis_client, "api-linger", "r1")) == 2)
        assert time.monotonic() - t0 < 0.3
        w.emit("r1", DeltaEvent("b", 1, [2]))  # a later token waits for the linger
        t1 = time.monotonic()
        time.sleep(0.15)
        assert len(events_of(redis_client, "api-linger", "r1")) == 2
        _wait_for(lambda: len(events_of(redis_client, "api-linger", "r1")) == 3)
        assert time.monotonic() - t1 >= 0.35
        w.emit("r1", DeltaEvent("c", 1, [3]))
        w.emit("r1", DoneEvent("stop", Usage(3, 3, 0)))  # an end takes what is pending with it, at once
        _wait_for(lambda: len(events_of(redis_client, "api-linger", "r1")) == 5, timeout=0.3)
        assert [type(e).__name__ for e in events_of(redis_client, "api-linger", "r1")] == [
            "StartEvent", "DeltaEvent", "DeltaEvent", "DeltaEvent", "DoneEvent"]
    finally:
        w.stop()


def test_an_idle_pump_sleeps(redis_client, monkeypatch):
    """Nothing open and nothing to send: the pump neither flushes nor polls flags until an event comes."""
    w = StreamWriter(redis_client, flush_ms=5, on_cancel=lambda rid: None, cancel_poll_s=0.01)
    calls = []
    flush, poll = w.flush, w._poll_flags
    monkeypatch.setattr(w, "flush", lambda: (calls.append("flush"), flush()))
    monkeypatch.setattr(w, "_poll_flags", lambda: (calls.append("poll"), poll()))
    w.start()
    try:
        time.sleep(0.3)
        assert calls == []
        w.open("r1", "api-idle")  # an open request is polled for its cancel flag again
        w.emit("r1", StartEvent("both", "w"))
        _wait_for(lambda: "flush" in calls and calls.count("poll") >= 2)
    finally:
        monkeypatch.undo()
        w.stop()


def test_closed_and_unrouted_requests_emit_nothing(redis_client):
    w = StreamWriter(redis_client, flush_ms=10_000)
    w.emit("never-opened", DeltaEvent("x", 1, [1]))
    w.open("r1", "api-c")
    w.emit("r1", DoneEvent("stop", Usage(3, 1, 0)))
    w.close("r1")
    w.emit("r1", DeltaEvent("late", 1, [2]))
    w.flush()
    assert [type(e).__name__ for e in events_of(redis_client, "api-c", "r1")] == ["DoneEvent"]
    assert not redis_client.keys("farm:out:*never*")


def test_a_retried_flush_repeats_its_sequence_number_and_the_reader_skips_it(redis_client):
    """The writer resends a whole batch whose answer never came; the reply reader skips a (writer, seq) it has."""
    from farm.config.processes import ReliabilityConfig
    from farm.gateway.replies import ReplyReader

    reader = ReplyReader(redis_client, ReliabilityConfig())
    box = reader.open("r1")
    w = StreamWriter(redis_client, flush_ms=10_000)
    w.open("r1", reader.reader_id)
    w.emit("r1", DeltaEvent("once", 1, [5]))
    with w._flush_lock, w._lock:
        pending, w._pending = w._pending, {}
    [(reader_id, events)] = pending.items()
    entry = (encode_reply(w.writer_id, 1, events), time.monotonic())
    for _ in range(2):  # the same batch again, as after a flush whose answer never came
        w._unsent = {reply_stream_key(reader_id): [entry]}
        w._write_oldest()
    reader.start()
    try:
        got = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(got) < 1:
            got += box.take(0.2)
        time.sleep(0.3)
        got += box.take(0.1)
        assert [e.text for e in got] == ["once"]
    finally:
        reader.stop()


def test_a_flush_that_timed_out_is_sent_again_not_dropped(redis_client, pipeline_fails_once):
    """Across a partition a flush ends in a socket timeout (redis.socket), not a connection error: its events stay
    and are written once Redis answers, as after a restart."""
    w = StreamWriter(redis_client, flush_ms=10_000)
    w.open("r1", "api-partitioned")
    w.emit("r1", DeltaEvent("kept", 1, [5]))
    w.flush()
    assert len(pipeline_fails_once) == 2
    assert [e.text for e in events_of(redis_client, "api-partitioned", "r1")] == ["kept"]


def test_a_lapsed_reader_lease_aborts_its_requests_and_a_cancel_flag_its_own(redis_client):
    aborted: list[str] = []
    w = StreamWriter(redis_client, flush_ms=10_000, on_cancel=aborted.append, cancel_poll_s=0.0)
    redis_client.set(reader_lease_key("api-live"), "1", ex=60)
    w.open("kept", "api-live", lease_grace_s=0.2)
    w.open("orphan", "api-dead", lease_grace_s=0.2)
    w.open("cancelled", "api-live", lease_grace_s=0.2)
    redis_client.set("farm:cancel:cancelled", "1", ex=60)
    w._poll_flags()
    assert aborted == ["cancelled"]  # the dead reader's grace has not passed yet
    time.sleep(0.25)
    aborted.clear()
    w._poll_flags()
    assert sorted(aborted) == ["cancelled", "orphan"]


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
        w.open("ha", "api-ha")
        for i in range(20):
            w.emit("ha", DeltaEvent(str(i), 1, [i]))
            w.flush()
            assert len(events_of(rep, "api-ha", "ha")) == i + 1  # on the replica as soon as flush() returns
        assert w._no_replica_until == 0.0

        replica.kill()
        replica.wait()
        w.replica_ack_ms = 300
        w.emit("ha", DeltaEvent("x", 1, [99]))
        t0 = time.monotonic()
        w.flush()
        assert 0.25 < time.monotonic() - t0 < 5  # waited for the replica, up to replica_ack_ms
        assert "no replica acknowledged" in caplog.text
        w.emit("ha", DeltaEvent("y", 1, [100]))
        t0 = time.monotonic()
        w.flush()
        assert time.monotonic() - t0 < 0.25  # no waiting again at once
        assert [e.ids for e in events_of(p, "api-ha", "ha")][-2:] == [[99], [100]]  # the primary has them all
    finally:
        for proc in (primary, replica):
            proc.kill()
            proc.wait()


def test_events_redis_refuses_wait_in_order_however_long_nothing_is_dropped(tmp_path, monkeypatch):
    """Redis refusing writes (out of memory under `noeviction`, as the chart and compose run it; MISCONF; BUSY) made
    the writer drop a flush, and an outage past its retries (about 25 s) too: the answer then missed a stretch of
    tokens and still ended `done` with the full usage. Now every batch waits for Redis, each reader's in order and
    numbered 1, 2, ... with no gap, however long the refusal lasts (here past the retries of several flushes)."""
    import threading

    import farm.worker.stream_writer as sw

    monkeypatch.setattr(sw, "FLUSH_ATTEMPTS", 3)  # a flush hands back to the pump after ~0.6 s: the outage outlasts it
    proc, url = start_redis(tmp_path / "refusing")
    try:
        r = redis.Redis.from_url(url)
        w = StreamWriter(r, flush_ms=5).start()
        for rid, reader in (("a", "api-1"), ("b", "api-1"), ("c", "api-2")):
            w.open(rid, reader)
        sent: dict[str, list[str]] = {"a": [], "b": [], "c": []}

        def stream(n: int) -> None:
            for i in range(n):
                for rid in sent:
                    sent[rid].append(f"{rid}{i},")
                    w.emit(rid, DeltaEvent(f"{rid}{i},", 1, [i]))
                time.sleep(0.01)

        stream(20)
        _wait_for(lambda: len(events_of(r, "api-2", "c")) > 0)
        r.config_set("maxmemory", 1)  # every XADD now fails with OOM
        producer = threading.Thread(target=stream, args=(150,))
        producer.start()
        producer.join()
        time.sleep(1.5)  # past several flushes' retries
        assert w.unsent() > 0
        r.config_set("maxmemory", 0)
        _wait_for(lambda: w.unsent() == 0, 15)
        for rid in ("a", "b"):
            w.emit(rid, DoneEvent("stop", Usage(1, 170, 0)))
        w.emit("c", DoneEvent("stop", Usage(1, 170, 0)))
        _wait_for(lambda: all(events_of(r, rd, rid) and type(events_of(r, rd, rid)[-1]).__name__ == "DoneEvent"
                              for rid, rd in (("a", "api-1"), ("b", "api-1"), ("c", "api-2"))), 15)
        w.stop()
        for rid, reader in (("a", "api-1"), ("b", "api-1"), ("c", "api-2")):
            text = "".join(e.text for e in events_of(r, reader, rid) if isinstance(e, DeltaEvent))
            assert text == "".join(sent[rid]), f"{rid}: {len(text)} of {len(''.join(sent[rid]))} characters"
        for reader in ("api-1", "api-2"):
            seqs = [b.seq for b in batches(r, reader)]
            assert seqs == list(range(1, len(seqs) + 1)), seqs  # no gap, no reordering
    finally:
        proc.kill()
        proc.wait()


def test_a_reader_that_finds_a_hole_in_a_writers_batches_fails_the_requests_it_fed(redis_client):
    """Batches are numbered per reader with no gap, so a batch Redis lost (a restart without the last second of its
    AOF) shows as a hole: the requests that writer was feeding end with `events_lost` instead of an answer that is
    missing a stretch yet looks whole; a request that begins after the hole is unharmed."""
    from farm.config.processes import ReliabilityConfig
    from farm.gateway.replies import ReplyReader
    from farm.protocol import ErrorEvent

    reader = ReplyReader(redis_client, ReliabilityConfig())
    fed, fresh, moved = reader.open("fed"), reader.open("fresh"), reader.open("moved")
    key = reply_stream_key(reader.reader_id)

    def write(seq: int, events: dict, writer: str = "writer-1") -> None:
        redis_client.xadd(key, {EVENT_FIELD: encode_reply(writer, seq, events)})

    write(1, {"fed": [StartEvent("both", "w").to_dict(), DeltaEvent("one ", 1, [1]).to_dict()],
              "moved": [StartEvent("prefill", "w").to_dict()]})
    write(1, {"moved": [StartEvent("decode", "w2").to_dict(), DeltaEvent("x", 1, [7]).to_dict()]}, "writer-2")
    # seq 2 (more of "fed") never arrives
    write(3, {"fed": [DeltaEvent("three", 1, [3]).to_dict()],
              "fresh": [StartEvent("both", "w").to_dict(), DeltaEvent("new", 1, [9]).to_dict()]})
    reader.start()
    try:
        got: dict[str, list] = {"fed": [], "fresh": []}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (len(got["fed"]) < 3 or len(got["fresh"]) < 2):
            for rid, box in (("fed", fed), ("fresh", fresh)):
                got[rid] += box.take(0.1)
        assert [type(e).__name__ for e in got["fed"]] == ["StartEvent", "DeltaEvent", "ErrorEvent"]
        assert isinstance(got["fed"][-1], ErrorEvent) and got["fed"][-1].code == "events_lost"
        assert [type(e).__name__ for e in got["fresh"]] == ["StartEvent", "DeltaEvent"]
        # handed over to writer-2 before the hole: not writer-1's to fail
        assert [type(e).__name__ for e in moved.take(0.2)] == ["StartEvent", "StartEvent", "DeltaEvent"]
    finally:
        reader.stop()


def test_a_reader_keeps_reading_while_redis_refuses_its_lease(tmp_path):
    """Redis can refuse the reader's lease renewal (a write: out of memory under `noeviction`, MISCONF) while it
    still serves reads: the reader then went into its error pause before every read, so tokens already in its
    stream waited for the refusal to end. It now reads on. Here Redis refuses the write by ACL, mid-run."""
    from farm.config.processes import ReliabilityConfig
    from farm.gateway.replies import ReplyReader

    proc, url = start_redis(tmp_path / "refusing")
    try:
        admin = redis.Redis.from_url(url)
        admin.acl_setuser("reader", enabled=True, nopass=True, keys=["*"], commands=["+@all"])
        r = redis.Redis.from_url(url.replace("redis://", "redis://reader@"))
        reader = ReplyReader(r, ReliabilityConfig(lease_ttl_s=2))  # renewed every 0.5 s
        box = reader.open("r1")
        reader.start()
        try:
            admin.acl_setuser("reader", commands=["-set"])  # its lease's SET is refused from now on
            time.sleep(1.0)  # past a renewal
            admin.xadd(reply_stream_key(reader.reader_id),
                       {EVENT_FIELD: encode_reply("w", 1, {"r1": [DeltaEvent("still read", 1, [1]).to_dict()]})})
            got, deadline = [], time.monotonic() + 3
            while not got and time.monotonic() < deadline:
                got += box.take(0.1)
            assert [e.text for e in got] == ["still read"]
        finally:
            reader.stop()
    finally:
        proc.kill()
        proc.wait()


def test_a_reader_long_idle_is_forgotten_and_numbered_afresh_when_it_returns(redis_client, monkeypatch):
    """The writer kept one numbering per reader it ever answered (an API process life: gunicorn recycles its
    workers), for the worker's whole life. A reader idle for FORGET_READER_S with nothing open is forgotten; one
    with a request open is kept; a forgotten reader that returns is numbered from 1 under a new writer id, and
    its reply reader delivers that batch rather than skipping it as seen."""
    from types import SimpleNamespace

    from farm.config.processes import ReliabilityConfig
    from farm.gateway.replies import ReplyReader
    from farm.worker import stream_writer

    clock = [1000.0]  # the writer's clock only: the reader and the test's deadlines keep the real one
    monkeypatch.setattr(stream_writer, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=time.sleep))
    reader = ReplyReader(redis_client, ReliabilityConfig())
    w = StreamWriter(redis_client, flush_ms=10_000)
    quiet = [f"api-quiet-{i}" for i in range(50)]
    for i, rid in enumerate(quiet):
        w.open(rid, rid)
        w.emit(rid, DeltaEvent("x", 1, [i]))
        w.close(rid)
    for rid in ("a", "b"):
        w.open(rid, reader.reader_id)
        w.emit(rid, DeltaEvent(rid, 1, [1]))
        assert w.flush()
    w.close("a")
    w.open("kept", "api-busy")  # a request still open: its reader keeps its numbering however long it is quiet
    w.emit("kept", DeltaEvent("k", 1, [2]))
    assert w.flush() and w.readers_numbered() == 52
    first_writer = batches(redis_client, reader.reader_id)[-1].writer
    clock[0] += stream_writer.FORGET_READER_S + 1
    w.open("c", "api-new")
    w.emit("c", DeltaEvent("c", 1, [3]))
    assert w.flush()
    assert w.readers_numbered() == 3  # api-busy, api-new, and the reader that still has "b" open
    w.close("b")
    clock[0] += stream_writer.FORGET_READER_S + 1
    w.open("c2", "api-new")
    w.emit("c2", DeltaEvent("c", 1, [3]))
    assert w.flush() and w.readers_numbered() == 2  # its last request closed: the reader is forgotten
    box = reader.open("d")
    reader.start()
    try:
        deadline = time.monotonic() + 5  # the reader reads what came before its start too
        while time.monotonic() < deadline and not reader._seen:
            time.sleep(0.05)
        w.open("d", reader.reader_id)  # it returns: numbered again
        w.emit("d", DeltaEvent("back", 1, [4]))
        assert w.flush()
        last = batches(redis_client, reader.reader_id)[-1]
        assert last.seq == 1 and last.writer != first_writer
        got: list = []
        while time.monotonic() < deadline and not got:
            got += box.take(0.2)
        assert [e.text for e in got] == ["back"]
    finally:
        reader.stop()
