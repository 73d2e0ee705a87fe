"""The semantic layer on the generation routes: run it, answer blocks and cache hits here, count it.

farm.semantic decides (guards, cache, category, model, system prompt); this module turns a decision into
HTTP: the `x-vsr-*` headers, a local answer (JSON or SSE) with `finish_reason` `content_filter` (a guard)
or `stop` (a cache hit), and the Prometheus counters. Nothing here reaches a worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from flask import Response, jsonify, request

from api.auth import request_tenant
from farm.models.tokenization import template_reads
from farm.openai.parsing import local_params
from farm.openai.reasoning import THINKING_FLAG
from farm.openai.responses import Choice, ChunkWriter, full_response
from farm.semantic.layer import (
    H_FALLBACK,
    H_FAST,
    H_INJECTED,
    H_JB_BLOCKED,
    H_MODEL,
    H_REASONING_APPLIED,
    SemanticLayer,
    Verdict,
    fallback_value,
)
from farm.telemetry import prometheus

log = logging.getLogger(__name__)
NO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}  # nothing was generated


def no_cache_requested() -> bool:
    """`Cache-Control: no-cache` (or no-store): skip the semantic cache's lookup and store."""
    cc = request.headers.get("Cache-Control", "").lower()
    return "no-cache" in cc or "no-store" in cc


def answer_fits(answer: str, body: dict, tokenizer) -> bool:
    """Whether a cached answer honours this request's own length: no more tokens than its `max_tokens` (or
    `max_completion_tokens`). Sampling settings are not compared: a cached answer is one valid sample. (A request
    with stop sequences or another constraint on its answer never reaches the cache: api/routes/openai.py.)"""
    params, _, _, _ = local_params(body)
    return len(tokenizer.encode(answer, add_special_tokens=False)) <= params.max_tokens


def decide(layer: SemanticLayer | None, model: str, messages: list[dict], *, scope: str, no_cache: bool,
           inject: bool = True, fits: Callable[[Verdict], bool] | None = None) -> Verdict:
    """The layer's verdict, counted; without a layer (disabled) the request passes unchanged.
    `inject=False` (text completions: no system prompt to put anything in) keeps the messages as sent.
    `fits` vets a cache hit against the request (see `answer_fits`); a hit that does not fit is
    generated instead, and not stored again. `scope` (required: the request's KV cache salt, `request_scope`)
    keeps the layer's memo and cache and MoM's look at the KV index to the caller; what it stores counts against
    its key's owner's share of the cache (`request_tenant`)."""
    if layer is None:
        return SemanticLayer.passthrough(model, messages)
    t0 = time.perf_counter()
    v = layer.before(model, messages, no_cache=no_cache, scope=scope, tenant=request_tenant())
    if v.action == "cached" and fits is not None and not fits(v):
        v = v.as_miss()
    prometheus.SEMANTIC_SECONDS.observe(time.perf_counter() - t0)
    remote = v.explain.get("jailbreak", {}).get("remote")
    if remote:
        prometheus.SEMANTIC_REMOTE_ASKED.inc(remote["asked"])
        if "ms" in remote:
            prometheus.SEMANTIC_REMOTE_SECONDS.observe(remote["ms"] / 1000)
        if "error" in remote:
            prometheus.SEMANTIC_REMOTE_ERRORS.inc()
    if v.action == "block":
        guard = ("jailbreak" if H_JB_BLOCKED in v.headers else
                 "fast_response" if H_FAST in v.headers else "pii")
        prometheus.SEMANTIC_BLOCKS.labels(guard=guard).inc()
    elif "cache" in v.timings_ms:
        prometheus.SEMANTIC_CACHE.labels(result="hit" if v.action == "cached" else "miss").inc()
    if layer.is_alias(model) and v.action != "block":
        prometheus.SEMANTIC_ROUTES.labels(category=v.category or "none", model=v.model).inc()
    if not inject and v.headers.get(H_INJECTED):
        v.headers.pop(H_INJECTED)
        v.messages = messages
    return v


def reasoning_template_kwargs(v: Verdict, tokenizer, client_kwargs: Any = None) -> dict[str, Any]:
    """The chat-template variables that carry the category's reasoning mode to the answering model, and
    `x-vsr-reasoning-applied` on the verdict: true when the model's template reads `enable_thinking`
    (the farm applies chat templates for every backend, vLLM included), false when it cannot honour it or
    when the client's own `chat_template_kwargs` set it (the client's choice wins, as in vLLM)."""
    if v.reasoning is None:
        return {}
    applied = template_reads(tokenizer, THINKING_FLAG) and not (
        isinstance(client_kwargs, dict) and THINKING_FLAG in client_kwargs)
    v.headers[H_REASONING_APPLIED] = "true" if applied else "false"
    return {THINKING_FLAG: v.reasoning} if applied else {}


def answer_locally(kind: str, rid: str, v: Verdict, stream: bool, include_usage: bool,
                   header_id: str | None = None, choices: int = 1) -> Response:
    """A blocked request or a cache hit, answered by the API: the verdict's text as each of the `choices` the
    request asked for (its prompts times n: a client pairs choice i*n+j with its own prompt); `rid` is the
    response's id, `header_id` its x-request-id (the client's own, when it sent one; else `rid`)."""
    prometheus.REQUESTS.labels(model=v.model, status="200").inc()  # blocks are counted by SEMANTIC_BLOCKS too
    headers = {"x-request-id": header_id or rid, **v.headers}
    if not stream:
        one = Choice(v.answer or "", v.finish_reason or "stop")
        resp = jsonify(full_response(kind, rid, v.model, [one] * choices, NO_USAGE))
        resp.headers.update(headers)
        return resp
    resp = Response(_chunks(kind, rid, v, include_usage, choices), mimetype="text/event-stream", headers=headers)
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    return resp


def _chunks(kind: str, rid: str, v: Verdict, include_usage: bool, choices: int = 1) -> Iterator[str]:
    w = ChunkWriter(kind, rid, v.model)
    for index in range(choices):
        first = w.role(index)
        if first:
            yield first
        for piece in _word_pieces(v.answer or ""):
            yield w.delta(piece, index)
        yield w.finish(v.finish_reason or "stop", index)
    if include_usage:
        yield w.usage(NO_USAGE)
    yield w.done()


def _word_pieces(text: str, words: int = 8) -> Iterator[str]:
    """The answer in chunks of a few words (whitespace kept), as a generated stream would arrive."""
    parts = text.split(" ")
    for i in range(0, len(parts), words):
        piece = " ".join(parts[i:i + words])
        yield piece if i + words >= len(parts) else piece + " "


def fallback_headers(tried: list[str], model: str, reason: str) -> dict[str, str]:
    """The x-vsr-* headers of a request MoM's model handed to the category's next one before its first token."""
    return {H_MODEL: model, H_FALLBACK: fallback_value(tried, model, reason)}


def store(layer: SemanticLayer | None, v: Verdict, text: str, finish_reason: str) -> None:
    """After a complete generated answer: into the semantic cache (the layer decides whether it may)."""
    if layer is None or v.cache_query is None:
        return
    try:
        layer.after(v, text, finish_reason)
    except Exception:  # noqa: BLE001 - a cache that cannot store must not fail an answered request
        log.exception("semantic cache: could not store an answer")
