"""OpenAI routes: /v1/chat/completions, /v1/completions (stream and not), /v1/models."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from api.errors import APIError, bad_request
from api.responses import ChunkWriter, full_response
from api.schemas import ParsedRequest, parse_chat, parse_completion, require_model
from farm import metrics
from farm.gateway import BusyError, GatewayTimeout, NoWorkersError, Submission
from farm.protocol import GenerationRequest

log = logging.getLogger(__name__)
bp = Blueprint("openai", __name__, url_prefix="/v1")


def _farm():
    return current_app.extensions["farm"]


def _json_body() -> Any:
    if not request.data:
        raise bad_request("the request body must be a JSON object")
    try:
        return request.get_json(force=True, silent=False)
    except Exception:
        raise bad_request("the request body is not valid JSON") from None


@bp.get("/models")
def list_models():
    cfg = _farm().cfg
    return jsonify({"object": "list", "data": [_model_card(m) for m in cfg.models]})


@bp.get("/models/<path:model_id>")
def get_model(model_id: str):
    cfg = _farm().cfg
    for m in cfg.models:
        if m.name == model_id:
            return jsonify(_model_card(m))
    raise APIError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")


def _model_card(m) -> dict[str, Any]:
    return {"id": m.name, "object": "model", "created": _farm().started, "owned_by": "inference-farm",
            "max_model_len": m.max_model_len}


@bp.post("/chat/completions")
def chat_completions():
    return _generate("chat")


@bp.post("/completions")
def completions():
    return _generate("completion")


def _generate(kind: str) -> Response:
    farm = _farm()
    body = _json_body()
    model = require_model(body, [m.name for m in farm.cfg.models])
    tok = farm.tokenizer(model)
    max_len = farm.cfg.model(model).max_model_len
    parsed: ParsedRequest = (parse_chat if kind == "chat" else parse_completion)(body, tok, max_len)
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    req = GenerationRequest(rid, model, parsed.prompt_ids, parsed.sampling, created=time.time())
    try:
        sub = farm.gateway.submit(req)
    except NoWorkersError as e:
        metrics.REQUESTS.labels(model=model, status="503").inc()
        raise APIError(503, str(e), code="no_workers", headers={"Retry-After": "5"}) from None
    except BusyError as e:
        metrics.REQUESTS.labels(model=model, status="503").inc()
        raise APIError(503, f"The farm is at capacity: {e}", code="overloaded",
                       headers={"Retry-After": str(e.retry_after_s)}) from None
    events = sub.events()
    try:
        head, buffered = _until_decode_starts(events)
    except BaseException:
        sub.cancel()
        raise
    headers = {
        "x-request-id": rid,
        "x-farm-prefill-worker": head.get("prefill_worker", ""),
        "x-farm-decode-worker": head.get("decode_worker") or head.get("worker", ""),
        "x-farm-prefill": head.get("prefill", ""),
        "x-farm-router-mode": sub.router_mode,
        "x-farm-router-overlap-tokens": str(sub.predicted_overlap_tokens),
    }
    if parsed.stream:
        gen = _stream(kind, rid, model, sub, buffered, events, parsed.include_usage)
        resp = Response(gen, mimetype="text/event-stream", headers=headers)
        resp.headers["Cache-Control"] = "no-cache"
        resp.headers["X-Accel-Buffering"] = "no"
        return resp
    text, done = _collect(sub, buffered, events)
    metrics.REQUESTS.labels(model=model, status="200").inc()
    resp = jsonify(full_response(kind, rid, model, text, done["finish_reason"], done.get("usage", {})))
    resp.headers.update(headers)
    return resp


def _until_decode_starts(events: Iterator[dict]) -> tuple[dict, list[dict]]:
    """Read events until the worker that will decode has started (so headers can name it)."""
    buffered: list[dict] = []
    try:
        for ev in events:
            t = ev.get("type")
            if t == "start" and ev.get("role") in ("decode", "both"):
                return ev, buffered
            if t == "error":
                raise APIError(500, f"generation failed: {ev.get('message')}", code=ev.get("code", "engine_error"))
            if t == "done":  # finished before any decode start (e.g. cancelled): answer what we have
                return ev, [ev]
            if t != "start":
                buffered.append(ev)
    except GatewayTimeout as e:
        raise APIError(504, str(e), code="timeout") from None
    raise APIError(500, "the request's event stream ended unexpectedly", code="stream_ended")


def _collect(sub: Submission, buffered: list[dict], events: Iterator[dict]) -> tuple[str, dict]:
    parts: list[str] = []
    try:
        for ev in _chain(buffered, events):
            t = ev.get("type")
            if t == "delta":
                parts.append(ev.get("text", ""))
            elif t == "done":
                return "".join(parts), ev
            elif t == "error":
                raise APIError(500, f"generation failed: {ev.get('message')}", code=ev.get("code", "engine_error"))
    except GatewayTimeout as e:
        sub.cancel()
        raise APIError(504, str(e), code="timeout") from None
    sub.cancel()
    raise APIError(500, "the request's event stream ended unexpectedly", code="stream_ended")


def _chain(buffered: list[dict], events: Iterator[dict]) -> Iterator[dict]:
    yield from buffered
    if not (buffered and buffered[-1].get("type") in ("done", "error")):
        yield from events


def _stream(kind: str, rid: str, model: str, sub: Submission, buffered: list[dict], events: Iterator[dict],
            include_usage: bool) -> Iterator[str]:
    w = ChunkWriter(kind, rid, model)
    finished = False
    try:
        first = w.role()
        if first:
            yield first
        for ev in _chain(buffered, events):
            t = ev.get("type")
            if t == "delta" and ev.get("text"):
                yield w.delta(ev["text"])
            elif t == "done":
                finished = True
                yield w.finish(ev.get("finish_reason", "stop"))
                if include_usage:
                    yield w.usage(ev.get("usage", {}))
                metrics.REQUESTS.labels(model=model, status="200").inc()
                break
            elif t == "error":
                finished = True
                metrics.REQUESTS.labels(model=model, status="500").inc()
                yield w.error(f"generation failed: {ev.get('message')}", ev.get("code", "engine_error"))
                break
        yield w.done()
    except GatewayTimeout as e:
        metrics.REQUESTS.labels(model=model, status="504").inc()
        yield w.error(str(e), "timeout")
        yield w.done()
    finally:
        if not finished:  # client went away (GeneratorExit) or the stream broke: stop the worker
            sub.cancel()
