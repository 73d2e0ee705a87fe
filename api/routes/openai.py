"""OpenAI routes: /v1/chat/completions, /v1/completions (stream and not), /v1/models.

A generation request is validated and tokenized here, handed to the Gateway, and answered from the
request's event stream. Whatever way a request ends before its `done` event (client gone, timeout,
Redis error), the submission is cancelled so the worker stops generating for nobody.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis
from flask import Blueprint, Response, current_app, jsonify

from api.auth import metered
from api.bodies import json_body
from api.errors import APIError, to_api_error
from api.responses import ChunkWriter, full_response
from api.schemas import (
    ParsedRequest,
    parse_chat,
    parse_completion,
    require_model,
    stream_flags,
    validate_chat,
)
from api.semantic import answer_fits, answer_locally, completion_messages, decide, no_cache_requested, store
from farm import metrics
from farm.config import ModelConfig
from farm.gateway import BusyError, NoWorkersError, Submission
from farm.protocol import GenerationRequest

log = logging.getLogger(__name__)
bp = Blueprint("openai", __name__, url_prefix="/v1")


def _farm():
    return current_app.extensions["farm"]


def _json_body() -> Any:
    """The request body as strict JSON (UTF-8, no NaN/Infinity, bounded depth: api.bodies); 413 when over
    api.max_body_bytes."""
    return json_body()


# --- models -------------------------------------------------------------------------------------
@bp.get("/models")
def list_models() -> Response:
    return jsonify({"object": "list", "data": _model_cards()})


@bp.get("/models/<path:model_id>")
def get_model(model_id: str) -> Response:
    for card in _model_cards():
        if card["id"] == model_id:
            return jsonify(card)
    raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")


def _model_cards() -> list[dict[str, Any]]:
    """Every configured model, then the semantic layer's aliases ("MoM": the layer chooses)."""
    cfg = _farm().cfg
    cards = [_model_card(m) for m in cfg.models]
    for alias in _aliases():
        cards.append({"id": alias, "object": "model", "created": _farm().started, "owned_by": "inference-farm",
                      "max_model_len": max(m.max_model_len for m in cfg.models),
                      "description": "semantic routing: the farm picks the model per request"})
    return cards


def _aliases() -> list[str]:
    sem = _farm().cfg.semantic
    return list(sem.aliases) if sem.enabled else []


def _model_card(m: ModelConfig) -> dict[str, Any]:
    return {"id": m.name, "object": "model", "created": _farm().started, "owned_by": "inference-farm",
            "max_model_len": m.max_model_len}


# --- generation -----------------------------------------------------------------------------------
@bp.post("/chat/completions")
def chat_completions() -> Response:
    return _generate("chat")


@bp.post("/completions")
def completions() -> Response:
    return _generate("completion")


def _safe_cancel(sub: Submission) -> None:
    """Cancel unless finished; never raises (a cancel that cannot reach Redis is logged)."""
    if sub.finished:
        return
    try:
        sub.cancel()
    except redis.RedisError as e:
        log.warning("request %s: could not cancel: %s", sub.request_id, e)


def _worker_headers(rid: str, sub: Submission, ev: dict[str, Any]) -> dict[str, str]:
    """x-farm-* headers from the decode/both start event or the done event (both name the workers)."""
    return {
        "x-request-id": rid,
        "x-farm-prefill-worker": str(ev.get("prefill_worker") or ""),
        "x-farm-decode-worker": str(ev.get("decode_worker") or ev.get("worker") or ""),
        "x-farm-prefill": str(ev.get("prefill") or ""),
        "x-farm-router-mode": sub.router_mode,
        "x-farm-router-overlap-tokens": str(sub.predicted_overlap_tokens),
    }


def _generate(kind: str) -> Response:
    farm = _farm()
    body = _json_body()
    model = require_model(body, [m.name for m in farm.cfg.models] + _aliases())
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    # the semantic layer (guards, cache, MoM selection) runs before anything is tokenized or queued
    layer = farm.semantic()
    if kind == "chat":
        messages = validate_chat(body)
        verdict = decide(layer, model, messages, no_cache=no_cache_requested(),
                         fits=lambda v: answer_fits(v.answer or "", body, farm.tokenizer(v.model)))
    else:  # text completions: guards and selection on the prompt's text; no cache, no system prompt
        verdict = decide(layer, model, _completion_messages(body, model), no_cache=True, inject=False)
    if verdict.action != "forward":
        return answer_locally(kind, rid, verdict, *stream_flags(body))
    model = verdict.model
    mcfg = farm.cfg.model(model)
    tok = farm.tokenizer(model)
    if kind == "chat":
        parsed: ParsedRequest = parse_chat(body, tok, mcfg.max_model_len, verdict.messages, mcfg.defaults)
    else:
        parsed = parse_completion(body, tok, mcfg.max_model_len, mcfg.defaults)
    req = GenerationRequest(rid, model, parsed.prompt_ids, parsed.sampling, created=time.time())
    try:
        sub = farm.gateway.submit(req)
    except (NoWorkersError, BusyError):
        metrics.REQUESTS.labels(model=model, status="503").inc()
        raise
    events = metered(sub.events())  # charges the usage to the caller's token quota (api.auth)
    if parsed.stream:
        resp = _stream_response(kind, rid, model, sub, events, parsed.include_usage,
                                on_done=lambda text, reason: store(layer, verdict, text, reason))
        resp.headers.update(verdict.headers)
        return resp
    try:
        head, buffered = _until_decode_starts(events)
        text, done = _collect(buffered, events)
    except BaseException as e:
        metrics.REQUESTS.labels(model=model, status=str(to_api_error(e).status)).inc()
        raise
    finally:
        _safe_cancel(sub)  # no-op after done/error; stops the worker on timeout or Redis failure
    metrics.REQUESTS.labels(model=model, status="200").inc()
    store(layer, verdict, text, done.get("finish_reason", "stop"))
    resp = jsonify(full_response(kind, rid, model, text, done.get("finish_reason", "stop"), done.get("usage", {})))
    resp.headers.update(_worker_headers(rid, sub, {**head, **done}))
    resp.headers.update(verdict.headers)
    return resp


