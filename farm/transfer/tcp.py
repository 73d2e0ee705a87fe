"""The KV transfer server each worker runs, and the client decode workers use to pull held blocks.

One pull per connection. The client sends one JSON line `{"handle": {...}, "mode": "tcp"|"shm"}`; the
server verifies the handle (signature, expiry, that it names this worker and blocks it still holds)
before touching memory, then either
- tcp: answers `{"ok": true, "nbytes": N}` and streams the N raw bytes of the blocks
  `[layers, 2, n_blocks, block_size, kv_heads, head_dim]` (works across hosts), or
- shm (same host): gathers the blocks into a /dev/shm file, answers `{"ok": true, "shm": path, ...}`,
  and waits for the client's `{"done": true}` after it mapped the file;
or `{"ok": false, "error"}`. The held blocks are released once the pull is over. The receiver checks
the checksum carried by the (signed) handle.

Both ends treat the other as untrusted: the port is reachable by anything that can reach the worker.
The server parses the header with bounded nesting and checks its shape (an object with a `handle`
object and a known `mode`), answers any bad request with `{"ok": false, "error"}` instead of a
traceback, drops a peer silent for `timeout_s`, and serves at most `max_connections` at once (one
thread each). At the cap, a new connection takes the place of the one that has waited longest for its
header (before any authentication): a puller sends its header at once, so idle or trickling peers holding
every slot (which made every decode worker recompute its prompts, and kept the prefill's blocks held) can no
longer shut pulls out; only when every slot serves a verified pull is a newcomer refused. The client never allocates more than the signed handle
implies: a peer announcing other `nbytes` is refused before any buffer is taken, and a trickling peer
is cut off at a deadline.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from farm.protocol.jsonsafe import loads_bounded
from farm.transfer import shm
from farm.transfer.handle import HandleError, verify_handle
from farm.transfer.staging import StagingPool

log = logging.getLogger(__name__)

MAX_HEADER = 1 << 20
MAX_HEADER_DEPTH = 16  # a request is {handle: {layout: {...}, kv_transfer_params: {...}}}: a few levels
MODES = ("tcp", "shm", "nixl")
SERVER_TIMEOUT_S = 30.0  # a peer silent this long (header not sent, "done" never comes) is dropped
MAX_CONNECTIONS = 64  # pulls served at once; decode workers pull a few at a time
EVICTION_WAIT_S = 2.0  # at the cap, how long a newcomer waits for the slot of the connection closed for it
MIN_PULL_BYTES_PER_S = 10 << 20  # a pull slower than this on top of the timeout is cut off
ReadBlocks = Callable[..., torch.Tensor]  # read_blocks(block_ids, out=None) -> tensor


class TransferError(RuntimeError):
    """Blocks could not be pulled; the caller falls back to computing them."""


def checksum(data: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(_bytes_view(data))


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).cpu().numpy()).cast("B")


def parse_header(line: bytes) -> dict[str, Any]:
    """A peer's header line: a JSON object nesting at most MAX_HEADER_DEPTH deep, else TransferError."""
    try:
        obj = loads_bounded(line, MAX_HEADER_DEPTH)
    except ValueError as e:  # invalid JSON, bad encoding, too deep
        raise TransferError(f"bad transfer header: {e}") from None
    if not isinstance(obj, dict):
        raise TransferError(f"bad transfer header: a JSON object expected, got {type(obj).__name__}")
    return obj


def parse_request(line: bytes) -> tuple[Any, str]:
    """(handle, mode) of a pull request line; its shape is checked, the handle is verified after."""
    msg = parse_header(line)
    handle, mode = msg.get("handle"), msg.get("mode", "tcp")
    if not isinstance(handle, dict):
        raise TransferError("bad transfer header: 'handle' must be an object")
    if mode not in MODES:
        raise TransferError(f"bad transfer header: 'mode' must be one of {list(MODES)}")
    return handle, mode


def _send(wfile, obj: dict[str, Any]) -> None:
    wfile.write(json.dumps(obj).encode() + b"\n")
    wfile.flush()


