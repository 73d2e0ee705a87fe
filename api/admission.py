"""Slow request bodies, and one key's share of the connections (issue 26 item 2).

gunicorn's async workers bound the request head (`api.header_timeout_s`) but read the body with no deadline:
4,300 POSTs of one key announcing 1,000 bytes and sending one every 10 s held every connection
(`api.worker_connections`), and /health/live and every chat timed out for as long as they lasted. Two rules
close that; both live in `Admission`, a WSGI wrapper around the Flask app, so they hold for every route and
every way a body is read (api/bodies.py's JSON with or without Content-Length, werkzeug's multipart parser
for /v1/files):

- **A deadline for the body** (`api.body_timeout_s`, `api.body_min_rate`): the body must have arrived
  `body_timeout_s` after the request head, plus one second for every `body_min_rate` bytes received
  (Apache's `RequestReadTimeout body=..,MinRate=..`: an upload at a fair rate is never cut, however
  large), and no wait for its next bytes may be longer than `body_timeout_s` (nginx's
  `client_body_timeout`). Past that the read raises `BodyTimeout`: 408 `request_timeout` in OpenAI's
  error shape, and the connection is closed (it stopped mid-body: its framing is lost). Bytes the client
  sent that still wait unread in the socket count as received: a server that fell behind (its hub busy
  for seconds) does not blame the client. Under gevent a timer on the hub interrupts a read blocked on the
  socket, the way `gevent.Timeout` does, after that check; in a process gevent did not patch (the Flask
  test client, whose input is in memory) the deadline is checked between reads, and gevent is never
  imported.
- **Requests in progress per key** (`api.limits.max_concurrent_requests`, per API process, "auto" = half
  of `api.worker_connections`): a slot is taken right after the key is checked, before the body is read
  (`admit`, called by api/auth.py), and given back when the server closes the response, which it does
  after the last byte (for a stream: when the stream ends), when the client left, and on any error. A
  request over the cap gets 429 with Retry-After at once and its connection is closed, so one key never
  holds every connection and /health/live keeps answering.
"""

from __future__ import annotations

import fcntl
import struct
import termios
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from flask import Flask, current_app, request

from farm.infra.cooperative import cooperative
from farm.openai.api_error import APIError

RELEASE_KEY = "farm.admission.release"  # environ: gives this request's slot back (idempotent)
CLOSE_KEY = "farm.admission.close"  # environ: close the connection after this response
RETRY_AFTER_S = 1
_PIECE = 16 * 1024  # the server's input is read in pieces this large, so received bytes are credited promptly


class _Late(BaseException):  # noqa: N818 - thrown into a reader whose body is late, like gevent.Timeout
    """Interrupts a read of the body (a BaseException, so no `except Exception` on the way swallows it)."""


class BodyTimeout(APIError):
    """The request body did not arrive in time: 408, and the connection is closed."""

    def __init__(self, received: int, elapsed_s: float, min_rate: int):
        rate = f", or at least {min_rate} bytes per second" if min_rate else ""
        super().__init__(408, f"The request body did not arrive in time ({received} bytes in {elapsed_s:.0f}s): "
                         f"send it promptly{rate}.", code="request_timeout")


class DeadlineInput:
    """The server's `wsgi.input`, read under the body's deadline (see the module's doc)."""

    def __init__(self, stream: Any, environ: dict[str, Any], timeout_s: float, min_rate: int, started: float):
        self._stream = stream
        self._environ = environ
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.started = started
        self.received = 0
        self.expired = False

    def _wait_s(self, pending: int = 0) -> float:
        """How long the next read may wait: to the deadline (counting `pending` bytes as received too), and at
        most `timeout_s`; 0 or less: the body is late."""
        credit = (self.received + pending) / self.min_rate if self.min_rate else 0.0
        return min(self.started + self.timeout_s + credit - time.monotonic(), self.timeout_s)

    def _pending(self) -> int:
        """Bytes the client sent that wait unread in the socket's receive queue (FIONREAD: no read, no wait).
        They count as received when the time is up: a server that fell behind (a hub busy for seconds) must
        not charge its own delay to the client, which did send."""
        sock = self._environ.get("gunicorn.socket")
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
        except (AttributeError, OSError, ValueError, struct.error):
            return 0

    def _late(self) -> bool:
        return self._wait_s() <= 0 and ((pending := self._pending()) == 0 or self._wait_s(pending) <= 0)

    def _expire(self) -> BodyTimeout:
        self.expired = True
        self._environ[CLOSE_KEY] = True
        return BodyTimeout(self.received, time.monotonic() - self.started, self.min_rate)

    def _call(self, fn: Callable[..., bytes], *args: Any) -> bytes:
        if self.expired or self._late():
            raise self._expire()
        data = self._timed(fn, args) if cooperative() else fn(*args)  # unpatched: checked between reads only
        self.received += len(data)
        return data

    def _timed(self, fn: Callable[..., bytes], args: tuple[Any, ...]) -> bytes:
        """`fn(*args)` on gevent's hub, interrupted once its wait is over, unless by then the client's bytes
        are waiting in the socket (then the wait goes on, as far as they earn). The decision is taken in the
        timer's callback, before interrupting: a read of gunicorn's body cut in the middle cannot go on."""
        import gevent  # only in a process gevent patched: the module imports without it

        hub, reader, late = gevent.get_hub(), gevent.getcurrent(), _Late()
        timers = []

        def arm(wait: float) -> None:
            timer = hub.loop.timer(max(wait, 0.001))
            timers.append(timer)
            timer.start(fire)

        def fire() -> None:
            pending = self._pending()
            wait = self._wait_s(pending) if pending else 0.0
            if wait > 0:
                arm(wait)
            else:
                reader.throw(late)

        arm(self._wait_s())
        try:
            return fn(*args)
        except _Late as e:
            if e is not late:
                raise
            raise self._expire() from None
        finally:
            for timer in timers:
                timer.close()

    def read(self, size: int | None = -1) -> bytes:
        want = None if size is None or size < 0 else size
        parts, got = [], 0
        while want is None or got < want:
            piece = self._call(self._stream.read, _PIECE if want is None else min(_PIECE, want - got))
            if not piece:
                break
            parts.append(piece)
            got += len(piece)
        return b"".join(parts)

    def readline(self, size: int | None = -1) -> bytes:
        return self._call(self._stream.readline, -1 if size is None else size)

    def readlines(self, hint: int | None = -1) -> list[bytes]:
        lines, total = [], 0
        while line := self.readline():
            lines.append(line)
            total += len(line)
            if hint is not None and 0 < hint <= total:
                break
        return lines

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line

    def close(self) -> None:  # no readinto, nor any other attribute of the stream: each would skip the deadline
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()


