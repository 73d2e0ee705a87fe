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
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import redis
from flask import Blueprint, Response, current_app, g, jsonify, request

from api.auth import count_requests, request_scope, reserve_tokens
from api.bodies import json_body
from api.disconnect import client_gone_check
from api.error_handlers import to_api_error
from api.request_ids import client_request_id
from api.semantic import (
    answer_fits,
    answer_locally,
    decide,
    fallback_headers,
    no_cache_requested,
    reasoning_template_kwargs,
    store,
)
from farm.config import ModelConfig
from farm.gateway import BusyError, GatewayTimeout, NoWorkersError, Submission, WorkerError
from farm.gateway.reading import (
    Answer,
    collect,
    replay,
    stream_choice,
    total_usage,
    until_decode_starts,
    until_first_token,
)
from farm.infra.cooperative import offload
from farm.infra.interleave import interleave
from farm.models.directories import ModelNotFoundError
from farm.openai import logprobs
from farm.openai.answer import AnswerStream, read_answer
from farm.openai.api_error import APIError, bad_request
from farm.openai.parsing import (
    ParsedRequest,
    Prompt,
    chat_options,
    completion_messages,
    local_params,
    parse_chat,
    parse_completion,
    pretrimmed,
    prompt_char_limit,
    prompt_param,
    raw_prompts,
    refuse_cutting_added_prompt,
    refuse_oversized,
    refuse_showing_added_prompt,
    require_model,
    truncation,
    validate_chat,
)
from farm.openai.reasoning import Thought
from farm.openai.responses import Choice, ChunkWriter, full_response
from farm.openai.tool_stream import CallDelta
from farm.protocol import DeltaEvent, DoneEvent, Event, GenerationRequest, StartEvent, fallback_id
from farm.semantic.embeddings import MAX_TOKENS as EMBEDDING_WINDOW
from farm.semantic.embeddings import MODEL_NAMES as EMBEDDING_MODELS
from farm.semantic.embeddings import embedding_model_installed
from farm.semantic.layer import H_INJECTED, Verdict
from farm.telemetry import prometheus
from farm.tenancy.quota import Reservation

log = logging.getLogger(__name__)
T = TypeVar("T")
bp = Blueprint("openai", __name__, url_prefix="/v1")
OFFLOAD_TOKENS = 4096  # a non-streamed answer of more tokens is built off the hub (farm.infra.cooperative.offload)


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
        if card["id"] == model_id or (card["id"] == EMBEDDING_MODELS[0] and model_id in EMBEDDING_MODELS):
            return jsonify({**card, "id": model_id})  # the embedding model under either name /v1/embeddings takes
    raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")


def _model_cards() -> list[dict[str, Any]]:
    """Every configured model, then the semantic layer's aliases ("MoM": the layer chooses), then the embedding
    model of /v1/embeddings when its package is installed (OpenAI lists its embedding models beside the chat ones,
    and clients find what /v1/embeddings takes here)."""
    cfg = _farm().cfg
    cards = [_model_card(m) for m in cfg.models]
    for alias in _aliases():
        cards.append({"id": alias, "object": "model", "created": _farm().started, "owned_by": "inference-farm",
                      "max_model_len": max(m.max_model_len for m in cfg.models),
                      "description": "semantic routing: the farm picks the model per request"})
    if embedding_model_installed():
        cards.append({"id": EMBEDDING_MODELS[0], "object": "model", "created": _farm().started,
                      "owned_by": "inference-farm", "max_model_len": EMBEDDING_WINDOW,
                      "description": "sentence embeddings (POST /v1/embeddings)"})
    return cards


def _aliases() -> list[str]:
    sem = _farm().cfg.semantic
    return list(sem.aliases) if sem.enabled else []


def _model_card(m: ModelConfig) -> dict[str, Any]:
    return {"id": m.name, "object": "model", "created": _farm().started, "owned_by": "inference-farm",
            "max_model_len": m.max_model_len}


# --- generation -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestIds:
    """A request's ids. `internal` names it inside the farm (task messages, Redis keys, Celery task ids, logs):
    unique per request whatever the client sends, with the client's X-Request-Id in it when it sent one
    (`chatcmpl-<client id>@<uuid hex>`, '@' being outside the client's characters). `response` is the body's `id`
    and `header` the x-request-id header: `chatcmpl-<client id>` / `cmpl-<client id>` and the client's id as
    sent, as vLLM answers; without a client id both are the internal id."""

    internal: str
    response: str
    header: str