def _completion_messages(body: dict[str, Any], model: str) -> list[dict[str, str]]:
    """The prompt as a user message; token ids decoded by the asked model's tokenizer (the default's for an alias)."""
    farm = _farm()
    return completion_messages(body, farm.tokenizer(model if model not in _aliases() else farm.cfg.default_model))


def _worker_error(ev: dict[str, Any]) -> APIError:
    """A worker's error event: a lost worker that no other could replace is 503 (retry later), else 500."""
    code = ev.get("code") or "engine_error"
    status = 503 if code == "worker_lost" else 500
    return APIError(status, f"generation failed: {ev.get('message')}", code=code)


def _until_decode_starts(events: Iterator[dict]) -> tuple[dict, list[dict]]:
    """Read events until the worker that will decode has started (so headers can name both workers).

    Returns that start event and the non-start events read before it (replayed to the response).
    """
    buffered: list[dict] = []
    for ev in events:
        t = ev.get("type")
        if t == "start" and ev.get("role") in ("decode", "both"):
            return ev, buffered
        if t == "error":
            raise _worker_error(ev)
        if t == "done":  # finished before any decode start (e.g. aborted): answer what we have
            return ev, [*buffered, ev]
        if t != "start":
            buffered.append(ev)
    raise APIError(500, "the request's event stream ended unexpectedly", code="stream_ended")


def _chain(buffered: list[dict], events: Iterator[dict]) -> Iterator[dict]:
    yield from buffered
    if not (buffered and buffered[-1].get("type") in ("done", "error")):
        yield from events


def _collect(buffered: list[dict], events: Iterator[dict]) -> tuple[str, dict]:
    """The whole completion text and the done event; a worker error becomes a 500."""
    parts: list[str] = []
    for ev in _chain(buffered, events):
        t = ev.get("type")
        if t == "delta":
            parts.append(ev.get("text", ""))
        elif t == "done":
            return "".join(parts), ev
        elif t == "error":
            raise _worker_error(ev)
    raise APIError(500, "the request's event stream ended unexpectedly", code="stream_ended")


def _stream_response(kind: str, rid: str, model: str, sub: Submission, events: Iterator[dict],
                     include_usage: bool, on_done: Callable[[str, str], None] | None = None) -> Response:
    """SSE response; errors before the decode worker starts are still plain JSON errors."""
    try:
        head, buffered = _until_decode_starts(events)
    except BaseException as e:
        metrics.REQUESTS.labels(model=model, status=str(to_api_error(e).status)).inc()
        _safe_cancel(sub)
        raise
    gen = _stream(kind, rid, model, sub, buffered, events, include_usage, on_done)
    resp = Response(gen, mimetype="text/event-stream", headers=_worker_headers(rid, sub, head))
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    # The server closes the response even when the generator never ran (client gone at once); the
    # generator's own `finally` covers everything after its first step.
    resp.call_on_close(lambda: _safe_cancel(sub))
    return resp


def _stream(kind: str, rid: str, model: str, sub: Submission, buffered: list[dict], events: Iterator[dict],
            include_usage: bool, on_done: Callable[[str, str], None] | None = None) -> Iterator[str]:
    """OpenAI SSE chunks; a failure mid-stream ends with an error line and [DONE]. `on_done(text,
    finish_reason)` sees the whole answer once it finished (the semantic cache stores it)."""
    w = ChunkWriter(kind, rid, model)
    parts: list[str] = []
    try:
        first = w.role()
        if first:
            yield first
        for ev in _chain(buffered, events):
            t = ev.get("type")
            if t == "delta" and ev.get("text"):
                parts.append(ev["text"])
                yield w.delta(ev["text"])
            elif t == "done":
                metrics.REQUESTS.labels(model=model, status="200").inc()
                if on_done is not None:
                    on_done("".join(parts), ev.get("finish_reason", "stop"))
                yield w.finish(ev.get("finish_reason", "stop"))
                if include_usage:
                    yield w.usage(ev.get("usage", {}))
                break
            elif t == "error":
                metrics.REQUESTS.labels(model=model, status="500").inc()
                yield w.error(f"generation failed: {ev.get('message')}", ev.get("code") or "engine_error")
                break
        else:
            raise APIError(500, "the request's event stream ended unexpectedly", code="stream_ended")
        yield w.done()
    except Exception as e:  # headers are sent: report in-band (GeneratorExit is not an Exception)
        err = to_api_error(e)
        if err.status == 500 and not isinstance(e, APIError):
            log.exception("request %s: stream failed", rid)
        metrics.REQUESTS.labels(model=model, status=str(err.status)).inc()
        yield w.error(err.message, err.code or "server_error")
        yield w.done()
    finally:
        _safe_cancel(sub)  # client went away (GeneratorExit) or the stream broke: stop the worker
