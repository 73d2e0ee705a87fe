"""Thousands of concurrent streaming clients on one asyncio loop, and a gate that keeps their requests queued.

Shared by `bench/api_streams.py` and the 500-stream test (tests/security/test_api_connections.py). The
clients speak raw HTTP/1.1 over asyncio sockets: one connection per stream, no client-side pool limit (an
HTTP library's pool would cap the concurrency it is meant to measure), and the moment of every byte known.

The gate (`consumers_paused`) tells the farm's workers to stop taking tasks from their queues (Celery's own
`cancel_consumer` control command) and to resume afterwards, so every request a client sends stays queued
and its stream stays open at the API for as long as the measurement needs: the API's capacity is measured,
not how fast the engine drains its queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from farm.cluster import registry
from farm.config import FarmConfig
from farm.protocol.keys import active_key

REFUSED_STATUSES = (429, 503)  # the farm sheds load up front with these (Retry-After)


@dataclass
class StreamOutcome:
    """What one client saw; times are seconds from the moment its request was written."""

    status: int | None = None  # HTTP status; None: no response at all
    error: str = ""  # why the stream did not end cleanly ("" when it did)
    connected: bool = False
    ttft_s: float | None = None  # first content delta
    end_s: float | None = None
    deltas: int = 0
    done: bool = False  # ended with `data: [DONE]`

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error

    @property
    def refused(self) -> bool:
        """Not served: no connection, or shed up front (503/429) before any stream began."""
        return not self.connected or self.status in REFUSED_STATUSES

    @property
    def broken(self) -> bool:
        return not self.ok and not self.refused


def stream_body(model: str, i: int, max_tokens: int) -> dict[str, Any]:
    """A streaming text completion of a few-token prompt that differs per client: the farm's work per
    stream stays small (no chat template to prefill), so thousands of streams end in bounded time."""
    return {"model": model, "prompt": f"{i}:", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def raise_fd_limit(want: int) -> int:
    """Lift this process's open-files limit towards `want` (up to the hard limit); returns the new one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def _request(host: str, port: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nAccept: text/event-stream\r\nConnection: close\r\n\r\n")
    return head.encode() + data


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> Any:
    """The response body as it arrives (chunked transfer coding undone)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                return
            chunk = await reader.readexactly(size + 2)
            yield chunk[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()


def _on_event(out: StreamOutcome, data: str, t0: float) -> None:
    if data == "[DONE]":
        out.done = True
        return
    obj = json.loads(data)
    if "error" in obj:
        out.error = f"error chunk: {obj['error'].get('message')}"
        return
    for choice in obj.get("choices") or []:
        if (choice.get("delta") or {}).get("content") or choice.get("text"):  # chat or text completion
            out.deltas += 1
            if out.ttft_s is None:
                out.ttft_s = time.monotonic() - t0


async def _stream(host: str, port: int, body: dict[str, Any], connecting: asyncio.Semaphore,
                  out: StreamOutcome) -> None:
    async with connecting:  # bound the connects in flight (a SYN storm only measures the kernel)
        reader, writer = await asyncio.open_connection(host, port)
        out.connected = True
        writer.write(_request(host, port, body))
        await writer.drain()
    t0 = time.monotonic()
    try:
        status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        out.status = int(status_line.split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
        buf = ""
        async for chunk in _body_chunks(reader, headers):
            buf += chunk.decode()
            while "\n\n" in buf:
                event, buf = buf.split("\n\n", 1)
                for line in event.splitlines():
                    if line.startswith("data: "):
                        _on_event(out, line[6:], t0)
        if out.status != 200:
            out.error = f"HTTP {out.status}: {buf[:200]}"
        elif not out.done:
            out.error = "stream ended without [DONE]"
    finally:
        out.end_s = time.monotonic() - t0
        writer.close()


async def _guarded(host: str, port: int, body: dict[str, Any], connecting: asyncio.Semaphore,
                   timeout_s: float) -> StreamOutcome:
    out = StreamOutcome()
    try:
        await asyncio.wait_for(_stream(host, port, body, connecting, out), timeout_s)
    except TimeoutError:  # before OSError, of which it is a subclass
        out.error = out.error or f"no end within {timeout_s:.0f}s"
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
        out.error = out.error or f"{type(e).__name__}: {e}"
    return out


def run_streams(host: str, port: int, bodies: Sequence[dict[str, Any]], timeout_s: float,
                max_connecting: int = 256) -> list[StreamOutcome]:
    """Open one stream per body, all at once, and read each to its end; outcomes in the bodies' order."""
    raise_fd_limit(len(bodies) + 256)

    async def main() -> list[StreamOutcome]:
        connecting = asyncio.Semaphore(max_connecting)
        return list(await asyncio.gather(*(_guarded(host, port, b, connecting, timeout_s) for b in bodies)))

    return asyncio.run(main())


def leases(r: redis.Redis) -> int:
    """Requests placed and not yet ended (the gateway's decode load entries, one per request in flight): with the
    workers paused, the streams the API holds open."""
    return sum(int(r.zcard(k)) for k in r.scan_iter(match=active_key("d", "*"), count=1000))


@contextlib.contextmanager
def consumers_paused(cfg: FarmConfig, r: redis.Redis) -> Iterator[None]:
    """Every live worker stops consuming its queues until the block ends (Celery's cancel/add_consumer)."""
    from farm.infra.broker import make_celery

    app = make_celery(cfg)
    paused = [(w.worker_id, q) for w in registry.live_workers(r) for q in w.queues]
    try:
        for wid, queue in paused:
            if not app.control.cancel_consumer(queue, destination=[wid], reply=True, timeout=10):
                raise RuntimeError(f"worker {wid} did not answer cancel_consumer({queue})")
        yield
    finally:
        for wid, queue in paused:
            app.control.add_consumer(queue, destination=[wid], reply=True, timeout=10)
        app.close()


@dataclass
class Hold:
    """The result of `hold_streams`."""

    outcomes: list[StreamOutcome]
    held: int  # most requests the API held open at once (leases seen while the gate was closed)
    held_after_s: float  # from the first connect until `held` was reached
    measured: dict[str, Any]  # what `measure()` returned while they were held


def hold_streams(cfg: FarmConfig, r: redis.Redis, host: str, port: int, bodies: Sequence[dict[str, Any]],
                 hold_timeout_s: float, timeout_s: float, measure: Callable[[], dict[str, Any]] | None = None
                 ) -> Hold:
    """Send every body as a stream while the workers take no task, wait until the API holds them all (or
    `hold_timeout_s` passes), call `measure()`, then let the workers go and read every stream to its end."""
    results: list[StreamOutcome] = []
    client = threading.Thread(target=lambda: results.extend(run_streams(host, port, bodies, timeout_s)),
                              name="stream-clients", daemon=True)
    with consumers_paused(cfg, r):
        t0 = time.monotonic()
        client.start()
        held, held_at = 0, 0.0
        while time.monotonic() - t0 < hold_timeout_s and client.is_alive():
            n = leases(r)
            if n > held:
                held, held_at = n, time.monotonic() - t0
            if held >= len(bodies):
                break
            time.sleep(0.2)
        measured = measure() if measure is not None else {}
    client.join(timeout_s + 60)
    if client.is_alive():
        raise RuntimeError("the stream clients did not finish")
    return Hold(results, held, held_at, measured)