def request_ids(kind: str, client_id: str | None) -> RequestIds:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    own = uuid.uuid4().hex
    client_id = client_request_id(client_id)
    if client_id is None:
        return RequestIds(prefix + own, prefix + own, prefix + own)
    return RequestIds(f"{prefix}{client_id}@{own}", prefix + client_id, client_id)


@bp.post("/chat/completions")
def chat_completions() -> Response:
    return generate("chat")


@bp.post("/completions")
def completions() -> Response:
    return generate("completion")


def _safe_cancel(sub: Submission) -> None:
    """Stop reading `sub`, and cancel it unless it finished; never raises (a cancel that cannot reach Redis is
    logged)."""
    try:
        sub.cancel()
    except redis.RedisError as e:
        log.warning("request %s: could not cancel: %s", sub.request_id, e)
    finally:
        sub.close()


def _worker_headers(header_id: str, sub: Submission, start: StartEvent | DoneEvent, done: DoneEvent | None = None
                    ) -> dict[str, str]:
    """x-farm-* headers from the decode/both start event and, once known, the done event (both name the
    workers; the done event's names win)."""
    prefill_worker = decode_worker = prefill = None
    for ev in (start, done):
        if isinstance(ev, StartEvent):
            prefill_worker, decode_worker, prefill = ev.prefill_worker, ev.worker, ev.prefill
        elif isinstance(ev, DoneEvent):
            prefill_worker = ev.prefill_worker or prefill_worker
            decode_worker = ev.decode_worker or decode_worker
            prefill = ev.prefill or prefill
    return {
        "x-request-id": header_id,
        "x-farm-prefill-worker": prefill_worker or "",
        "x-farm-decode-worker": decode_worker or "",
        "x-farm-prefill": prefill or "",
        "x-farm-router-mode": sub.router_mode,
        "x-farm-router-overlap-tokens": str(sub.predicted_overlap_tokens),
    }


class _Generation:
    """The submissions of one response (one per choice) and what they may charge: the token reservation is
    settled once, when the response ends however it ends, with the prompt and the completion tokens the
    client received (all of them once a choice finished)."""

    def __init__(self, prompt_tokens: int, reservation: Reservation):
        self.subs: list[Submission] = []
        self.prompt_tokens = prompt_tokens
        self.reservation = reservation

    def end(self, charge: bool = True) -> None:
        """`charge` False: the generation never started (nothing is owed)."""
        for sub in self.subs:
            _safe_cancel(sub)  # no-op after done/error; stops the workers on timeout, Redis failure, client gone
        used = self.prompt_tokens + sum(sub.completion_tokens for sub in self.subs) if self.subs and charge else 0
        self.reservation.settle(used)


