"""The farm's vLLM plugin (farm/backends/vllm_plugin.py) on vLLM's own shared-memory ring: a reader it patched waits
by blocking, not by spinning, still gets every message in order, and vLLM finds the plugin through its entry point;
and the setting that asks for it (`models[].vllm.ring_wait`) with its defaults per device."""

from __future__ import annotations

import multiprocessing
import random
import resource
import threading
import time
from contextlib import contextmanager

import pytest

from farm.backends import vllm_plugin
from farm.backends.cpu_binding import ring_wait
from farm.config import VllmOptions

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
SPAWN = multiprocessing.get_context("spawn")  # vLLM's processes are spawned, and a ring's handle crosses as they do


@pytest.fixture
def ring_class(monkeypatch):
    """vLLM's SpinCondition, restored after the test whatever the test patched."""
    cls = shm_broadcast.SpinCondition
    monkeypatch.setattr(cls, "wait", cls.wait)
    monkeypatch.setattr(cls, "notify", cls.notify)
    monkeypatch.setattr(cls, "_farm_blocking", False, raising=False)
    return cls


@pytest.fixture
def pair(ring_class):
    """A writer's and a reader's SpinCondition over a real ZeroMQ notification socket."""
    import zmq
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = ring_class(is_reader=False, context=context, notify_address=address)
    reader = ring_class(is_reader=True, context=context, notify_address=address)
    time.sleep(0.2)  # the subscription reaches the publisher
    yield writer, reader
    context.destroy(linger=0)


class _Recorded:
    """A zmq.Poller stand-in that records the timeouts it was asked for."""

    def __init__(self, poller):
        self.poller, self.timeouts = poller, []

    def poll(self, timeout=None):
        self.timeouts.append(timeout)
        return self.poller.poll(timeout=timeout)


def test_vllms_reader_spins_after_a_read_and_a_patched_one_blocks(pair, ring_class, monkeypatch):
    writer, reader = pair
    yields = []
    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: yields.append(1))
    reader.poller = recorded = _Recorded(reader.poller)

    reader.record_read()
    reader.wait(timeout_ms=5000)  # vLLM's own: a read just now, so it spins (yields and returns)
    assert yields == [1] and recorded.timeouts == []

    vllm_plugin.block_ring_waits(ring_class)
    reader.record_read()
    t0 = time.monotonic()
    reader.wait(timeout_ms=5000)  # nothing written: it sleeps in the poll, cut at POLL_MS
    assert time.monotonic() - t0 < 0.5
    assert yields == [1] and recorded.timeouts == [vllm_plugin.POLL_MS]


def test_an_idle_patched_reader_keeps_vllms_idle_wait(pair, ring_class):
    writer, reader = pair
    vllm_plugin.block_ring_waits(ring_class)
    vllm_plugin.block_ring_waits(ring_class)  # vLLM loads plugins more than once: the second is a no-op
    reader.poller = recorded = _Recorded(reader.poller)
    reader.last_read = time.monotonic() - 2 * vllm_plugin.ACTIVE_S  # idle: no read for two seconds
    wake = threading.Timer(0.05, writer.notify)  # the next message, while the reader waits
    wake.start()
    t0 = time.monotonic()
    reader.wait(timeout_ms=3000)
    wake.join()
    assert recorded.timeouts == [3000]  # not woken every millisecond while the engine has nothing to do
    assert time.monotonic() - t0 < 1.0  # but at once by the writer's notification


def test_a_patched_writers_notifications_are_not_dropped(pair, ring_class):
    """vLLM's writer drops a notification sent within about a millisecond of the previous one, although that one was
    delivered (its high-water mark of 1, and ZeroMQ's throttled reading of its peer's "taken"); a blocking reader
    then sleeps through a message. The patched writer's every notification arrives."""
    writer, reader = pair

    def delivered(rounds: int) -> int:
        got = 0
        for _ in range(rounds):
            writer.notify()
            if reader.poller.poll(timeout=200):
                reader.local_notify_socket.recv()
                got += 1
        return got

    assert delivered(40) < 40  # vLLM's own: the quick second notification of a round trip goes missing
    vllm_plugin.block_ring_waits(ring_class)
    assert delivered(200) == 200


def _echo(handle, count: int, handles) -> None:
    """A spawned process that sends back every message of one ring on another, both with the plugin applied."""
    from vllm.distributed.device_communicators import shm_broadcast as sb

    vllm_plugin.block_ring_waits(sb.SpinCondition)
    inbox = sb.MessageQueue.create_from_handle(handle, 0)
    outbox = sb.MessageQueue(n_reader=1, n_local_reader=1)
    handles.put(outbox.export_handle())
    inbox.wait_until_ready()
    outbox.wait_until_ready()
    for _ in range(count):
        outbox.enqueue(inbox.dequeue(timeout=30))


