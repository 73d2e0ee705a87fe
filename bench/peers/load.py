"""The single-engine workload and its one client: streamed chats at a fixed number of concurrent clients.

Every HTTP contender gets the same requests from the same client (aiohttp, one connection per client):
greedy, `ignore_eos`, a fixed number of output tokens, `stream_options.include_usage` so the token count
is the server's own. Each client sends its requests one after another (a closed loop), so "16 clients"
means 16 requests in flight until the last ones finish. The in-process engine (inprocess.py) runs the
same prompts as token ids and reports through the same `RequestTiming`.

Per request: TTFT = first content chunk - send; ITL = (last chunk - first chunk) / (tokens - 1), the
definition aiperf uses, so servers that send several tokens per SSE chunk (the farm flushes every
`engine.stream_flush_ms`) are not favoured or penalised by their chunking.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from bench.common import percentile
from bench.engine import PERSONAS, QUESTIONS

WARM_UP_CLIENTS = (1, 4)


@dataclass
class RequestTiming:
    """One request as the client saw it (seconds on time.perf_counter's clock)."""

    sent: float
    first: float
    last: float
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int = 0
    text: str = ""  # the completion (a multi-turn client sends it back in the next turn)
    worker: str = ""  # the farm's x-farm-decode-worker header, where it has one
    model: str = ""  # the model that answered (the chunks' `model`: MoM's choice on the farm)
    vsr: dict[str, str] = field(default_factory=dict)  # the farm's x-vsr-* headers (selection, fallback)

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def itl(self) -> float | None:
        return (self.last - self.first) / (self.completion_tokens - 1) if self.completion_tokens > 1 else None


def chat_messages(tag: str, i: int) -> list[dict[str, str]]:
    """Request `i` of a set: a persona and question from bench.engine, with `tag` first in the system
    prompt so the first KV block differs between sets (no prefix-cache help across rounds or levels)."""
    persona, question = PERSONAS[i % len(PERSONAS)], QUESTIONS[(i * 7) % len(QUESTIONS)]
    return [{"role": "system", "content": f"Session {tag}-{i}. You are {persona}. Answer in a few clear sentences."},
            {"role": "user", "content": question}]


def request_sets(tag: str, clients: int, per_client: int) -> list[list[list[dict[str, str]]]]:
    """`clients` lists of `per_client` conversations each, all distinct."""
    return [[chat_messages(tag, c * per_client + k) for k in range(per_client)] for c in range(clients)]


def summarize_level(timings: list[RequestTiming], wall_s: float) -> dict[str, Any]:
    """Output tok/s over the level's wall time, TTFT and ITL percentiles (ms), and the raw requests."""
    tokens = sum(t.completion_tokens for t in timings)
    ttft = [t.ttft * 1000 for t in timings]
    itl = [x * 1000 for t in timings if (x := t.itl) is not None]
    return {
        "requests": len(timings), "output_tokens": tokens, "wall_s": wall_s,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
        "itl_p50_ms": percentile(itl, 0.5), "itl_p99_ms": percentile(itl, 0.99),
        "prompt_tokens": sorted({t.prompt_tokens for t in timings}),
        "cached_tokens": sum(t.cached_tokens for t in timings),
        "raw": [asdict(t) for t in timings],
    }


async def stream_chat(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, str]],
                      max_tokens: int) -> RequestTiming:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    usage: dict[str, Any] = {}
    text: list[str] = []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:500]}")
        worker = resp.headers.get("x-farm-decode-worker", "")
        vsr = {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("x-vsr-")}
        model_seen = ""
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            model_seen = model_seen or chunk.get("model", "")
            if chunk.get("usage"):
                usage = chunk["usage"]
            content = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])
            if content:
                last = time.perf_counter()
                first = first or last
                text.append(content)
    if first is None or not usage:
        raise RuntimeError(f"{url}: stream ended without content or usage (usage={usage})")
    details = usage.get("prompt_tokens_details") or {}
    return RequestTiming(sent, first, last, int(usage["completion_tokens"]), int(usage["prompt_tokens"]),
                         int(details.get("cached_tokens") or 0), "".join(text), worker, model_seen, vsr)


async def _run_level(base_url: str, model: str, sets: list[list[list[dict[str, str]]]], max_tokens: int,
                     timeout_s: float) -> tuple[list[RequestTiming], float]:
    url = base_url.rstrip("/") + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(convs: list[list[dict[str, str]]]) -> list[RequestTiming]:
            return [await stream_chat(session, url, model, m, max_tokens) for m in convs]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(client(s) for s in sets))
        wall = time.perf_counter() - t0
    return [t for ts in per_client for t in ts], wall


def run_http_level(base_url: str, model: str, tag: str, clients: int, per_client: int, max_tokens: int,
                   timeout_s: float = 900) -> dict[str, Any]:
    """One concurrency level against an OpenAI-compatible server; summarize_level's dict."""
    timings, wall = asyncio.run(_run_level(base_url, model, request_sets(tag, clients, per_client), max_tokens,
                                           timeout_s))
    return summarize_level(timings, wall)


def warm_up_http(base_url: str, model: str, max_tokens: int = 16) -> None:
    """Short chats outside any measured set, alone and then 4 at once (first-use costs at both batch sizes)."""
    for clients in WARM_UP_CLIENTS:
        run_http_level(base_url, model, f"warmup{clients}", clients=clients, per_client=1, max_tokens=max_tokens)
