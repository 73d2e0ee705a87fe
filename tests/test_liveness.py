"""Whether a worker a request depends on is gone (farm.cluster.liveness), on a real redis-server: its heartbeat,
its process on this host, and its id registered again by a later process (a restart, on any host)."""

from __future__ import annotations

import socket
import subprocess
import sys

from farm.cluster import registry
from farm.cluster.liveness import process_of, processes_gone
from farm.protocol.keys import alive_key


def info(worker_id: str, started_at: float, host: str = "elsewhere", pid: int = 1) -> registry.WorkerInfo:
    return registry.WorkerInfo(worker_id, "both", "m", host, pid, 16, started_at=started_at)


def worker_gone(r, worker_id: str, known: registry.WorkerInfo | None = None) -> bool:
    """One process's answer (`known`: the record the caller holds; None: whichever is registered now)."""
    return bool(processes_gone(r, {process_of(worker_id, known): known}))


def test_a_worker_is_gone_when_its_heartbeat_lapses(redis_client):
    first = info("w-1", 100.0)
    registry.register(redis_client, first)
    assert not worker_gone(redis_client, "w-1", first)
    redis_client.delete(alive_key("w-1"))
    assert worker_gone(redis_client, "w-1", first) and worker_gone(redis_client, "w-1")


def test_a_worker_registered_again_by_a_later_process_is_gone_for_the_earlier_one(redis_client):
    """The supervisor restarts a worker under the same id, often before its heartbeat could lapse: requests of the
    earlier process must still see it gone (another host: no pid to check), requests of the new one must not."""
    first, again = info("w-1", 100.0), info("w-1", 160.0)
    registry.register(redis_client, first)
    registry.register(redis_client, again)
    old, new = process_of("w-1", first), process_of("w-1", again)
    assert processes_gone(redis_client, {old: first, new: again}) == {old}  # one round trip, both processes
    assert not worker_gone(redis_client, "w-1")  # no record given: the registered one, which is alive


def test_on_this_host_a_dead_pid_is_gone_before_its_heartbeat_lapses(redis_client):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = info("w-2", 0.0, socket.gethostname(), int(done.stdout))  # a reused pid started later: gone too
    registry.register(redis_client, dead)
    assert worker_gone(redis_client, "w-2", dead)


def test_the_reply_reader_tells_a_restarted_worker_from_the_process_that_died(redis_client):
    """Two requests were on a worker that died; one has already moved to its restart (same id, later process).
    The other must still see its process gone, and the moved one must see its own alive."""
    import time

    from farm.config.processes import ReliabilityConfig
    from farm.gateway.replies import ReplyReader

    first, again = info("w-3", 100.0), info("w-3", 160.0)
    registry.register(redis_client, first)
    reader = ReplyReader(redis_client, ReliabilityConfig(check_interval_s=0.05)).start()
    try:
        stayed, moved = reader.watch("w-3", first), reader.watch("w-3", first)
        reader.unwatch(moved)
        registry.register(redis_client, again)  # the restart, before the old heartbeat could lapse
        restarted = reader.watch("w-3", again)
        deadline = time.monotonic() + 5
        while not reader.gone(stayed) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reader.gone(stayed) and not reader.gone(restarted)
    finally:
        reader.stop()


def test_a_reader_prunes_a_lapsed_record_but_never_one_registered_since_it_looked(redis_client):
    """live_workers reads the records, then their heartbeats, then prunes the lapsed ones. A worker that registered
    again in between (a restart, or a reader racing a flush) must keep the record it just wrote."""
    registry.register(redis_client, info("w-3", 100.0))
    registry.register(redis_client, info("w-4", 100.0))
    redis_client.delete(alive_key("w-3"), alive_key("w-4"))
    registry.register(redis_client, info("w-4", 160.0))  # w-4 came back after the reader saw both lapsed
    registry.prune(redis_client, ["w-3", "w-4"])
    assert sorted(k.decode() for k in redis_client.hkeys(registry.WORKERS_KEY)) == ["w-4"]
    assert [w.worker_id for w in registry.live_workers(redis_client, model="m")] == ["w-4"]


