"""OpenAI routes: /v1/chat/completions, /v1/completions (stream and not), /v1/models.

A generation request is validated and tokenized here, handed to the Gateway, and answered from the
request's event stream. Whatever way a request ends before its `done` event (client gone, timeout,
Redis error), the submission is cancelled so the worker stops generating for nobody.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace
from typing import Any

import redis
from flask import Blueprint, Response, current_app, jsonify

from api.auth import current_owner, metered
from api.bodies import json_body
from api.disconnect import client_gone_check
from api.errors import to_api_error
from api.semantic import (
    answer_fits,
    answer_locally,
    decide,
    no_cache_requested,
    reasoning_template_kwargs,
    store,
)
from farm import metrics
from farm.config import ModelConfig
from farm.gateway import BusyError, NoWorkersError, Submission
from farm.models import ModelNotFoundError
from farm.openai import logprobs
from farm.openai.errors import APIError, bad_request
from farm.openai.parsing import (
    ParsedRequest,
    check_prompt_chars,
    completion_messages,
    messages_chars,
    parse_chat,
    parse_completion,
    prompt_char_limit,
    raw_prompt,
    require_model,
    stream_flags,
    validate_chat,
)
from farm.openai.responses import Choice, ChunkWriter, full_response
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
    messages = validate_chat(body) if kind == "chat" else None
    _refuse_oversized_prompt(body, model, messages)
    if messages is not None:  # a cached answer is one sample without log-probabilities: not for n > 1 or logprobs
        no_cache = no_cache_requested() or _asks_for_more_than_text(body)
        verdict = decide(layer, model, messages, no_cache=no_cache, tenant=current_owner(),
                         fits=lambda v: answer_fits(v.answer or "", body, farm.tokenizer(v.model)))
    else:  # text completions: guards and selection on the prompt's text; no cache, no system prompt
        verdict = decide(layer, model, _completion_messages(body, model), no_cache=True, inject=False)
    if verdict.action != "forward":
        return answer_locally(kind, rid, verdict, *stream_flags(body, kind))
    model = verdict.model
    mcfg = farm.cfg.model(model)
    tok = farm.tokenizer(model)
    per_token = farm.cfg.api.max_chars_per_token
    if kind == "chat":
        parsed: ParsedRequest = parse_chat(body, tok, mcfg.max_model_len, verdict.messages, mcfg.defaults,
                                           per_token, backend=mcfg.backend,
                                           template_kwargs=reasoning_template_kwargs(verdict, tok))
    else:
        parsed = parse_completion(body, tok, mcfg.max_model_len, mcfg.defaults, per_token, backend=mcfg.backend)
    subs: list[Submission] = []
    try:
        for req in _choice_requests(rid, model, parsed):
            subs.append(farm.gateway.submit(req))
    except (NoWorkersError, BusyError):
        metrics.REQUESTS.labels(model=model, status="503").inc()
        for sub in subs:
            _safe_cancel(sub)
        raise
    # metered: charges the usage to the caller's token quota (api.auth); a client that leaves while it waits
    # (queued, or for a whole non-streaming answer) cancels the generation (api.disconnect)
    streams = [metered(sub.events(client_gone=client_gone_check())) for sub in subs]
    out = _Output(kind, tok, parsed.sampling.logprobs is not None)
    cache = (lambda text, reason: store(layer, verdict, text, reason)) if parsed.n == 1 else None
    if parsed.stream:
        resp = _stream_response(kind, rid, model, subs, streams, parsed.include_usage, out, on_done=cache)
        resp.headers.update(verdict.headers)
        return resp
    choices, dones, head = [], [], {}
    try:
        for i, events in enumerate(streams):
            start, buffered = _until_decode_starts(events)
            head = head or start
            text, done, ids, lps = _collect(buffered, events)
            choices.append(Choice(text, done.get("finish_reason", "stop"), out.logprobs(ids, lps)))
            dones.append(done)
            if i == 0 and cache is not None:
                cache(text, done.get("finish_reason", "stop"))
    except BaseException as e:
        metrics.REQUESTS.labels(model=model, status=str(to_api_error(e).status)).inc()
        raise
    finally:
        for sub in subs:
            _safe_cancel(sub)  # no-op after done/error; stops the worker on timeout or Redis failure
    metrics.REQUESTS.labels(model=model, status="200").inc()
    resp = jsonify(full_response(kind, rid, model, choices, _total_usage(dones)))
    resp.headers.update(_worker_headers(rid, subs[0], {**head, **dones[0]}))
    resp.headers.update(verdict.headers)
    return resp


def _asks_for_more_than_text(body: dict[str, Any]) -> bool:
    """n > 1 or log-probabilities: what a cached answer (one sample, text only) cannot give."""
    return body.get("n") not in (None, 1) or body.get("logprobs") not in (None, False)


def _choice_requests(rid: str, model: str, parsed: ParsedRequest) -> list[GenerationRequest]:
    """One request per choice: the first under the response's id, the others `<id>-<i>`, each with its own
    seed (seed + i) so seeded choices differ and reproduce. They share the prompt, so the router places
    them where its KV is and the worker computes it once."""
    reqs = []
    for i in range(parsed.n):
        sampling = parsed.sampling
        if i and sampling.seed is not None:
            sampling = replace(sampling, seed=(sampling.seed + i) % (1 << 63))
        reqs.append(GenerationRequest(rid if i == 0 else f"{rid}-{i}", model, parsed.prompt_ids, sampling,
                                      created=time.time()))
    return reqs


def _total_usage(dones: list[dict[str, Any]]) -> dict[str, int]:
    """The usage of a response of several choices: the prompt counted once, the completions summed."""
    first = dones[0].get("usage", {}) if dones else {}
    return {"prompt_tokens": int(first.get("prompt_tokens", 0)), "cached_tokens": int(first.get("cached_tokens", 0)),
            "completion_tokens": sum(int(d.get("usage", {}).get("completion_tokens", 0)) for d in dones)}


class _Output:
    """Log-probabilities in the response's shape, when the request asks for them (farm.openai.logprobs)."""

    def __init__(self, kind: str, tokenizer: Any, wanted: bool):
        self.kind, self.tokenizer, self.wanted = kind, tokenizer, wanted

    def logprobs(self, ids: list[int], lps: list[list], offset: int = 0) -> dict[str, Any] | None:
        if not self.wanted:
            return None
        return logprobs.for_kind(self.kind, self.tokenizer, ids, lps, offset)


