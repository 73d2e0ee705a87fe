"""TCP transport: each worker runs a small transfer server; decode workers pull held blocks from it.

Works between processes on one host (loopback) and across hosts. Protocol, one pull per connection:
client sends one JSON line `{"handle": {...}}`; the server verifies the handle (signature, expiry, that it
names this worker and blocks it holds), answers one JSON line `{"ok": true, "nbytes": N}` and then N raw
bytes of the blocks `[layers, 2, n_blocks, block_size, kv_heads, head_dim]`, or `{"ok": false, "error"}`.
The blocks are released on the server once sent. The receiver checks the checksum from the handle.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from farm.transfer.handle import HandleError, verify_handle

log = logging.getLogger(__name__)

MAX_HEADER = 1 << 20


class TransferError(RuntimeError):
    """Blocks could not be pulled; the caller falls back to computing them."""


def checksum(data: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(_bytes_view(data))


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).cpu().numpy()).cast("B")


def _read_line(sock_file) -> dict[str, Any]:
    line = sock_file.readline(MAX_HEADER)
    if not line.endswith(b"\n"):
        raise TransferError("truncated transfer header")
    return json.loads(line)


class TransferServer:
    """Serves held blocks. `export(handle) -> tensor` reads them; `release(request_id)` frees them."""

    def __init__(self, worker_id: str, secret: bytes, export: Callable[[dict], torch.Tensor],
                 release: Callable[[str], None], bind_host: str = "0.0.0.0", port: int = 0):
        self.worker_id = worker_id
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    msg = _read_line(self.rfile)
                    h = verify_handle(msg.get("handle"), secret)
                    if h["worker_id"] != outer.worker_id:
                        raise HandleError("handle names another worker")
                    data = export(h)
                except (HandleError, TransferError, KeyError, ValueError) as e:
                    self.wfile.write(json.dumps({"ok": False, "error": str(e)}).encode() + b"\n")
                    return
                view = _bytes_view(data)
                self.wfile.write(json.dumps({"ok": True, "nbytes": len(view)}).encode() + b"\n")
                self.wfile.write(view)
                self.wfile.flush()
                release(h["request_id"])

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server((bind_host, port), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="kv-transfer", daemon=True)

    def start(self) -> TransferServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fetch_blocks(handle: dict[str, Any], secret: bytes, timeout: float = 30.0) -> torch.Tensor:
    """Pull the blocks a handle names; returns [layers, 2, n_blocks, block_size, kv_heads, head_dim]."""
    try:
        h = verify_handle(handle, secret)
    except HandleError as e:
        raise TransferError(str(e)) from e
    host, _, port = str(h["endpoint"]).rpartition(":")
    lay = h["layout"]
    shape = (lay["num_layers"], 2, len(h["block_ids"]), lay["block_size"], lay["num_kv_heads"], lay["head_dim"])
    dtype = getattr(torch, lay["dtype"])
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(json.dumps({"handle": h}).encode() + b"\n")
            f = sock.makefile("rb")
            head = _read_line(f)
            if not head.get("ok"):
                raise TransferError(f"transfer refused by {h['endpoint']}: {head.get('error')}")
            nbytes = int(head["nbytes"])
            buf = torch.empty(nbytes, dtype=torch.uint8)
            view = memoryview(buf.numpy()).cast("B")
            got = 0
            while got < nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise TransferError("connection closed mid-transfer")
                got += n
    except OSError as e:
        raise TransferError(f"cannot pull KV from {h['endpoint']}: {e}") from e
    data = buf.view(dtype).reshape(shape)
    if checksum(data) != h["checksum"]:
        raise TransferError("KV checksum mismatch")
    return data