def generate(kind: str, body: Any = None, on_prompt: Callable[[int], None] | None = None) -> Response:
    """A chat or text completion of the request's JSON body, or of `body` (another protocol's request translated
    into this one: api/routes/messages.py); `on_prompt(n)` learns the prompt's token count once it is templated."""
    farm = _farm()
    body = _json_body() if body is None else body
    model = require_model(body, [m.name for m in farm.cfg.models] + _aliases(), EMBEDDING_MODELS)
    ids = request_ids(kind, request.headers.get("X-Request-Id"))
    g.request_header_id = ids.header  # an error answer names the request by the id its success would carry
    # the semantic layer (guards, cache, MoM selection) runs before anything is tokenized or queued
    layer = farm.semantic()
    scope = request_scope(body.get("cache_salt"))
    messages = validate_chat(body) if kind == "chat" else None
    prompts = 1 if messages is not None else len(raw_prompts(body))  # at most MAX_CHOICES, else a 400 here
    count_requests(prompts - 1, "prompt")  # each prompt of a batch is a request against the key's rate limit
    if (bounded := _bounded_prompt(kind, body, model, messages)) is not body:  # cut by vLLM's truncation
        body, messages = bounded, validate_chat(bounded) if messages is not None else None
    if messages is not None:  # a cached answer is one sample without log-probabilities: not for n > 1 or logprobs
        no_cache = no_cache_requested() or _asks_for_more_than_text(body)
        verdict = decide(layer, model, messages, scope=scope, no_cache=no_cache,
                         fits=lambda v: answer_fits(v.answer or "", body, farm.tokenizer(v.model)))
    else:  # text completions: guards and selection on the prompt's text; no cache, no system prompt
        verdict = decide(layer, model, _completion_messages(body, model), scope=scope, no_cache=True, inject=False)
    if verdict.action == "forward" and verdict.headers.get(H_INJECTED) and not farm.cfg.semantic.reveal_injected_prompt:
        refuse_showing_added_prompt(body)
    if verdict.action != "forward":  # every choice asked for gets the layer's answer
        _sampling, stream, include_usage, n = local_params(body, kind)
        return answer_locally(kind, ids.response, verdict, stream, include_usage, header_id=ids.header,
                              choices=prompts * n)
    answers: list[Answer] = []
    # the path by the body's own flag: both start with _start, which validates the whole body against the model's
    # context (local_params would bound max_tokens by no context: a 400 naming a limit of 2**30 tokens)
    if body.get("stream") is True:  # the first token goes out at once: a failure may fall back until then
        st, tried, reason = _with_fallback(
            verdict, ids, lambda m, hop, last: _start(kind, body, verdict, m, hop, last=last))
        for sub in st.gen.subs:  # from here on the client has its first token: no other model may take over
            sub.reached_client()
    else:  # nothing reaches the client before the whole answer: a failure at any token may still fall back
        (st, answers), tried, reason = _with_fallback(
            verdict, ids, lambda m, hop, last: _whole(kind, body, verdict, m, hop, layer=layer, last=last))
    headers = {**verdict.headers, **st.quota_headers, **(fallback_headers(tried, st.model, reason) if tried else {})}
    model, parsed, gen = st.model, st.parsed, st.gen
    if parsed.prompt_only:
        answers = [a.prompt_only() for a in answers]
    if on_prompt is not None:
        on_prompt(st.prompt_tokens)
    out = _Output(kind, st.tok, parsed.sampling.logprobs, parsed.echo_logprobs)
    if parsed.stream:
        resp = _stream_response(kind, ids, model, gen, st.streams, st.head, parsed, out,
                                on_done=_cache_store(layer, verdict, st))
        resp.headers.update(headers)
        return resp
    prometheus.REQUESTS.labels(model=model, status="200").inc()
    json_provider = current_app.json

    def body() -> str:
        with_ids = parsed.return_token_ids
        shown = [out.prompt_logprobs(p, answers[i * parsed.n].prompt_logprobs, parsed.prompt_logprobs)
                 for i, p in enumerate(parsed.prompts)]  # once per prompt: its choices share them
        choices = [Choice.of(a.text, a.finish_reason, out.after_prompt(parsed.prompt_of(i), a.prompt_logprobs,
                                                                       a.token_ids, a.logprobs),
                             parsed.tools, parsed.reasoning_parser, parsed.prompt_of(i).echo,
                             token_ids=a.token_ids if with_ids else None,
                             prompt_token_ids=parsed.prompt_of(i).ids if with_ids else None,
                             prompt_logprobs=shown[i // parsed.n])
                   for i, a in enumerate(answers)]
        usage = total_usage((a.usage for a in answers), parsed.n).to_dict()
        return json_provider.dumps(full_response(kind, ids.response, model, choices, usage, role=parsed.role)) + "\n"

    # A big answer (log-probabilities, or many tokens) is built and serialised off the hub: 16 choices of 4,000
    # tokens with 20 alternatives each make 115 MB of JSON, seconds in which no other request of the process moved.
    big = out.wanted or parsed.prompt_logprobs is not None or sum(len(a.token_ids) for a in answers) > OFFLOAD_TOKENS
    resp = current_app.response_class(offload(body) if big else body(), mimetype=json_provider.mimetype)
    resp.headers.update(_worker_headers(ids.header, gen.subs[0], st.head, answers[0].done))
    resp.headers.update(headers)
    return resp


def _cache_store(layer: Any, verdict: Verdict, st: _Started) -> Callable[[str, str], None] | None:
    """How the first choice's answer is stored in the semantic cache, if it may be: one choice, and the model the
    layer chose (the cache's partition names it: a fallback model's answer is not stored there)."""
    if st.parsed.choices != 1 or st.model != verdict.model:
        return None
    return lambda text, reason: store(layer, verdict, text, reason)


def _whole(kind: str, body: dict[str, Any], verdict: Verdict, model: str, ids: RequestIds, *, layer: Any,
           last: bool) -> tuple[_Started, list[Answer]]:
    """A non-streamed request on `model`: started, then every choice read whole. A failure part-way ends the
    attempt; unless it is the last model's, its tokens are not charged (the client never sees them)."""
    st = _start(kind, body, verdict, model, ids, last=last)
    cache = _cache_store(layer, verdict, st)
    answers: list[Answer] = []
    try:
        for i, events in enumerate(st.streams):
            if i:  # the first choice's start was read by _start (its stream replays what came before it)
                _start_event, buffered = until_decode_starts(events)
                events = replay(buffered, events)
            answers.append(collect(events))
            if i == 0 and cache is not None:  # the answer a cache hit repeats: the content, without reasoning
                content = answers[0].text if st.parsed.reasoning_parser is None else \
                    read_answer(answers[0].text, None, reasoning_parser=st.parsed.reasoning_parser).content
                cache(content or "", answers[0].finish_reason)
    except BaseException as e:
        prometheus.REQUESTS.labels(model=model, status=str(to_api_error(e).status)).inc()
        st.gen.end(charge=last or not isinstance(e, _FALLS_BACK))
        raise
    st.gen.end()
    return st, answers


@dataclass
class _Started:
    """A generation whose first choice's worker has sent its first token: what the rest of the response needs."""

    model: str
    tok: Any
    parsed: ParsedRequest
    prompt_tokens: int
    gen: _Generation
    streams: list[Iterator[Event]]  # the first replays the events read before its start
    head: StartEvent | DoneEvent
    quota_headers: dict[str, str]


# what a model failing before its first token answers, and the reason x-vsr-fallback gives for the next one
_FALLBACK_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (NoWorkersError, "no-live-worker"), (BusyError, "busy"), (GatewayTimeout, "timeout"), (WorkerError, "worker-error"))
_FALLS_BACK = tuple(t for t, _ in _FALLBACK_REASONS)


def _with_fallback(verdict: Verdict, ids: RequestIds, attempt: Callable[[str, RequestIds, bool], T]
                   ) -> tuple[T, list[str], str]:
    """`attempt(model, ids, last)` on the verdict's model; when it fails as a model can (no live worker, every
    worker busy, no progress in time, an engine error: never a client's error) and MoM chose it, on the
    category's next models (`verdict.alternatives`, bounded by `semantic.fallback_hops`). An attempt fails over
    only until something reached the client: a stream up to its first token (`_start`), a whole answer to its
    end (`_whole`). Returns the attempt's result, the models passed over and why the last was (x-vsr-fallback)."""
    tried: list[str] = []
    reason = ""
    candidates = [verdict.model, *verdict.alternatives]
    while True:
        model = candidates[len(tried)]
        last = len(tried) + 1 >= len(candidates)
        # each hop is a request of its own inside the farm (the client's ids stay the same)
        hop = replace(ids, internal=fallback_id(ids.internal, len(tried))) if tried else ids
        try:  # only the last model waits for room in a full KV cache: before it, the next model is tried at once
            return attempt(model, hop, last), tried, reason
        except _FALLS_BACK as e:
            if last or (isinstance(e, WorkerError) and e.code == "invalid_task"):
                raise
            reason = next(r for t, r in _FALLBACK_REASONS if isinstance(e, t))
            log.warning("request %s: model %s failed (%s: %s); trying %s", ids.internal, model, reason, e,
                        candidates[len(tried) + 1])
            tried.append(model)


def _start(kind: str, body: dict[str, Any], verdict: Verdict, model: str, ids: RequestIds, *,
           last: bool) -> _Started:
    """Parse the request for `model` (its tokenizer, chat template and limits), reserve its tokens, submit a
    request per choice and wait until the first choice's generating worker has started and sent its first token
    (nothing has reached the client before it: a failure until then may still fall back). On failure everything
    is released: nothing is charged for a generation that never started. `last`: MoM has no other model to try, so
    the request waits for room when every worker's KV cache is full and, when its worker dies, for another worker of
    this model (Gateway.submit); else both failures go to the next model at once."""
    farm = _farm()
    mcfg = farm.cfg.model(model)
    tok = farm.tokenizer(model)
    per_token = farm.cfg.api.max_chars_per_token
    if kind == "chat":
        parsed: ParsedRequest = parse_chat(body, tok, mcfg.max_model_len, verdict.messages, mcfg.defaults,
                                           per_token, tool_parser=mcfg.tool_call_parser,
                                           reasoning_parser=mcfg.reasoning_parser,
                                           template_kwargs=reasoning_template_kwargs(
                                               verdict, tok, body.get("chat_template_kwargs")))
    else:
        parsed = parse_completion(body, tok, mcfg.max_model_len, mcfg.defaults, per_token)
    if verdict.headers.get(H_INJECTED):
        refuse_cutting_added_prompt(parsed)
    n_prompt, choices = parsed.prompt_tokens, parsed.choices
    most = n_prompt + sum(parsed.max_tokens_of(c) for c in range(choices))
    held = reserve_tokens(most, n_prompt + choices)
    quota_headers = {}
    if held.tokens < most:  # what is left of the quota caps the answer
        capped = (held.tokens - n_prompt) // choices
        parsed = parsed.capped(capped)
        quota_headers["x-farm-quota-max-tokens"] = str(capped)
    gen = _Generation(n_prompt, held)
    try:
        for req in _choice_requests(ids.internal, model, parsed):
            gen.subs.append(farm.gateway.submit(req, wait_for_room=last, falls_back=not last))
        # a client that leaves while it waits (queued, or for a whole non-streaming answer) cancels the generation
        gone = client_gone_check()
        streams = [sub.events(client_gone=gone) for sub in gen.subs]
        head, buffered = until_first_token(streams[0])  # before it, a failure may still fall back
    except BaseException as e:
        prometheus.REQUESTS.labels(model=model, status=str(to_api_error(e).status)).inc()
        gen.end(charge=False)
        raise
    streams[0] = replay(buffered, streams[0])
    return _Started(model, tok, parsed, n_prompt, gen, _sharing_prompt_logprobs(streams, parsed), head, quota_headers)


def _asks_for_more_than_text(body: dict[str, Any]) -> bool:
    """n > 1, log-probabilities or token ids, tools, vLLM's options that change the prompt or the answer's text (the
    chat-template fields and special tokens added, a truncation, special tokens shown, the stop string kept), or a constraint on the answer (stop
    sequences or tokens, a response format or structured outputs, min_tokens, ignore_eos, logit_bias, bad_words): what a cached answer (one free
    sample of the plain prompt, text only) cannot give, and what must not be stored as one: an answer cut at one
    client's stop, or held to its schema, replayed to another request was wrong for it. (The body passed
    validate_chat.)"""
    fmt = body.get("response_format")
    return (body.get("n") not in (None, 1) or body.get("logprobs") not in (None, False) or bool(body.get("tools"))
            or not chat_options(body).default or body.get("skip_special_tokens") is False
            or body.get("include_stop_str_in_output") is True
            or bool(body.get("stop")) or bool(body.get("stop_token_ids"))
            or (isinstance(fmt, dict) and fmt.get("type") not in (None, "text"))
            or body.get("structured_outputs") is not None or body.get("return_token_ids") is True
            or body.get("prompt_logprobs") is not None or bool(body.get("allowed_token_ids"))
            or body.get("truncate_prompt_tokens") is not None or bool(body.get("bad_words"))
            or bool(body.get("min_tokens")) or body.get("ignore_eos") is True or bool(body.get("logit_bias")))


def _choice_requests(rid: str, model: str, parsed: ParsedRequest) -> list[GenerationRequest]:
    """One request per choice: the first under the request's internal id (RequestIds), the others `<id>-<i>`. The
    j-th choice of a prompt has its own seed (seed + j), so seeded choices differ and each prompt's reproduce
    wherever it stands in a batch. A prompt's choices share it, so the router places them where its KV is and the
    worker computes it once; its log-probabilities (vLLM's `prompt_logprobs`, an echo's) are asked of its first choice
    only, as vLLM computes them once. Each carries the caller's cache salt: prefix-cache reuse only within its tenant (and
    the client's own `cache_salt`, if given)."""
    salt = request_scope(parsed.cache_salt)
    reqs = []
    for i in range(parsed.choices):
        sampling, j, most = parsed.sampling, i % parsed.n, parsed.max_tokens_of(i)
        if most != sampling.max_tokens:
            sampling = replace(sampling, max_tokens=most)
        if j and sampling.seed is not None:
            sampling = replace(sampling, seed=(sampling.seed + j) % (1 << 63))
        if j and sampling.prompt_logprobs is not None:  # one prompt's, computed by its first choice: the others
            sampling = replace(sampling, prompt_logprobs=None)  # take the prefix cache and share them (_sharing_prompt_logprobs)
        reqs.append(GenerationRequest(rid if i == 0 else f"{rid}-{i}", model, parsed.prompt_of(i).ids, sampling,
                                      created=time.time(), cache_salt=salt))
    return reqs


def _sharing_prompt_logprobs(streams: list[Iterator[Event]], parsed: ParsedRequest) -> list[Iterator[Event]]:
    """The choices' event streams, each later choice of a prompt given the log-probabilities its first choice computed
    (_choice_requests asks them of that one only) on its first delta. The choices are read one after the other,
    streamed or whole, so the first has left them when a later one needs them."""
    if parsed.n == 1 or parsed.sampling.prompt_logprobs is None:
        return streams
    shared: dict[int, Any] = {}

    def sharing(events: Iterator[Event], prompt: int, first: bool) -> Iterator[Event]:
        seen = False
        for ev in events:
            if isinstance(ev, DeltaEvent) and not seen:
                seen = True
                if first:
                    shared[prompt] = ev.prompt_lp
                elif ev.prompt_lp is None:
                    ev = replace(ev, prompt_lp=shared.get(prompt))
            yield ev

    return [sharing(events, i // parsed.n, i % parsed.n == 0) for i, events in enumerate(streams)]


def _stream_shaped_choice(w: ChunkWriter, index: int, events: Iterator[Event], shaper: AnswerStream,
                          echo: str, on_done: Callable[[str, str], None] | None, prompt_ids: list[int] | None = None
                          ) -> Generator[str, None, DoneEvent]:
    """One choice of a request with tools or a reasoning model: reasoning and content as they come, calls as OpenAI
    streams them, and the finish reason the calls make (tool_calls). With `prompt_ids` (vLLM's `return_token_ids`)
    the role chunk carries them, and each event's token ids go in a chunk of their own before its pieces."""
    def chunk(p: str | Thought | CallDelta) -> str:
        if isinstance(p, str):
            content.append(p)
            return w.delta(p, index) if p else ""
        return w.thought(p.text, index) if isinstance(p, Thought) else w.tool_call(p, index)

    def chunks(pieces: Iterator[str | Thought | CallDelta]) -> str:
        return "".join(map(chunk, pieces))

    pending = w.role(index, prompt_ids) + (w.delta(echo, index) if echo else "")
    deltas = stream_choice(events)
    content: list[str] = []
    while True:
        try:
            ev = next(deltas)
        except StopIteration as stop:
            done: DoneEvent = stop.value
            tail = chunks(shaper.finish())
            reason = shaper.finish_reason(done.finish_reason)
            if on_done is not None and index == 0:  # no tools here (never cached): the content, without reasoning
                on_done("".join(content), done.finish_reason)
            yield pending + tail + w.finish(reason or "stop", index)
            return done
        w.generated(index, ev.n)
        piece = (w.token_ids(ev.ids, index) if prompt_ids is not None and ev.ids else "") + \
            (chunks(shaper.feed(ev.text)) if ev.text else "")
        if piece:
            yield pending + piece
            pending = ""


class _Output:
    """Log-probabilities in the response's shape, when the request asks for them (farm.openai.logprobs): `top`
    alternatives per token (None: no log-probabilities)."""

    def __init__(self, kind: str, tokenizer: Any, top: int | None, prompt_wanted: bool = False):
        self.kind, self.tokenizer, self.top, self.wanted = kind, tokenizer, top, top is not None
        self.prompt_wanted = prompt_wanted  # an echoed prompt's too (ParsedRequest.echo_logprobs)

    def logprobs(self, ids: list[int], lps: list[list], offset: int = 0) -> dict[str, Any] | None:
        if not self.wanted:
            return None
        return logprobs.for_kind(self.kind, self.tokenizer, ids, lps, offset)

    def prompt(self, prompt: Prompt, prompt_lps: list[list | None] | None) -> tuple[dict[str, Any] | None, int]:
        """An echoed prompt's log-probabilities and where its tokens end (farm.openai.logprobs.echoed)."""
        if not self.wanted or prompt_lps is None:
            return None, 0
        return logprobs.echoed(self.tokenizer, prompt.ids, prompt_lps, self.top)

    def after_prompt(self, prompt: Prompt, prompt_lps: list[list | None] | None, ids: list[int],
                     lps: list[list]) -> dict[str, Any] | None:
        """A whole choice's log-probabilities: its echoed prompt's first when it has them (the worker also sends a
        prompt's for vLLM's `prompt_logprobs`, which are no echo)."""
        if not self.wanted:
            return None
        return logprobs.for_answer(self.kind, self.tokenizer, ids, lps, prompt.ids,
                                   prompt_lps if self.prompt_wanted else None, self.top)

    def prompt_logprobs(self, prompt: Prompt, prompt_lps: list[list | None] | None,
                        k: int | None) -> list[Any] | None:
        """vLLM's `prompt_logprobs` of a prompt, when the request asked for them (`k`)."""
        if k is None or prompt_lps is None:
            return None
        return logprobs.prompt_logprobs(self.tokenizer, prompt.ids, prompt_lps, k)


def _bounded_prompt(kind: str, body: dict[str, Any], model: str, messages: list[dict[str, str]] | None
                    ) -> dict[str, Any]:
    """The body, once its prompt is known to fit: context_length_exceeded before the semantic layer or the template
    sees a prompt that cannot (farm.openai.parsing.refuse_oversized; for an alias, only when no model could take
    it); or, when the request asks for vLLM's truncation, a body whose prompt is cut to what its models could keep
    (farm.openai.parsing.pretrimmed)."""
    farm = _farm()
    names = [m.name for m in farm.cfg.models] if model in _aliases() else [model]
    models = []
    for name in names:
        try:
            models.append((farm.tokenizer(name), farm.cfg.model(name).max_model_len))
        except ModelNotFoundError:  # not prepared here: the layer will not choose it either
            continue
    if not models:
        return body
    if truncation(body)[0] is not None:
        cut = pretrimmed(body, kind, [(tok, n, prompt_char_limit(tok, n, farm.cfg.api.max_chars_per_token))
                                      for tok, n in models])
        if cut is not None:
            return cut
    _refuse_oversized(body, models, messages)  # also when no model has room for the truncated prompt
    return body


def _refuse_oversized(body: dict[str, Any], models: list[tuple[Any, int]],
                      messages: list[dict[str, str]] | None) -> None:
    farm = _farm()
    if messages is not None:
        refuse_oversized(models, messages, "messages", farm.cfg.api.max_chars_per_token)
        return
    prompts = raw_prompts(body)
    for i, prompt in enumerate(prompts):
        param = prompt_param(i, len(prompts))
        if isinstance(prompt, str):
            refuse_oversized(models, prompt, param, farm.cfg.api.max_chars_per_token)
        elif isinstance(prompt, list) and len(prompt) >= (context := max(n for _, n in models)):  # ids: one each
            raise bad_request(f"This model's maximum context length is {context} tokens; your prompt has "
                              f"{len(prompt)} tokens.", param, "context_length_exceeded")


def _completion_messages(body: dict[str, Any], model: str) -> list[dict[str, str]]:
    """The prompt as a user message; token ids decoded by the asked model's tokenizer (the default's for an alias)."""
    farm = _farm()
    return completion_messages(body, farm.tokenizer(model if model not in _aliases() else farm.cfg.default_model))


def _stream_response(kind: str, ids: RequestIds, model: str, gen: _Generation, streams: list[Iterator[Event]],
                     head: StartEvent | DoneEvent, parsed: ParsedRequest, out: _Output,
                     on_done: Callable[[str, str], None] | None = None) -> Response:
    """SSE response, once the first choice's decode worker has sent its first token (_start: errors before that are
    plain JSON errors, or fall back to another model)."""
    body = _stream(kind, ids, model, gen, streams, parsed, out, on_done)
    resp = Response(body, mimetype="text/event-stream", headers=_worker_headers(ids.header, gen.subs[0], head))
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    # The server closes the response even when the generator never ran (client gone at once); the
    # generator's own `finally` covers everything after its first step. Ending twice is harmless.
    resp.call_on_close(gen.end)
    return resp


def _stream(kind: str, ids: RequestIds, model: str, gen: _Generation, streams: list[Iterator[Event]],
            parsed: ParsedRequest, out: _Output, on_done: Callable[[str, str], None] | None = None) -> Iterator[str]:
    """OpenAI SSE chunks, the choices' interleaved as their tokens come (each chunk names its index); a failure
    mid-stream ends with an error line and [DONE]. `on_done(text, finish_reason)` sees the whole answer once it
    finished (the semantic cache stores it)."""
    running = (lambda i: len(parsed.prompt_of(i).ids)) if parsed.continuous_usage else None
    w = ChunkWriter(kind, ids.response, model, parsed.role, prompt_tokens=running)

    def choice(index: int, events: Iterator[Event]) -> Generator[str, None, DoneEvent]:
        shaper = AnswerStream(parsed.tools, parsed.reasoning_parser) \
            if parsed.tools is not None or parsed.reasoning_parser else None
        return _stream_choice(w, index, events, out, on_done, parsed.prompt_of(index), shaper,
                              prompt_only=parsed.prompt_only, with_ids=parsed.return_token_ids)

    try:
        # the choices' chunks as their tokens come, as vLLM sends them (each chunk names its choice)
        dones = yield from interleave([choice(i, events) for i, events in enumerate(streams)], "choice")
        usages = [done.usage for done in dones]
        prometheus.REQUESTS.labels(model=model, status="200").inc()
        tail = w.usage(total_usage(usages, parsed.n).to_dict()) if parsed.include_usage else ""
        yield tail + w.done()
    except Exception as e:  # headers are sent: report in-band (GeneratorExit is not an Exception)
        err = to_api_error(e)
        if err.status == 500 and not isinstance(e, (APIError, WorkerError)):
            log.exception("request %s: stream failed", ids.internal)
        prometheus.REQUESTS.labels(model=model, status=str(err.status)).inc()
        yield w.error(err.message, err.code or "server_error") + w.done()
    finally:
        gen.end()  # client went away (GeneratorExit) or the stream broke: stop the workers, settle the quota


def _stream_choice(w: ChunkWriter, index: int, events: Iterator[Event], out: _Output,
                   on_done: Callable[[str, str], None] | None, prompt: Prompt,
                   shaper: AnswerStream | None = None, prompt_only: bool = False,
                   with_ids: bool = False) -> Generator[str, None, DoneEvent]:
    """The chunks of one choice (after its role, the prompt's `echo` text as a delta of its own, as vLLM sends it,
    with the prompt's log-probabilities when asked); returns its done event (a worker error raises WorkerError).
    With tools or a reasoning parser, `shaper` turns the text into reasoning, content and tool-call deltas.
    `prompt_only` (ParsedRequest.prompt_only): the echo is the whole choice, the generated token is not sent.
    `with_ids` (vLLM's `return_token_ids`): each delta carries its token ids, and the choice's first chunk (chat:
    its role chunk) the prompt's."""
    echo = prompt.echo
    prompt_ids = prompt.ids if with_ids else None
    if shaper is not None:
        return (yield from _stream_shaped_choice(w, index, events, shaper, echo, on_done, prompt_ids))
    parts: list[str] = []
    pending = w.role(index, prompt_ids)  # sent with the first delta: one write
    head_ids = prompt_ids if w.kind != "chat" else None  # a text completion's first chunk carries the prompt's ids
    echo_lps = bool(echo) and out.prompt_wanted  # the echo waits for the prompt's, in the first delta
    if echo and not echo_lps:
        pending, head_ids = pending + w.delta(echo, index, prompt_token_ids=head_ids), None
    base = 0  # where the completion's token offsets start: after the echoed prompt's tokens
    deltas = stream_choice(events)
    while True:
        try:
            ev = next(deltas)
        except StopIteration as stop:
            done: DoneEvent = stop.value
            if on_done is not None and index == 0:
                on_done("".join(parts), done.finish_reason)
            if echo_lps:  # no token came: the echo alone
                pending += w.delta(echo, index, prompt_token_ids=head_ids)
            yield pending + w.finish(done.finish_reason, index)
            return done
        w.generated(index, ev.n)
        if echo_lps:
            head, base = out.prompt(prompt, ev.prompt_lp)
            pending, echo_lps = pending + w.delta(echo, index, head, prompt_token_ids=head_ids), False
            head_ids = None
        if prompt_only or (not ev.text and ev.lp is None and not (with_ids and ev.ids)):
            continue
        lps = out.logprobs(ev.ids, ev.lp, base + sum(map(len, parts))) if ev.lp is not None else None
        parts.append(ev.text)
        yield pending + w.delta(ev.text, index, lps, ev.ids if with_ids else None, head_ids)
        pending, head_ids = "", None