def test_patched_rings_hand_messages_back_and_forth_without_waiting_for_the_cut(ring_class):
    """The engine core and its executor: a step out, its result back, at once. A lost notification shows as a round
    trip as long as the patched reader's cut (POLL_MS); with vLLM's writer about half of them were."""
    vllm_plugin.block_ring_waits(ring_class)
    count = 300
    outbox = shm_broadcast.MessageQueue(n_reader=1, n_local_reader=1)
    handles = SPAWN.Queue()
    inbox = None
    try:
        with _spawned(_echo, outbox.export_handle(), count, handles):
            inbox = shm_broadcast.MessageQueue.create_from_handle(handles.get(timeout=60), 0)
            outbox.wait_until_ready()
            inbox.wait_until_ready()
            slow = 0
            for i in range(count):
                t0 = time.monotonic()
                outbox.enqueue(i)
                assert inbox.dequeue(timeout=30) == i
                slow += time.monotonic() - t0 >= 0.8 * vllm_plugin.POLL_MS / 1000
    finally:
        _close(outbox, inbox)
    assert slow <= count // 50, slow  # a loaded machine may stall a few; lost notifications stall about half


def _read(handle, count: int, out) -> None:
    """A spawned process reading the ring as vLLM's engine core does, with the farm's plugin applied."""
    from vllm.distributed.device_communicators import shm_broadcast as sb

    vllm_plugin.block_ring_waits(sb.SpinCondition)
    ring = sb.MessageQueue.create_from_handle(handle, 0)
    ring.wait_until_ready()
    cpu0 = _cpu()
    got = [ring.dequeue(timeout=30) for _ in range(count)]
    out.put((got, _cpu() - cpu0))


@contextmanager
def _spawned(target, *args):
    """`target(*args)` in a spawned process, waited for (then killed) however the test's part ends."""
    process = SPAWN.Process(target=target, args=args, daemon=True)
    process.start()
    try:
        yield process
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()


def _close(*rings) -> None:
    """Close a ring's ZeroMQ sockets without lingering (None: a ring never made): a failed test's pending
    notifications must not hang pytest's exit in the context's termination."""
    import zmq

    for ring in filter(None, rings):
        for owner in (ring, ring._spin_condition):
            for value in vars(owner).values():
                if isinstance(value, zmq.Socket):
                    value.close(linger=0)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_a_patched_reader_gets_every_message_in_order_without_spinning(ring_class):
    count = 120
    ring = shm_broadcast.MessageQueue(n_reader=1, n_local_reader=1)
    out = SPAWN.Queue()
    try:
        with _spawned(_read, ring.export_handle(), count, out):
            ring.wait_until_ready()
            rng = random.Random(7)
            sent = 0
            t0 = time.monotonic()
            while sent < count:  # bursts of 1-3 messages, 0-40 ms apart: over a second of waiting
                for _ in range(min(rng.randint(1, 3), count - sent)):
                    ring.enqueue({"i": sent, "pad": "x" * rng.randint(0, 2000)})
                    sent += 1
                time.sleep(rng.random() * 0.04)
            wall = time.monotonic() - t0
            got, cpu = out.get(timeout=60)
    finally:
        _close(ring)
    assert [m["i"] for m in got] == list(range(count))
    # vLLM's own reader spins through all of it (about a core for the whole time); this one sleeps between messages
    assert wall > 1.0
    assert cpu < 0.25 * wall, (cpu, wall)


def test_vllm_finds_the_plugin_through_its_entry_point(monkeypatch):
    from vllm.plugins import load_plugins_by_group

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert vllm_plugin.NAME in load_plugins_by_group(vllm_plugin.GROUP)
    assert vllm_plugin.why_not_installed() is None
    monkeypatch.setenv("VLLM_PLUGINS", "someone_elses")
    assert "VLLM_PLUGINS" in vllm_plugin.why_not_installed()


def test_register_patches_only_when_the_farm_asked(ring_class, monkeypatch):
    spin_wait = ring_class.wait
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    vllm_plugin.register()  # `vllm serve` from the same virtualenv: untouched
    assert ring_class.wait is spin_wait
    monkeypatch.setenv(vllm_plugin.ENV, "spin")
    vllm_plugin.register()
    assert ring_class.wait is spin_wait
    monkeypatch.setenv(vllm_plugin.ENV, vllm_plugin.BLOCK)
    vllm_plugin.register()
    assert ring_class.wait is not spin_wait and ring_class._farm_blocking


def test_ring_wait_defaults_per_device_and_the_setting_wins():
    assert ring_wait(None, "cpu") == "block"
    assert ring_wait(None, "cuda") == "spin"
    assert ring_wait("spin", "cpu") == "spin"
    assert ring_wait("block", "cuda") == "block"
    assert VllmOptions().ring_wait is None
    assert VllmOptions(ring_wait="block").ring_wait == "block"
    with pytest.raises(ValueError, match="ring_wait"):
        VllmOptions(ring_wait="sleep")
