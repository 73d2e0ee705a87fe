"""Item 10: the KV-transfer port, attacked over real sockets from both sides.

- A rogue client: a header that is not an object or nests deeply raised AttributeError/RecursionError
  (traceback, connection dropped without a reply); idle connections were never timed out and each held a
  thread (300 idle connections made 300 threads).
- A rogue server behind a validly signed handle: it announced `nbytes: 3000000000` and the decode worker
  grew from 2.5 to 5.5 GB before failing.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

from farm.transfer.handle import sign_handle
from farm.transfer.staging import StagingPool
from farm.transfer.tcp import TransferError, TransferServer, checksum, fetch_blocks, handle_nbytes

SECRET = b"s" * 32
LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "block_size": 4, "dtype": "float32"}


def handle(endpoint: str, **kw) -> dict:
    h = {"request_id": "r1", "worker_id": "w1", "endpoint": endpoint, "host_id": "elsewhere", "transport": "tcp",
         "block_ids": [1, 2], "block_hashes": ["1"], "num_tokens": 8, "first_token": 3, "cached_tokens": 0,
         "layout": LAYOUT, "checksum": "0", "expires_at": time.time() + 60, **kw}
    return sign_handle(h, SECRET)


@pytest.fixture
def server() -> Iterator[TransferServer]:
    def check(h: dict) -> None:
        raise TransferError("not held")  # nothing is held: a rogue client must get no further anyway

    srv = TransferServer("w1", SECRET, check, lambda ids, out=None: out, lambda rid: None, "127.0.0.1",
                         timeout_s=1.0, max_connections=8).start()
    yield srv
    srv.stop()


def exchange(port: int, payload: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        out = b""
        while not out.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


@pytest.mark.parametrize("payload", [
    b"[1, 2, 3]\n", b'"handle"\n', b"null\n", b"42\n",
    b"[" * 100_000 + b"]" * 100_000 + b"\n",
    b'{"handle": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}\n",
    b'{"handle": [1], "mode": "tcp"}\n', b'{"handle": {}, "mode": "bogus"}\n', b'{"mode": "tcp"}\n',
    b"\xff\xfe not json\n", b'{"handle": {"sig": 5}}\n',
])
def test_a_malformed_header_gets_an_error_reply(server, payload, caplog):
    reply = json.loads(exchange(server.port, payload))
    assert reply["ok"] is False and reply["error"]
    assert "Traceback" not in caplog.text


def read_to_eof(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_silent_peers_are_capped_and_the_longest_waiting_makes_room(server):
    """Threads stay within the cap (8 here): at the cap each newcomer takes the place of the connection that has
    waited longest for its header, which is closed; the ones left are dropped after the read timeout (1 s here)
    with an error reply; then the server serves again."""
    me = psutil.Process()
    before = me.num_threads()
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(40)]
    try:
        t0 = time.monotonic()
        while server.evicted < 40 - 8 and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert server.evicted == 40 - 8 and server.refused == 0
        assert me.num_threads() - before <= 8
        for s in idle[:32]:  # the oldest were closed for the newer
            assert b'"ok": true' not in read_to_eof(s, 5)
        t0 = time.monotonic()
        for s in idle[32:]:  # the newest 8: dropped after the timeout, with an error reply
            reply = json.loads(read_to_eof(s, 10))
            assert reply["ok"] is False and "timed out" in reply["error"]
        assert time.monotonic() - t0 < 10
        while me.num_threads() > before and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert me.num_threads() <= before
    finally:
        for s in idle:
            s.close()
    reply = json.loads(exchange(server.port, b"[]\n"))  # capacity is back
    assert reply["ok"] is False and "object" in reply["error"]


def test_a_real_pull_gets_through_while_idle_peers_hold_every_slot():
    """The listeners audit held the 64 slots with idle sockets: every pull was refused ("too many
    connections"), decode workers recomputed every prompt and the prefill kept its blocks held. A pull with a
    valid handle now takes the place of the longest-waiting idle peer, however many there are."""
    shape = (2, 2, 2, 4, 2, 4)
    data = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    released = []

    def read(ids, out=None):
        out.copy_(data)
        return out

    srv = TransferServer("w1", SECRET, lambda h: None, read, released.append, "127.0.0.1", timeout_s=30.0,
                         max_connections=8).start()
    endpoint = f"127.0.0.1:{srv.port}"
    idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(20)]
    try:
        time.sleep(0.5)  # every slot held by a peer that sends nothing (for 30 s here)
        for attempt in range(3):
            got = fetch_blocks(handle(endpoint, checksum=checksum(data), request_id=f"r{attempt}"), SECRET,
                               timeout=10, allow_shm=False)
            assert torch.equal(got, data)
        deadline = time.monotonic() + 5  # the server releases a pull's blocks once it has sent them
        while len(released) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert released == ["r0", "r1", "r2"] and srv.refused == 0 and srv.evicted >= 3
    finally:
        for s in idle:
            s.close()
        srv.stop()


class RogueServer(socketserver.ThreadingTCPServer):
    """Answers any pull with `reply` (then `payload` bytes, slowly if asked)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, reply: bytes, payload: bytes = b"", trickle_s: float = 0.0):
        outer = self

        class H(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                self.rfile.readline()
                self.wfile.write(outer.reply)
                self.wfile.flush()
                try:
                    for i in range(len(outer.payload)):
                        self.wfile.write(outer.payload[i:i + 1])
                        self.wfile.flush()
                        time.sleep(outer.trickle_s)
                except OSError:  # the puller gave up on us
                    pass

        self.reply, self.payload, self.trickle_s = reply, payload, trickle_s
        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


def _trickle(sock: socket.socket, stop: threading.Event, first: bytes) -> None:
    """Send a header's start, then a byte every 0.3 s (well inside the 1 s per-read timeout) until `stop`."""
    try:
        sock.sendall(first)
        while not stop.wait(0.3):
            sock.sendall(b"a")
    except OSError:  # the server cut us off
        pass


def test_a_peer_trickling_its_header_loses_its_slot_at_the_deadline(server):
    """The header has one deadline, not a timeout per read: peers sending a byte just before each timeout
    (before any authentication) are cut off, every slot of the cap with them, and a pull gets a slot again."""
    stop = threading.Event()
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    try:
        for s in socks:
            threading.Thread(target=_trickle, args=(s, stop, b'{"handle": {"x": "'), daemon=True).start()
        t0 = time.monotonic()
        for s in socks:  # each closed within its deadline: an error line, then EOF
            assert b"not received in time" in read_to_eof(s, 5)
        assert time.monotonic() - t0 < 3
        reply = json.loads(exchange(server.port, b"[]\n"))
        assert reply["ok"] is False and "object" in reply["error"]  # served, not "too many connections"
    finally:
        stop.set()
        for s in socks:
            s.close()


def test_a_server_trickling_its_answer_header_is_given_up_by_the_pulls_timeout():
    """The decode side too: a peer at the handle's endpoint that trickles its answer's header (no newline ever)
    does not hold the decode task past the pull's timeout."""
    rogue = RogueServer(b"", b'{"ok": true, "nbytes": ' + b" " * 100, trickle_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="not received in time"):
            fetch_blocks(handle(rogue.endpoint), SECRET, timeout=1.0)
        assert time.monotonic() - t0 < 3
    finally:
        rogue.shutdown()
        rogue.server_close()


class CountingPool(StagingPool):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def acquire(self, nbytes: int) -> torch.Tensor:
        self.asked.append(nbytes)
        return super().acquire(nbytes)


@pytest.mark.parametrize("reply", [
    b'{"ok": true, "nbytes": 3000000000}\n', b'{"ok": true, "nbytes": -1}\n', b'{"ok": true, "nbytes": "128"}\n',
    b'{"ok": true, "shm": "/dev/shm/farm-kv-' + b"0" * 32 + b'", "nbytes": 3000000000}\n',
    b"[1, 2]\n", b"[" * 50_000 + b"]" * 50_000 + b"\n", b'"ok"\n',
])
def test_a_rogue_server_cannot_make_the_puller_allocate(reply):
    rogue = RogueServer(reply)
    try:
        h = handle(rogue.endpoint)
        pool = CountingPool()
        rss = psutil.Process().memory_info().rss
        with pytest.raises(TransferError):
            fetch_blocks(h, SECRET, timeout=5, staging=pool)
        assert pool.asked == []  # nothing was allocated for the peer's claim
        assert psutil.Process().memory_info().rss - rss < 64 * 1024 * 1024
    finally:
        rogue.shutdown()
        rogue.server_close()


def test_a_trickling_server_is_cut_off():
    h = handle("127.0.0.1:1")
    nbytes = handle_nbytes(h)
    rogue = RogueServer(b'{"ok": true, "nbytes": %d}\n' % nbytes, b"\0" * nbytes, trickle_s=0.5)
    try:
        h = handle(rogue.endpoint)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="too slow"):
            fetch_blocks(h, SECRET, timeout=1)
        assert time.monotonic() - t0 < 30
    finally:
        rogue.shutdown()
        rogue.server_close()