def _refuse_oversized_prompt(body: dict[str, Any], model: str, messages: list[dict[str, str]] | None) -> None:
    """context_length_exceeded before the semantic layer or a tokenizer sees a prompt that cannot fit by
    its size alone (farm.openai.parsing.prompt_char_limit; for an alias, the most any model takes)."""
    farm = _farm()
    names = [m.name for m in farm.cfg.models] if model in _aliases() else [model]
    limits = []
    for name in names:
        mcfg = farm.cfg.model(name)
        try:
            tok = farm.tokenizer(name)
        except ModelNotFoundError:  # not prepared here: the layer will not choose it either
            continue
        limits.append((prompt_char_limit(tok, mcfg.max_model_len, farm.cfg.api.max_chars_per_token),
                       mcfg.max_model_len))
    if not limits:
        return
    limit, context = max(limits)
    if messages is not None:
        check_prompt_chars(messages_chars(messages), limit, context, "messages")
    elif isinstance(prompt := raw_prompt(body), str):
        check_prompt_chars(len(prompt), limit, context, "prompt")
    elif isinstance(prompt, list) and len(prompt) >= context:  # token ids: one each
        raise bad_request(f"This model's maximum context length is {context} tokens; your prompt has "
                          f"{len(prompt)} tokens.", "prompt", "context_length_exceeded")


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