def test_a_reader_that_lost_redis_waits_a_heartbeat_s_lifetime_before_judging_by_heartbeats(tmp_path):
    """Redis away for longer than a heartbeat's lifetime lets every worker's heartbeat lapse, the live ones' too:
    the reader judged them all gone once Redis was back and migrated every request (computed twice). After the
    reader itself could not reach Redis, a lapsed heartbeat alone now counts only once the workers had
    HEARTBEAT_TTL_S to beat again: a worker that beats stays alive, one that does not is gone after it."""
    import time

    import redis

    from farm.config.processes import ReliabilityConfig
    from farm.gateway.replies import ReplyReader
    from tests.conftest import start_redis

    proc, url = start_redis(tmp_path / "r")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    r = redis.Redis.from_url(url, socket_timeout=1)
    live, dead = info("w-live", 100.0), info("w-dead", 100.0)
    for w in (live, dead):
        registry.register(r, w)
    reader = ReplyReader(r, ReliabilityConfig(check_interval_s=0.1)).start()
    try:
        procs = {w.worker_id: reader.watch(w.worker_id, w) for w in (live, dead)}
        time.sleep(0.3)
        assert not any(reader.gone(p) for p in procs.values())
        proc.terminate()
        proc.wait()
        time.sleep(1.0)  # the reader meets refused connections
        proc, _ = start_redis(tmp_path / "r", port)
        r.delete(alive_key("w-live"), alive_key("w-dead"))  # both lapsed while Redis was away
        back = time.monotonic()
        while time.monotonic() - back < registry.HEARTBEAT_TTL_S - 1.5:
            assert not any(reader.gone(p) for p in procs.values())  # the old code: both gone within 0.2 s
            if time.monotonic() - back > 1.0:
                registry.heartbeat(r, "w-live")  # the live worker beats again; the dead one never
            time.sleep(0.1)
        deadline = time.monotonic() + 4
        while not reader.gone(procs["w-dead"]) and time.monotonic() < deadline:
            registry.heartbeat(r, "w-live")
            time.sleep(0.1)
        assert reader.gone(procs["w-dead"]) and not reader.gone(procs["w-live"])
    finally:
        reader.stop()
        proc.kill()
        proc.wait()


def test_a_clock_step_makes_no_live_process_another(redis_client, monkeypatch):
    """psutil's create_time is the start on the wall clock, worked out again at each read: a clock step (NTP, a
    resumed virtual machine) moves it. Told apart by the start since boot, a live worker stays alive and a record of
    another start is still gone; the supervisor's and the vLLM reaper's checks read the same."""
    import dataclasses
    import os
    import time

    import psutil

    from farm.cluster.liveness import _process_gone
    from farm.infra.process_identity import same_process, started_since_boot
    from farm.supervisor.procs import _pid_alive

    me = os.getpid()
    since = started_since_boot(me)
    live = registry.WorkerInfo("w-1", "both", "m", socket.gethostname(), me, 16, started_at=time.time() - 5,
                               since_boot=since)
    wall = psutil.Process(me).create_time()
    real_boot = psutil._pslinux.boot_time
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real_boot() + 90.0)  # the clock stepped 90 s on
    assert psutil.Process(me).create_time() > wall + 60  # psutil's start moved with the step
    assert same_process(me, since) and _pid_alive(me, since)
    registry.register(redis_client, live)
    assert not worker_gone(redis_client, "w-1", live) and not _process_gone(live)
    assert _process_gone(dataclasses.replace(live, since_boot=since - 10))  # a reused pid: another start
    assert not same_process(me, since - 10) and not _pid_alive(me, since - 10)


def test_a_reader_waits_a_heartbeat_s_lifetime_after_the_wall_clock_stepped_forward(redis_client):
    """Redis expires keys by the wall clock: a step forward (a resumed virtual machine) lapses every heartbeat at
    once. The reader sees the step and judges by heartbeats again only once the workers had HEARTBEAT_TTL_S to beat:
    a worker that beats stays alive, one that does not is gone after it."""
    import time

    from farm.config.processes import ReliabilityConfig
    from farm.gateway.replies import ReplyReader

    live, dead = info("w-live", 100.0), info("w-dead", 100.0)
    for w in (live, dead):
        registry.register(redis_client, w)
    reader = ReplyReader(redis_client, ReliabilityConfig(check_interval_s=0.1)).start()
    try:
        procs = {w.worker_id: reader.watch(w.worker_id, w) for w in (live, dead)}
        time.sleep(0.3)
        assert not any(reader.gone(p) for p in procs.values())
        reader._wall = lambda: time.time() + 90.0  # the clock steps 90 s on: both heartbeats lapse in Redis
        redis_client.delete(alive_key("w-live"), alive_key("w-dead"))
        stepped = time.monotonic()
        while time.monotonic() - stepped < registry.HEARTBEAT_TTL_S - 1.5:
            assert not any(reader.gone(p) for p in procs.values())  # without the step seen: both gone at once
            if time.monotonic() - stepped > 1.0:
                registry.heartbeat(redis_client, "w-live")  # the live worker beats again; the dead one never
            time.sleep(0.1)
        deadline = time.monotonic() + 4
        while not reader.gone(procs["w-dead"]) and time.monotonic() < deadline:
            registry.heartbeat(redis_client, "w-live")
            time.sleep(0.1)
        assert reader.gone(procs["w-dead"]) and not reader.gone(procs["w-live"])
    finally:
        reader.stop()
