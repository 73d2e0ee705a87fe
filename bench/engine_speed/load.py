"""The load: closed-loop streams of streamed chat completions, and what each request looked like to the client.

N streams run at once; each sends its requests one after another (the next when the previous one ended), so
N requests are in flight until the last stream finishes. Every request: distinct prompt (bench.peers' persona
and question set, with a tag in the first block), `max_tokens`, `ignore_eos`, `temperature` 0, streamed,
`stream_options.include_usage`. aiohttp on uvloop, one connection per stream (connector limit 0).

Per request the client records its send time, the arrival of every content chunk, its end, the server's
`usage` (output tokens come from `usage.completion_tokens`, never from counting chunks: the farm merges the
tokens of `engine.stream_flush_ms` into one chunk, vLLM sends one per token), and the HTTP status. Errors are
counted, never raised: a non-200 answer, an exception or timeout, a stream without `usage` or without
`data: [DONE]`, or fewer output tokens than asked for all make a request an error, and a level with any
error is FAILED. The in-process engine (inproc.py) fills the same record.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.common import percentile
from bench.peers.load import chat_messages

try:
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - orjson comes with vLLM
    import json

    _loads = json.loads


@dataclass
class Request:
    """One request as the client saw it (seconds on time.perf_counter's clock)."""

    stream: int
    index: int
    sent: float = 0.0
    first: float | None = None  # first content chunk
    end: float | None = None
    chunks: list[float] = field(default_factory=list)  # arrival of every content chunk
    completion_tokens: int = 0
    prompt_tokens: int = 0
    status: int | None = None  # HTTP status; 200 for the in-process engine once it answered
    usage: bool = False
    done: bool = False  # saw `data: [DONE]`
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.first - self.sent if self.first is not None else None

    @property
    def latency(self) -> float | None:
        return self.end - self.sent if self.end is not None else None

    @property
    def gaps(self) -> list[float]:
        c = self.chunks
        return [b - a for a, b in zip(c, c[1:], strict=False)]

    @property
    def itl(self) -> float | None:
        """aiperf's inter-token latency: (last chunk - first chunk) / (tokens - 1)."""
        if self.first is None or self.completion_tokens < 2 or not self.chunks:
            return None
        return (self.chunks[-1] - self.first) / (self.completion_tokens - 1)

    def settle(self, max_tokens: int, http: bool = True) -> None:
        """Decide whether the request is an error (the first reason found is kept)."""
        if self.error:
            return
        if http and self.status != 200:
            self.error = f"HTTP {self.status}"
        elif http and not self.usage:
            self.error = "no usage in the stream"
        elif http and not self.done:
            self.error = "no data: [DONE]"
        elif self.completion_tokens < max_tokens:
            self.error = f"short: {self.completion_tokens} of {max_tokens} tokens"
        elif self.first is None:
            self.error = "no content chunk"

    def brief(self, t0: float) -> dict[str, Any]:
        """The request for the JSON: times relative to the level's start, in ms."""
        def ms(x: float | None) -> float | None:
            return round(x * 1000, 2) if x is not None else None

        gaps = self.gaps
        return {"stream": self.stream, "index": self.index, "sent_ms": ms(self.sent - t0), "ttft_ms": ms(self.ttft),
                "latency_ms": ms(self.latency), "chunks": len(self.chunks),
                "completion_tokens": self.completion_tokens, "prompt_tokens": self.prompt_tokens,
                "itl_ms": ms(self.itl), "max_gap_ms": ms(max(gaps)) if gaps else None, "status": self.status,
                "error": self.error}


def error_kind(err: str) -> str:
    """Errors grouped for the table: 'HTTP 503', 'short', 'TimeoutError', ..."""
    return err.split(":")[0][:60]


def summarize(records: list[Request], wall_s: float, t0: float, max_tokens: int) -> dict[str, Any]:
    """The level's figures (ms), its errors, and every request in brief."""
    ok = [r for r in records if not r.error]
    tokens = sum(r.completion_tokens for r in records)
    chunks = sum(len(r.chunks) for r in records)
    ttft = [x * 1000 for r in ok if (x := r.ttft) is not None]
    gaps = [g * 1000 for r in ok for g in r.gaps]
    itl = [x * 1000 for r in ok if (x := r.itl) is not None]
    lat = [x * 1000 for r in ok if (x := r.latency) is not None]
    errors = [r.error for r in records if r.error]
    return {
        "requests": len(records), "errors": len(errors), "failed": bool(errors),
        "error_kinds": dict(Counter(error_kind(e) for e in errors)), "error_examples": sorted(set(errors))[:5],
        "wall_s": wall_s, "output_tokens": tokens, "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "max_tokens": max_tokens,
        "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
        "gap_p50_ms": percentile(gaps, 0.5), "gap_p99_ms": percentile(gaps, 0.99),
        "itl_p50_ms": percentile(itl, 0.5), "latency_p50_ms": percentile(lat, 0.5),
        "latency_p99_ms": percentile(lat, 0.99),
        "tokens_per_chunk": tokens / chunks if chunks else None, "chunks": chunks,
        "prompt_tokens": sorted({r.prompt_tokens for r in records if r.prompt_tokens}),
        "raw": [r.brief(t0) for r in records],
    }


def request_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any], rec: Request,
                      timeout: aiohttp.ClientTimeout) -> None:
    """Send one streamed chat and fill `rec` as it arrives (so a cancelled request keeps what it got)."""
    rec.sent = time.perf_counter()
    try:
        async with session.post(url, json=body, timeout=timeout) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    rec.done = True
                    break
                chunk = _loads(data)
                if chunk.get("error"):
                    rec.error = f"error in stream: {str(chunk['error'])[:200]}"
                usage = chunk.get("usage")
                if usage:
                    rec.usage = True
                    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        t = time.perf_counter()
                        rec.chunks.append(t)
                        if rec.first is None:
                            rec.first = t
                        break
    except asyncio.CancelledError:
        rec.error = rec.error or "cancelled by the client"
        raise
    except Exception as e:  # noqa: BLE001 - counted, never raised
        rec.error = rec.error or f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        rec.end = time.perf_counter()


