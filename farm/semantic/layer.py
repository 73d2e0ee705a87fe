"""The semantic layer's one entry point: `SemanticLayer.before()` before anything is queued, `after()` once
an answer is complete.

How the chat-completions route uses it (one `SemanticLayer` per API process, built at app start):

    layer = SemanticLayer.from_config(cfg, served=lambda: models_with_live_workers())   # once
    ...
    no_cache = "no-cache" in request.headers.get("Cache-Control", "").lower()
    v = layer.before(body["model"], body["messages"], no_cache=no_cache)
    headers.update(v.headers)                          # every x-vsr-* header, on every answer below
    if v.action in ("block", "cached"):
        # Answered by the API itself: no tokenization, no worker. HTTP 200, one choice,
        # message {"role": "assistant", "content": v.answer}, finish_reason v.finish_reason
        # ("content_filter" for a block, "stop" for a cache hit), response "model": v.model,
        # usage {prompt_tokens: 0, completion_tokens: 0, total_tokens: 0} (nothing was generated).
        # With "stream": true, send the same as SSE: a role chunk, one chunk with the whole v.answer
        # (or a few word-sized chunks), a chunk with finish_reason v.finish_reason, the usage chunk if
        # stream_options.include_usage, then "data: [DONE]".
        return answer_locally(v)
    # v.action == "forward": generate as before, but with
    #   model    = v.model       (the served model chosen for "MoM"/"auto", or the name asked for;
    #                             also the response's "model" field)
    #   messages = v.messages    (category system prompt injected when x-vsr-injected-system-prompt)
    #   v.reasoning: the category's reasoning mode (True/False; None: no category decided), applied as
    #                `enable_thinking` where the model's chat template reads it (api.semantic.reasoning_template_kwargs)
    text, finish_reason = generate(v.model, v.messages, ...)     # streamed or not: collect the text
    layer.after(v, text, finish_reason)                           # stores it in the semantic cache

`after()` stores only complete answers (finish_reason "stop"), never when the request said
`Cache-Control: no-cache`, and never for a block or a hit. Errors from the layer are bugs: the route may
log them and forward the request unchanged (`SemanticLayer.passthrough(model, messages)`).

Order inside `before()` (issue 8): jailbreak guard -> PII guard -> semantic cache -> classification ->
model selection -> system prompt injection. PII is reported in `x-vsr-pii-detected` on every answer (the
types found, allowed or not); only types the answering model's policy denies block the request. The embedding of the last user message is computed once and
shared. The route decision (category, model, injected prompt) is computed before the cache lookup because
the cache is partitioned by the model that answers and the effective system prompt: a hit is only ever an
answer that same model gave under that same system prompt (and the same earlier turns).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from farm.config import FarmConfig
from farm.config.semantic import SemanticConfig
from farm.infra.cooperative import offload
from farm.semantic.cache import (
    CacheQuery,
    SemanticCache,
    guard_signature,
    make_cache,
    partition_key,
    text_sha,
    word_sequence,
)
from farm.semantic.classifier import CategoryClassifier
from farm.semantic.heads import heads_meta, load_heads
from farm.semantic.jailbreak import JailbreakDetector
from farm.semantic.pii import PIIDetector
from farm.semantic.selection import ModelSelector, inject_system_prompt, message_text, system_prompt_of

H_JB_BLOCKED, H_JB_TYPE, H_JB_CONF = "x-vsr-jailbreak-blocked", "x-vsr-jailbreak-type", "x-vsr-jailbreak-confidence"
H_PII_VIOLATION, H_PII_TYPES, H_PII_DETECTED = "x-vsr-pii-violation", "x-vsr-pii-types", "x-vsr-pii-detected"
H_CACHE_HIT = "x-vsr-cache-hit"
H_CATEGORY, H_MODEL, H_REASONING = "x-vsr-selected-category", "x-vsr-selected-model", "x-vsr-selected-reasoning"
H_REASONING_APPLIED = "x-vsr-reasoning-applied"
H_INJECTED = "x-vsr-injected-system-prompt"


@dataclass
class Verdict:
    """What to do with one request: answer it here (`block`, `cached`) or `forward` it to the workers."""

    action: Literal["block", "cached", "forward"]
    model: str  # the model that answers (forward), answered (cached), or would have (block)
    messages: list[dict]  # the messages to generate from (system prompt injected)
    headers: dict[str, str] = field(default_factory=dict)
    answer: str | None = None  # refusal or cached text (block / cached)
    finish_reason: str | None = None  # "content_filter" (block) or "stop" (cached)
    category: str | None = None
    confidence: float = 0.0
    reasoning: bool | None = None  # the category's reasoning mode; None: no category decided
    cache_query: CacheQuery | None = None  # set when the answer of a forwarded request may be stored
    timings_ms: dict[str, float] = field(default_factory=dict)

    def as_miss(self) -> Verdict:
        """A cache hit the request cannot take (e.g. longer than its max_tokens): generate instead."""
        headers = {k: v for k, v in self.headers.items() if k != H_CACHE_HIT}
        return Verdict("forward", self.model, self.messages, headers, None, None, self.category, self.confidence,
                       self.reasoning, None, self.timings_ms)


class SemanticLayer:
    def __init__(self, cfg: SemanticConfig, default_model: str, embedder, classifier: CategoryClassifier,
                 jailbreak: JailbreakDetector, pii: PIIDetector | None, cache: SemanticCache | None,
                 served: Callable[[], set[str]] | None = None) -> None:
        self.cfg = cfg
        self.embedder = embedder
        self.classifier = classifier
        self.jailbreak = jailbreak
        self.pii = pii
        self.cache = cache
        self.selector = ModelSelector(cfg, default_model, served)

    @classmethod
    def from_config(cls, cfg: FarmConfig, redis_client=None, served: Callable[[], set[str]] | None = None,
                    embedder=None) -> SemanticLayer:
        """Build from a FarmConfig: loads the embedder (once per process) and the trained heads.

        `served()` returns the model names that can answer now (live workers); None = every model.
        """
        from farm.semantic.embeddings import get_embedder

        scfg: SemanticConfig = cfg.semantic
        emb = embedder or get_embedder(threads=scfg.embedding_threads, backend=scfg.embedding_backend)
        emb.max_tokens = scfg.max_embed_tokens
        heads = load_heads()
        cache = None
        if scfg.cache.enabled:
            if scfg.cache.backend == "redis" and redis_client is None:
                from farm.infra.redis_client import connect

                redis_client = connect(cfg.redis)
            cache = make_cache(scfg.cache, redis_client)
        pii = PIIDetector(threshold=scfg.pii.threshold) if scfg.pii.enabled else None
        jailbreak = JailbreakDetector.shipped(scfg.jailbreak.head, heads, heads_meta(), scfg.jailbreak.threshold)
        layer = cls(scfg, cfg.default_model, emb, CategoryClassifier(heads["cat"]), jailbreak, pii, cache, served)
        emb.encode(["warm up the encoder"])  # first calls build kernels: keep them off the first request
        emb.encode_one("warm up the per-request path")
        if pii is not None:
            pii.warm_up()
        return layer

    def is_alias(self, model: str) -> bool:
        return self.selector.is_alias(model)

    @staticmethod
    def passthrough(model: str, messages: list[dict]) -> Verdict:
        return Verdict("forward", model, messages)

    # -- the request path ------------------------------------------------------------------------------
    def before(self, model: str, messages: list[dict], no_cache: bool = False, tenant: str = "") -> Verdict:
        """`tenant` (the API key's owner id) partitions the cache unless `cache.shared_across_tenants`."""
        cfg = self.cfg
        if not cfg.enabled:
            return self.passthrough(model, messages)
        t: dict[str, float] = {}
        t0 = time.perf_counter()
        user_idx = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        user_texts = [message_text(messages[i].get("content")) for i in user_idx]
        last = user_texts[-1] if user_texts else ""

        # one embedding of the last user message, shared by every stage below
        vec, truncated = self.embedder.encode_one(last) if last else (np.zeros(384, np.float32), False)
        t["embed"] = _ms(t0)

        # 1. jailbreak guard
        if cfg.jailbreak.enabled and last:
            s = time.perf_counter()
            jb = self.jailbreak.detect(vec[None, :], [last])[0]
            t["jailbreak"] = _ms(s)
            if jb.is_jailbreak:
                return Verdict("block", model, messages, {
                    H_JB_BLOCKED: "true", H_JB_TYPE: jb.type, H_JB_CONF: f"{jb.confidence:.3f}"},
                    cfg.refusal_jailbreak, "content_filter", timings_ms=_total(t, t0))

        # the route (classification + selection) is needed by the PII policy of "MoM" and by the cache
        s = time.perf_counter()
        cat = self.classifier.classify(vec[None, :], [last])[0] if last else None
        route = self.selector.select(model, cat.name if cat else "other", cat.confidence if cat else 0.0)
        t["classify"] = _ms(s)

        # 2. PII guard: every user message, reported always, blocked by the answering model's policy
        headers: dict[str, str] = {}
        if cfg.pii.enabled and self.pii is not None:
            s = time.perf_counter()
            found = {e.type for text in user_texts if text for e in offload(self.pii.detect, text)}
            policy_name = model if (model in cfg.pii.policies or not route.routed) else route.model
            bad = cfg.pii.policy(policy_name).violations(found)
            t["pii"] = _ms(s)
            if found:
                headers[H_PII_DETECTED] = ",".join(sorted(found))
            if bad:
                labels = ",".join(f"B-{x}" for x in sorted(bad))
                return Verdict("block", route.model, messages,
                               {**headers, H_PII_VIOLATION: "true", H_PII_TYPES: labels},
                               cfg.refusal_pii.format(types=labels), "content_filter", timings_ms=_total(t, t0))

        # 5./6. selection headers and system prompt injection
        headers[H_MODEL] = route.model
        if route.category:
            headers[H_CATEGORY] = route.category
        if route.reasoning is not None:
            headers[H_REASONING] = "on" if route.reasoning else "off"
        out_messages = messages
        cc = route.category_cfg
        if route.routed and cc and cc.system_prompt and cfg.inject_system_prompt:
            out_messages = inject_system_prompt(messages, cc.system_prompt, cc.system_prompt_mode or cfg.system_prompt_mode)
            headers[H_INJECTED] = "true"

        # 3. semantic cache, partitioned by tenant + answering model + effective system prompt + earlier turns
        query = None
        if self.cache is not None and not no_cache and last:
            s = time.perf_counter()
            last_user = max(i for i, m in enumerate(out_messages) if m.get("role") == "user")
            history = [{"role": m.get("role"), "content": message_text(m.get("content"))}
                       for m in out_messages[:last_user] if m.get("role") not in ("system", "developer")]
            owner = "" if cfg.cache.shared_across_tenants else tenant
            query = CacheQuery(partition_key(route.model, system_prompt_of(out_messages), history, owner), vec,
                               text_sha(last), guard_signature(last), truncated, word_sequence(last))
            hit = self.cache.lookup(query)
            t["cache"] = _ms(s)
            if hit is not None:
                headers[H_CACHE_HIT] = "true"
                return Verdict("cached", route.model, out_messages, headers, hit.answer, "stop",
                               route.category, route.confidence, route.reasoning, None, _total(t, t0))
        return Verdict("forward", route.model, out_messages, headers, None, None, route.category,
                       route.confidence, route.reasoning, query, _total(t, t0))

    def after(self, verdict: Verdict, answer_text: str, finish_reason: str = "stop") -> bool:
        """Store a forwarded request's complete answer in the semantic cache; True when stored."""
        if (verdict.action != "forward" or verdict.cache_query is None or self.cache is None
                or finish_reason != "stop" or not answer_text.strip()):
            return False
        self.cache.store(verdict.cache_query, answer_text)
        return True


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def _total(t: dict[str, float], t0: float) -> dict[str, float]:
    t["total"] = _ms(t0)
    return t
