"""A native library's call on untrusted input, contained in a child process.

Some calls cannot be made safe by the caller: llguidance's grammar compiler recurses once per rule in a chain of
rule references, so a 37 KB grammar overflows the native stack and the process dies with SIGSEGV (no exception,
no 400: every stream the API process served goes with it), and its GBNF converter takes seconds of pure Python
for a few thousand rules. `Sandbox(target)` runs `target` (a "module:function" from JSON to JSON) in a long-lived
child process of its own, one call at a time, on a thread with a small stack (`stack_bytes`): a crash or a call
past `timeout_s` costs that call (`SandboxCrash`, `SandboxTimeout`) and the child, which the next call starts
again. The small stack is a margin too: what completes here completes on an engine's thread, whose stack is
larger.

The parent talks to the child over pipes with `select`, which gevent makes cooperative where it has patched the
process: a waiting greenlet lets the hub serve the other requests.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

_HEADER = struct.Struct(">I")  # each message: its length, then its JSON


class SandboxError(Exception):
    """The call did not complete in the child."""


class SandboxCrash(SandboxError):
    """The child died during the call (a native crash, or the memory bound)."""


class SandboxTimeout(SandboxError):
    """The call ran past its time; the child was killed."""


class Sandbox:
    """`call(arg)` runs `target(arg)` in the child process (started on the first call, and again after one died
    or was killed); an exception the target raises comes back as a RuntimeError with its text."""

    def __init__(self, target: str, timeout_s: float, stack_bytes: int = 2 << 20, memory_bytes: int = 2 << 30):
        self.target, self.timeout_s = target, timeout_s
        self.stack_bytes, self.memory_bytes = stack_bytes, memory_bytes
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = 0  # the process that started the child: a forked process starts its own
        self._lock = threading.Lock()

    def call(self, arg: Any) -> Any:
        with self._lock:
            proc = self._child()
            assert proc.stdin is not None and proc.stdout is not None
            deadline = time.monotonic() + self.timeout_s
            try:
                _write(proc.stdin.fileno(), json.dumps(arg).encode(), deadline)
                reply = json.loads(_read(proc.stdout.fileno(), deadline))
            except TimeoutError:
                self._stop()
                raise SandboxTimeout(f"took longer than {self.timeout_s:g} s") from None
            except (EOFError, OSError, ValueError):
                self._stop()
                raise SandboxCrash("the checking process died") from None
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["result"]

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._pid != os.getpid() or self._proc.poll() is not None:
            self._proc, self._pid = subprocess.Popen(
                [sys.executable, "-m", "farm.infra.sandbox", self.target, str(self.stack_bytes),
                 str(self.memory_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, close_fds=True), os.getpid()
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and self._pid == os.getpid():
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


def _write(fd: int, payload: bytes, deadline: float) -> None:
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        if not select.select([], [fd], [], _left(deadline))[1]:
            raise TimeoutError
        data = data[os.write(fd, data[:65536]):]


def _read(fd: int, deadline: float) -> bytes:
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    return _read_exactly(fd, size, deadline)


def _read_exactly(fd: int, size: int, deadline: float) -> bytes:
    parts, got = [], 0
    while got < size:
        if not select.select([fd], [], [], _left(deadline))[0]:
            raise TimeoutError
        chunk = os.read(fd, min(size - got, 1 << 20))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _left(deadline: float) -> float | None:
    if deadline == float("inf"):
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _serve(target: str, stack_bytes: int, memory_bytes: int) -> None:
    """The child: calls of `target`, one at a time, each on a thread with a `stack_bytes` stack, until its input
    ends (the parent closed it, or died)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    threading.stack_size(stack_bytes)
    stdin, stdout = sys.stdin.buffer.fileno(), sys.stdout.buffer.fileno()
    forever = float("inf")
    while True:
        try:
            arg = json.loads(_read(stdin, forever))
        except EOFError:
            return
        reply: dict[str, Any] = {}

        def run(arg: Any = arg, reply: dict[str, Any] = reply) -> None:
            try:
                reply["result"] = fn(arg)
            except Exception as e:  # noqa: BLE001 - the target's own error goes back to the caller
                reply["error"] = f"{type(e).__name__}: {e}"

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        _write(stdout, json.dumps(reply).encode(), forever)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