def raise_open_files(want: int) -> int:
    """Raise this process's soft open-files limit towards `want` (capped by the hard limit); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    return soft


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()


def run_async(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run a coroutine on a fresh uvloop loop (Python 3.11's asyncio.run has no loop_factory)."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(coro_fn())


def session(timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=30))


async def closed_loop(base_url: str, model: str, tag: str, streams: int, per_stream: int, max_tokens: int,
                      timeout_s: float = 600.0, deadline_s: float | None = None
                      ) -> tuple[list[Request], float, float]:
    """`streams` closed-loop streams of `per_stream` requests (fewer if `deadline_s` passes first: no request
    starts after it); the records, the wall time and the start time."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30)
    records: list[Request] = []
    async with session(timeout_s) as s:
        t0 = time.perf_counter()

        async def one_stream(i: int) -> None:
            for k in range(per_stream):
                if deadline_s is not None and k and time.perf_counter() - t0 > deadline_s:
                    return
                rec = Request(i, k)
                records.append(rec)
                await stream_chat(s, url, request_body(model, chat_messages(tag, i * per_stream + k), max_tokens),
                                  rec, timeout)

        await asyncio.gather(*(one_stream(i) for i in range(streams)))
        wall = time.perf_counter() - t0
    for r in records:
        r.settle(max_tokens)
    return records, wall, t0


def run_level(base_url: str, model: str, tag: str, streams: int, per_stream: int, max_tokens: int,
              timeout_s: float = 600.0, deadline_s: float | None = None) -> dict[str, Any]:
    """One level against an OpenAI-compatible server: summarize()'s dict (never raises for failed requests)."""
    raise_open_files(2 * streams + 256)
    records, wall, t0 = run_async(lambda: closed_loop(base_url, model, tag, streams, per_stream, max_tokens,
                                                      timeout_s, deadline_s))
    return summarize(records, wall, t0, max_tokens)


def warm_up(level: Callable[[str, int, int, int], dict[str, Any]]) -> dict[str, Any]:
    """Three short requests alone, then 4 at once (first-use costs at both batch sizes), outside any measured
    window; `level(tag, streams, per_stream, max_tokens)` runs them. Their errors are reported, not fatal."""
    alone = level("warmup-1", 1, 3, 16)
    four = level("warmup-4", 4, 1, 16)
    return {"errors": alone["errors"] + four["errors"],
            "examples": alone["error_examples"] + four["error_examples"]}