def _has_body(environ: dict[str, Any]) -> bool:
    return environ.get("CONTENT_LENGTH", "") not in ("", "0") or \
        "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()


def _release(environ: dict[str, Any]) -> None:
    release = environ.pop(RELEASE_KEY, None)
    if release is not None:
        release()


class _ReleasingIterable:
    """A response iterable whose `close` (called by the server after the last byte, on a client that left,
    and on errors) also gives the request's slot back."""

    def __init__(self, inner: Iterable[bytes], environ: dict[str, Any]):
        self._inner = inner
        self._environ = environ

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._inner)

    def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            _release(self._environ)


def _force_close(start_response: Callable[..., Any]) -> None:
    """Have the server close the connection after this response. gunicorn drops a `Connection: close` header
    from the application; its Response (start_response's owner) has `force_close` for that."""
    force = getattr(getattr(start_response, "__self__", None), "force_close", None)
    if callable(force):
        force()


class Admission:
    """WSGI wrapper: the body's deadline around `wsgi.input`, the connection closed after a 408 or a refusal,
    and the request's slot given back when the response is closed."""

    def __init__(self, wsgi_app: Callable[..., Any], timeout_s: float, min_rate: int):
        self.wsgi_app = wsgi_app
        self.timeout_s = timeout_s
        self.min_rate = min_rate

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if _has_body(environ) and environ.get("wsgi.input") is not None:
            environ["wsgi.input"] = DeadlineInput(environ["wsgi.input"], environ, self.timeout_s, self.min_rate,
                                                  time.monotonic())
        try:
            result = self.wsgi_app(environ, start_response)
        except BaseException:
            _release(environ)
            raise
        if environ.get(CLOSE_KEY):
            _force_close(start_response)
        if RELEASE_KEY not in environ:
            return result
        file_wrapper = environ.get("wsgi.file_wrapper")
        if isinstance(file_wrapper, type) and isinstance(result, file_wrapper):
            # keep the server's own type (gunicorn sends it with sendfile): chain the release to its close
            inner_close = getattr(result, "close", None)

            def close() -> None:
                try:
                    if inner_close is not None:
                        inner_close()
                finally:
                    _release(environ)

            result.close = close
            return result
        return _ReleasingIterable(result, environ)


class InFlight:
    """Requests in progress per owner in this process, at most `limit` each (0 = unlimited)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()  # gevent's lock once patched; never held across a wait

    def count(self, owner: str) -> int:
        return self._counts.get(owner, 0)

    def acquire(self, owner: str) -> Callable[[], None] | None:
        """A function that gives the slot back (once, however often called), or None when `owner` is at the
        limit."""
        with self._lock:
            n = self._counts.get(owner, 0)
            if self.limit and n >= self.limit:
                return None
            self._counts[owner] = n + 1
        done = False

        def release() -> None:
            nonlocal done
            with self._lock:
                if done:
                    return
                done = True
                left = self._counts.get(owner, 0) - 1
                if left > 0:
                    self._counts[owner] = left
                else:
                    self._counts.pop(owner, None)

        return release


def admit(owner: str) -> None:
    """Take a slot for this request of `owner`, or refuse it with 429 (the connection is closed after it)."""
    inflight: InFlight | None = current_app.extensions.get("farm_inflight")
    if inflight is None or not inflight.limit or RELEASE_KEY in request.environ:
        return
    release = inflight.acquire(owner)
    if release is None:
        request.environ[CLOSE_KEY] = True
        raise APIError(429, f"Too many requests in progress for this API key: at most {inflight.limit} at once. "
                       f"Wait for one to finish (retry in {RETRY_AFTER_S}s).", type="requests",
                       code="concurrency_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
    request.environ[RELEASE_KEY] = release


def install(app: Flask) -> None:
    """The body deadline and the per-key cap for `app` (settings from its farm configuration)."""
    api = app.extensions["farm"].cfg.api
    app.extensions["farm_inflight"] = InFlight(api.max_concurrent_per_key())
    app.wsgi_app = Admission(app.wsgi_app, api.body_timeout_s, api.body_min_rate)