def _collect(buffered: list[dict], events: Iterator[dict]) -> tuple[str, dict, list[int], list[list]]:
    """The whole completion: its text, the done event, its token ids and their log-probabilities (when the
    worker sent them); a worker error becomes a 500."""
    parts: list[str] = []
    ids: list[int] = []
    lps: list[list] = []
    for ev in _chain(buffered, events):
        t = ev.get("type")
        if t == "delta":
            parts.append(ev.get("text", ""))
            if "lp" in ev:
                ids.extend(ev.get("ids", []))
                lps.extend(ev["lp"])
        elif t == "done":
            return "".join(parts), ev, ids, lps
        elif t == "error":
            raise _worker_error(ev)
    raise APIError(500, "the request's event stream ended unexpectedly", code="stream_ended")


def _stream_response(kind: str, rid: str, model: str, subs: list[Submission], streams: list[Iterator[dict]],
                     include_usage: bool, out: _Output, on_done: Callable[[str, str], None] | None = None
                     ) -> Response:
    """SSE response; errors before the (first choice's) decode worker starts are still plain JSON errors."""
    try:
        head, buffered = _until_decode_starts(streams[0])
    except BaseException as e:
        metrics.REQUESTS.labels(model=model, status=str(to_api_error(e).status)).inc()
        for sub in subs:
            _safe_cancel(sub)
        raise
    gen = _stream(kind, rid, model, subs, [_chain(buffered, streams[0]), *streams[1:]], include_usage, out,
                  on_done)
    resp = Response(gen, mimetype="text/event-stream", headers=_worker_headers(rid, subs[0], head))
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    # The server closes the response even when the generator never ran (client gone at once); the
    # generator's own `finally` covers everything after its first step.
    resp.call_on_close(lambda: [_safe_cancel(sub) for sub in subs])
    return resp


def _stream(kind: str, rid: str, model: str, subs: list[Submission], streams: list[Iterator[dict]],
            include_usage: bool, out: _Output, on_done: Callable[[str, str], None] | None = None) -> Iterator[str]:
    """OpenAI SSE chunks, choice after choice (each chunk names its index; the choices are generated at the
    same time on the workers); a failure mid-stream ends with an error line and [DONE]. `on_done(text,
    finish_reason)` sees the whole answer once it finished (the semantic cache stores it)."""
    w = ChunkWriter(kind, rid, model)
    dones: list[dict] = []
    try:
        for index, events in enumerate(streams):
            done = yield from _stream_choice(w, index, events, out, on_done)
            if done is None:  # the choice failed: reported in-band
                break
            dones.append(done)
        else:
            metrics.REQUESTS.labels(model=model, status="200").inc()
            if include_usage:
                yield w.usage(_total_usage(dones))
        yield w.done()
    except Exception as e:  # headers are sent: report in-band (GeneratorExit is not an Exception)
        err = to_api_error(e)
        if err.status == 500 and not isinstance(e, APIError):
            log.exception("request %s: stream failed", rid)
        metrics.REQUESTS.labels(model=model, status=str(err.status)).inc()
        yield w.error(err.message, err.code or "server_error")
        yield w.done()
    finally:
        for sub in subs:
            _safe_cancel(sub)  # client went away (GeneratorExit) or the stream broke: stop the workers


def _stream_choice(w: ChunkWriter, index: int, events: Iterator[dict], out: _Output,
                   on_done: Callable[[str, str], None] | None) -> Generator[str, None, dict | None]:
    """The chunks of one choice; returns its done event (None after a worker error, reported in-band)."""
    parts: list[str] = []
    first = w.role(index)
    if first:
        yield first
    for ev in events:
        t = ev.get("type")
        if t == "delta" and (ev.get("text") or "lp" in ev):
            lps = out.logprobs(ev.get("ids", []), ev.get("lp", []), sum(map(len, parts))) if "lp" in ev else None
            parts.append(ev.get("text", ""))
            yield w.delta(ev.get("text", ""), index, lps)
        elif t == "done":
            if on_done is not None and index == 0:
                on_done("".join(parts), ev.get("finish_reason", "stop"))
            yield w.finish(ev.get("finish_reason", "stop"), index)
            return ev
        elif t == "error":
            metrics.REQUESTS.labels(model=w.model, status="500").inc()
            yield w.error(f"generation failed: {ev.get('message')}", ev.get("code") or "engine_error")
            return None
    raise APIError(500, "the request's event stream ended unexpectedly", code="stream_ended")
