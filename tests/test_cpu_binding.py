"""Where vLLM workers compute on a CPU host (farm.backends.cpu_binding): core shares per worker, the engine core
kept on its worker's share, and vLLM's processes lowered in priority; checked on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from farm.backends.cpu_binding import (
    BIND_ENV,
    bind_env,
    core_shares,
    engine_core_cpus,
    lower_priority,
    parse_cpu_list,
    pin_threads,
    usable_cores,
)


def test_core_shares_split_the_cores_and_one_worker_keeps_vllms_own_binding():
    assert core_shares([0, 1], 2) == ["0", "1"]
    assert core_shares([0, 1, 2, 3, 4], 2) == ["0,1,2", "3,4"]
    assert core_shares([0, 1], 3) == ["0", "1", "0"]  # more workers than cores: one core each, reused
    assert core_shares([0, 1, 2, 3], 1) == ["auto"]
    assert bind_env(1, 2, environ={}) == {BIND_ENV: core_shares(usable_cores(), 2)[1]}
    assert bind_env(0, 2, environ={BIND_ENV: "3"}) == {}  # the user's bind wins
    assert bind_env(0, 1, environ={}) == {}


@pytest.mark.parametrize(("spec", "cores"), [
    ("0", [0]), ("0-3", [0, 1, 2, 3]), ("0-1,5", [0, 1, 5]), ("0-1|4-5", [0, 1, 4, 5]), (" 2 , 3 ", [2, 3]),
    ("auto", []), ("nobind", []), ("", []),
])
def test_parse_cpu_list_reads_vllms_syntax(spec, cores):
    assert parse_cpu_list(spec) == cores


def test_the_engine_core_follows_the_workers_bind():
    assert engine_core_cpus({BIND_ENV: "1"}) == [1]
    assert engine_core_cpus({BIND_ENV: "auto"}) == []  # vLLM keeps a core for its engine core itself
    assert engine_core_cpus({}) == []


@pytest.fixture()
def child():
    """A real process with a second thread (Python's main thread plus a sleeping one)."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 10
    while len(os.listdir(f"/proc/{p.pid}/task")) < 2:
        assert time.monotonic() < deadline, "the child's thread did not start"
        time.sleep(0.02)
    yield p
    p.kill()
    p.wait()


def test_pin_threads_sets_every_threads_affinity(child):
    core = usable_cores()[-1]
    tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
    assert pin_threads([child.pid], [core]) == len(tids) >= 2
    assert all(os.sched_getaffinity(t) == {core} for t in tids)
    assert pin_threads([2**22 + 7], [core]) == 0  # a process that is gone is skipped


def test_lower_priority_sets_every_threads_nice_and_never_raises_it(child):
    tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
    assert lower_priority([child.pid], 5) == len(tids)
    assert all(os.getpriority(os.PRIO_PROCESS, t) == 5 for t in tids)
    assert lower_priority([child.pid], 3) == 0  # already lower: left as it is