def handle_shape(h: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype]:
    lay = h["layout"]
    shape = (lay["num_layers"], 2, len(h["block_ids"]), lay["block_size"], lay["num_kv_heads"], lay["head_dim"])
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise TransferError(f"bad KV layout in handle: {shape}")
    dtype = getattr(torch, str(lay["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"bad KV dtype in handle: {lay['dtype']!r}")
    return shape, dtype


def handle_nbytes(h: dict[str, Any]) -> int:
    """The exact size of the blocks a handle names: all a pull may ever allocate for it."""
    shape, dtype = handle_shape(h)
    return int(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())


class TransferServer:
    """Serves held blocks: `check(handle)` raises if they are not held, `read_blocks` gathers them,
    `release(request_id)` frees them after the pull, or when the decode says it will not pull them
    (`release_unpulled`)."""

    def __init__(self, worker_id: str, secret: bytes, check: Callable[[dict], None], read_blocks: ReadBlocks,
                 release: Callable[[str], None], bind_host: str = "0.0.0.0", port: int = 0,
                 nixl_source: Any = None, timeout_s: float = SERVER_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS):
        self.worker_id = worker_id
        self._secret, self._check, self._release = secret, check, release
        self.staging = StagingPool()
        self.refused = 0  # connections turned away at the cap
        self.evicted = 0  # connections still without a header, closed at the cap for a newcomer
        slots = threading.BoundedSemaphore(max_connections)
        waiting: dict[socket.socket, None] = {}  # connections not past their header yet, oldest first
        waiting_lock = threading.Lock()
        outer = self

        def evict_oldest_waiting() -> bool:
            with waiting_lock:
                oldest = next(iter(waiting), None)
                if oldest is None:
                    return False
                del waiting[oldest]
            outer.evicted += 1
            with contextlib.suppress(OSError):
                oldest.shutdown(socket.SHUT_RDWR)  # its thread's read ends now, and its slot is given back
            return True

        class Handler(socketserver.StreamRequestHandler):
            timeout = timeout_s  # applied to the connection: reads and writes of a silent peer time out

            def handle(self) -> None:
                try:
                    self._pull()
                except Exception as e:  # noqa: BLE001 - a peer must never get a traceback, nor kill us
                    log.warning("KV transfer from %s failed: %s: %s", self.client_address, type(e).__name__, e,
                                exc_info=not isinstance(e, OSError))  # a bug here, not a peer gone: its traceback
                    with contextlib.suppress(OSError):
                        _send(self.wfile, {"ok": False, "error": f"{type(e).__name__}: {e}"})

            def _pull(self) -> None:
                try:  # the header by one deadline: a peer trickling a byte per timeout would hold its slot for good
                    with waiting_lock:
                        waiting[self.connection] = None
                    try:
                        line, _ = _recv_line(self.connection, time.monotonic() + timeout_s)
                    finally:
                        with waiting_lock:
                            waiting.pop(self.connection, None)
                    self.connection.settimeout(timeout_s)
                    handle, mode = parse_request(line)
                    h = outer._held(handle)
                except (HandleError, TransferError, KeyError, ValueError) as e:
                    with contextlib.suppress(OSError):  # a peer gone (or closed at the cap for a newcomer): no log
                        _send(self.wfile, {"ok": False, "error": str(e)})
                    return
                try:
                    if mode == "nixl" and nixl_source is not None:
                        _send(self.wfile, {"ok": True, "nixl": nixl_source.offer(h["block_ids"])})
                        self.rfile.readline(MAX_HEADER)  # the puller's "done" after its READ completed
                    elif mode == "shm" and shm.available():
                        self._serve_shm(h)
                    else:
                        self._serve_tcp(h)
                finally:
                    release(h["request_id"])

            def _serve_tcp(self, h: dict[str, Any]) -> None:
                shape, dtype = handle_shape(h)
                nbytes = handle_nbytes(h)
                buf = outer.staging.acquire(nbytes)  # gather into touched memory: no page faults
                try:
                    read_blocks(h["block_ids"], out=buf.view(dtype).view(shape))
                    _send(self.wfile, {"ok": True, "nbytes": nbytes})
                    self.connection.sendall(memoryview(buf.numpy()).cast("B"))
                finally:
                    outer.staging.release(buf)

            def _serve_shm(self, h: dict[str, Any]) -> None:
                shape, dtype = handle_shape(h)
                path, nbytes = shm.export_to_shm(read_blocks, h["block_ids"], shape, dtype)
                try:
                    _send(self.wfile, {"ok": True, "shm": path, "nbytes": nbytes})
                    self.rfile.readline(MAX_HEADER)  # the client's "done" (or EOF if it gave up)
                finally:
                    shm.discard(path)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128  # listen backlog: a burst is accepted (and served or refused) at once

            def process_request(self, request: socket.socket, client_address: Any) -> None:
                admitted = slots.acquire(blocking=False) or (  # at the cap: the longest waiting for its header goes
                    evict_oldest_waiting() and slots.acquire(timeout=EVICTION_WAIT_S))
                if not admitted:  # every slot serves a verified pull: refuse now, spend no thread on it
                    outer.refused += 1
                    with contextlib.suppress(OSError):
                        request.settimeout(1.0)
                        request.sendall(b'{"ok": false, "error": "too many connections"}\n')
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    slots.release()
                    raise

            def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        self.server = Server((bind_host, port), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="kv-transfer", daemon=True)

    def _held(self, handle: Any) -> dict[str, Any]:
        """The handle, verified: signed with the farm's secret, made by this worker, its blocks still held
        (HandleError or TransferError otherwise)."""
        h = verify_handle(handle, self._secret)
        if h["worker_id"] != self.worker_id:
            raise HandleError("handle names another worker")
        self._check(h)
        return h

    def release_unpulled(self, handle: Any) -> bool:
        """Free the blocks of a handle its decode will not pull (its request was cancelled, or the pull failed and
        the decode computes the prompt itself), instead of holding them until the handle expires. Only a handle
        this worker signed, for blocks it still holds; returns whether they were freed."""
        try:
            h = self._held(handle)
        except (HandleError, TransferError, KeyError, ValueError, TypeError) as e:
            log.debug("release of an unpulled handle ignored: %s", e)
            return False
        self._release(h["request_id"])
        return True

    def start(self) -> TransferServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fetch_blocks(handle: dict[str, Any], secret: bytes, timeout: float = 30.0, allow_shm: bool = True,
                 nixl_name: str | None = None, device: torch.device | None = None,
                 info: dict[str, Any] | None = None, staging: StagingPool | None = None) -> torch.Tensor:
    """Pull the blocks a handle names: NIXL when both sides have it (`nixl_name` set), else shared
    memory when the handle's worker is on this host (and offers it), else TCP.
    Returns [layers, 2, n_blocks, block_size, kv_heads, head_dim]; `info` (if given) gets the transport
    used, the bytes moved and the seconds taken. TCP pulls land in a buffer from `staging` (the caller
    gives it back with `staging.release(result)` once done with it)."""
    try:
        h = verify_handle(handle, secret)
    except HandleError as e:
        raise TransferError(str(e)) from e
    host, _, port = str(h["endpoint"]).rpartition(":")
    shape, dtype = handle_shape(h)
    expected = handle_nbytes(h)
    offered = str(h["transport"]).split(",")
    use_shm = allow_shm and "shm" in offered and h.get("host_id") == shm.host_id()
    mode = "nixl" if nixl_name and "nixl" in offered else ("shm" if use_shm else "tcp")
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(json.dumps({"handle": h, "mode": mode}).encode() + b"\n")
            line, leftover = _recv_line(sock, time.monotonic() + timeout)
            sock.settimeout(timeout)
            head = parse_header(line)
            if not head.get("ok"):
                raise TransferError(f"transfer refused by {h['endpoint']}: {head.get('error')}")
            if "nixl" in head:
                from farm.transfer.nixl import nixl_read

                data = nixl_read(nixl_name, head["nixl"], shape, dtype, device or torch.device("cpu"),
                                 h["request_id"].encode(), timeout).cpu()
                sock.sendall(b'{"done": true}\n')
            elif "shm" in head:
                data = shm.import_from_shm(str(head["shm"]), _announced(head, expected), dtype, shape)
                sock.sendall(b'{"done": true}\n')
            else:
                nbytes = _announced(head, expected)
                buf = staging.acquire(nbytes) if staging is not None else StagingPool().acquire(nbytes)
                deadline = time.monotonic() + timeout + nbytes / MIN_PULL_BYTES_PER_S
                data = _receive(sock, buf, leftover, deadline).view(dtype).reshape(shape)
    except OSError as e:
        raise TransferError(f"cannot pull KV from {h['endpoint']}: {e}") from e
    except ValueError as e:
        raise TransferError(f"bad transfer from {h['endpoint']}: {e}") from e
    if checksum(data) != h["checksum"]:
        raise TransferError("KV checksum mismatch")
    if info is not None:
        info.update(transport=mode, bytes=data.numel() * data.element_size(), seconds=time.perf_counter() - t0)
    return data


def _announced(head: dict[str, Any], expected: int) -> int:
    """The peer's `nbytes`, which must be exactly what the signed handle implies (checked before any
    allocation: a rogue peer must not make us reserve gigabytes)."""
    n = head.get("nbytes")
    if not isinstance(n, int) or isinstance(n, bool) or n != expected:
        raise TransferError(f"peer announced {n!r} bytes; the handle's blocks are {expected} bytes")
    return n


def _recv_line(sock: socket.socket, deadline: float) -> tuple[bytes, bytes]:
    """Read a header line by `deadline` (monotonic), whatever the peer's pace: the line and whatever bytes arrived
    after it. A socket timeout bounds one read only, so a peer sending a byte just before each would hold the
    connection (and on the serving side its slot) as long as it liked."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError("timed out: transfer header not received in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise TransferError("timed out: transfer header not received in time") from None
        if not chunk:
            raise TransferError("connection closed before the transfer header")
        buf += chunk
        if len(buf) > MAX_HEADER:
            raise TransferError("transfer header too long")
    line, _, rest = buf.partition(b"\n")
    return line + b"\n", rest


def _receive(sock: socket.socket, buf: torch.Tensor, leftover: bytes = b"",
             deadline: float = float("inf")) -> torch.Tensor:
    """Receive straight into `buf` (recv_into, no intermediate buffers), by `deadline` (monotonic)."""
    nbytes = buf.numel()
    view = memoryview(buf.numpy()).cast("B")
    got = len(leftover)
    if got > nbytes:
        raise TransferError("peer sent more than it announced")
    view[:got] = leftover
    while got < nbytes:
        if time.monotonic() > deadline:
            raise TransferError(f"pull too slow: {got} of {nbytes} bytes by the deadline")
        n = sock.recv_into(view[got:], min(nbytes - got, 1 << 20))
        if not n:
            raise TransferError("connection closed mid-transfer")
        got += n
    return buf
