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
types found, allowed or not); only types the answering model's policy denies block the request. The PII pass
starts first, on the analyzer's own thread, and runs while the messages are embedded and judged: a request waits
for the longer of the two, not their sum.

Both guards read every message of the conversation (issue 29): instructions hidden in a system, developer,
assistant or tool turn, or PII in an earlier turn, count as in the last user turn; a message sent encoded
(base64, hex, ROT13) is judged by what it decodes to as well (farm.semantic.decoding). The cache reads the
user's last turn (partitioned by the earlier ones); in a conversation the category is the conversation's, the one
its first confidently classified user turn got (farm.semantic.conversation), so a follow-up keeps its model, its
system prompt and with them the history's cached prefix. The messages' embeddings are computed in padded forwards of
similar lengths, and kept in a small per-process memo (with each text's PII types), so a conversation's earlier
turns, sent again with every request, are embedded and scanned once. The last user message's embedding is
shared by every stage. The route decision (category, model, injected prompt) is computed before the cache lookup because
the cache is partitioned by the model that answers and the effective system prompt: a hit is only ever an
answer that same model gave under that same system prompt (and the same earlier turns).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import xxhash

from farm.config import FarmConfig
from farm.config.semantic import SemanticConfig
from farm.semantic.cache import (
    CacheQuery,
    SemanticCache,
    guard_signature,
    make_cache,
    partition_key,
    text_sha,
    word_sequence,
)
from farm.semantic.classifier import (
    SIGNAL_OF_RULE,
    Category,
    CategoryClassifier,
    CustomCategories,
    KeywordCategories,
)
from farm.semantic.conversation import conversation_category
from farm.semantic.embeddings import Encoded
from farm.semantic.heads import heads_meta, load_heads
from farm.semantic.jailbreak import AttackPatterns, JailbreakDetector, JailbreakResult
from farm.semantic.pii import Entity, PIIDetector
from farm.semantic.remote_guard import RemoteGuard, RemoteGuardError
from farm.semantic.selection import ModelSelector, Route, inject_system_prompt, message_text, system_prompt_of

H_JB_BLOCKED, H_JB_TYPE, H_JB_CONF = "x-vsr-jailbreak-blocked", "x-vsr-jailbreak-type", "x-vsr-jailbreak-confidence"
H_PII_VIOLATION, H_PII_TYPES, H_PII_DETECTED = "x-vsr-pii-violation", "x-vsr-pii-types", "x-vsr-pii-detected"
H_CACHE_HIT = "x-vsr-cache-hit"
H_CATEGORY, H_MODEL, H_REASONING = "x-vsr-selected-category", "x-vsr-selected-model", "x-vsr-selected-reasoning"
H_REASONING_APPLIED = "x-vsr-reasoning-applied"
H_INJECTED = "x-vsr-injected-system-prompt"
H_FALLBACK = "x-vsr-fallback"  # MoM passed over models (no live worker; or failed before a token): fallback_value
H_SELECTION_REASON = "x-vsr-selection-reason"  # why MoM chose this model: score | default | fallback | kv-cache | load
# the category came from an earlier user turn of the conversation (farm.semantic.conversation): "turn=<n>" (1-based,
# among the user turns), "; switched" when a turn after the first moved the conversation there
H_AFFINITY = "x-vsr-conversation-affinity"
# as the Semantic Router sends them for a routed request: the category's confidence, and the signal that matched
# it (x-vsr-matched-domains: the head; -embeddings: a user category by similarity; -keywords: by keywords)
H_CONFIDENCE = "x-vsr-selected-confidence"
H_DECISION = "x-vsr-selected-decision"  # the Semantic Router decision a category was imported from, else its name
MATCHED_PREFIX = "x-vsr-matched-"
H_FAST = "x-vsr-fast-response"  # answered with the category's fast_response, no model involved
# the roles whose text the guards read; "function" is the legacy name of a tool result
SCANNED_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MEMO_ENTRIES = 4096  # texts whose embedding and PII types are kept per process (about 1.6 kB each)
# MoM among models that score alike (Route.tied): (tied models, the messages as the model would get them, the
# caller's scope, its KV cache salt) -> (the model, why: "kv-cache" | "load"), or None to keep the best-scored
# one. The API's answers from the router's KV index and load (api/app.py, FarmContext.prefer_model).
Prefer = Callable[[tuple[str, ...], list[dict], str], tuple[str, str] | None]

V = TypeVar("V")
log = logging.getLogger(__name__)


def fallback_value(passed_over: list[str] | tuple[str, ...], model: str, reason: str) -> str:
    """x-vsr-fallback: the models MoM passed over, the one that answers, and why."""
    return f"{','.join(passed_over)}->{model}; reason={reason}"


class Memo(Generic[V]):
    """A bounded least-recently-used map from a text's digest, within one scope, to what was computed from it: a
    tenant (or one end user of a key, by its cache_salt) never gets another's text answered from the memo (its speed
    would tell that someone sent it)."""

    def __init__(self, size: int = MEMO_ENTRIES) -> None:
        self.size = size
        self._d: OrderedDict[bytes, V] = OrderedDict()
        self._lock = threading.Lock()  # a batch driver's threads share the layer

    @staticmethod
    def key(text: str, scope: str) -> bytes:
        """A digest, not the text: the memo keeps no message in memory."""
        return xxhash.xxh3_128_digest(f"{scope}\0{text}".encode("utf-8", "surrogatepass"))

    def get(self, text: str, scope: str) -> V | None:
        k = self.key(text, scope)
        with self._lock:
            v = self._d.get(k)
            if v is not None:
                self._d.move_to_end(k)
            return v

    def put(self, text: str, value: V, scope: str) -> None:
        k = self.key(text, scope)
        with self._lock:
            self._d[k] = value
            self._d.move_to_end(k)
            while len(self._d) > self.size:
                self._d.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()


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
    # why (for `farm semantic test` and logs): the category's rule and runners-up, each guard's findings
    explain: dict[str, Any] = field(default_factory=dict)
    # MoM: the category's next models, in order, for a request whose model fails before its first token
    alternatives: tuple[str, ...] = ()

    def as_miss(self) -> Verdict:
        """A cache hit the request cannot take (e.g. longer than its max_tokens): generate instead."""
        headers = {k: v for k, v in self.headers.items() if k != H_CACHE_HIT}
        return Verdict("forward", self.model, self.messages, headers, None, None, self.category, self.confidence,
                       self.reasoning, None, self.timings_ms, self.explain, self.alternatives)


ALL_SIGNALS = frozenset({"category", "jailbreak", "pii"})


@dataclass
class Signals:
    """One text's signals (SemanticLayer.signals): each None when not asked for or its stage is off."""

    text: str
    category: Category | None = None
    route: Route | None = None  # the model the category gives the alias asked about
    jailbreak: JailbreakResult | None = None
    jailbreak_threshold: float = 0.0
    pii: list[Entity] | None = None
    pii_denied: set[str] = field(default_factory=set)  # types the answering model's policy blocks
    ms: float = 0.0


class SemanticLayer:
    def __init__(self, cfg: SemanticConfig, default_model: str, embedder, classifier: CategoryClassifier,
                 jailbreak: JailbreakDetector, pii: PIIDetector | None, cache: SemanticCache | None,
                 served: Callable[[], set[str]] | None = None, prefer: Prefer | None = None) -> None:
        self.cfg = cfg
        self.embedder = embedder
        self.classifier = classifier
        self.jailbreak = jailbreak
        self.pii = pii
        self.cache = cache
        self.selector = ModelSelector(cfg, default_model, served)
        self.prefer = prefer
        self._vectors: Memo[Encoded] = Memo()
        self._pii_types: Memo[frozenset[str]] = Memo()
        remote = cfg.jailbreak.remote
        self.remote = RemoteGuard(remote) if remote is not None and cfg.jailbreak.enabled else None
        self._remote_found: Memo[JailbreakResult] = Memo()  # the remote guard's verdicts, per scope

    @classmethod
    def from_config(cls, cfg: FarmConfig, redis_client=None, served: Callable[[], set[str]] | None = None,
                    embedder=None, prefer: Prefer | None = None) -> SemanticLayer:
        """Build from a FarmConfig: loads the embedder (once per process) and the trained heads.

        `served()` returns the model names that can answer now (live workers); None = every model. `prefer`
        chooses among models that score alike (Prefer); None = the best score alone.
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
        jcfg = scfg.jailbreak
        patterns = AttackPatterns.from_texts(jcfg.patterns, jcfg.benign_patterns, jcfg.pattern_threshold,
                                             lambda xs: np.stack([e.for_head("jb") for e in emb.encode_texts(xs)]))
        jailbreak = JailbreakDetector.shipped(heads, heads_meta(), jcfg.threshold, patterns)
        custom = CustomCategories.from_config(scfg.categories, emb)  # the user's categories, embedded once
        classifier = CategoryClassifier(heads["cat"], custom, scfg.classifier.custom_threshold,
                                        keywords=KeywordCategories.from_config(scfg.categories))
        layer = cls(scfg, cfg.default_model, emb, classifier, jailbreak, pii, cache, served, prefer)
        emb.encode(["warm up the encoder"])  # first calls build kernels: keep them off the first request
        emb.encode_one("warm up the per-request path")
        if pii is not None:
            pii.warm_up()
        return layer

    def forget(self) -> None:
        """Drop what the per-process memos remember (embeddings, PII types, the remote guard's verdicts): a bench
        or a test that must pay each text's whole cost again."""
        self._vectors.clear()
        self._pii_types.clear()
        self._remote_found.clear()

    def is_alias(self, model: str) -> bool:
        return self.selector.is_alias(model)

    @staticmethod
    def passthrough(model: str, messages: list[dict]) -> Verdict:
        return Verdict("forward", model, messages)

    # -- the request path ------------------------------------------------------------------------------
    def before(self, model: str, messages: list[dict], no_cache: bool = False, scope: str = "",
               tenant: str = "") -> Verdict:
        """`scope` is the caller's: the request's KV cache salt (`farm.tenancy.api_keys.tenant_cache_salt` of its
        key's owner and its own `cache_salt`; "" is one scope for all). It partitions the memo and the cache (unless
        `cache.shared_across_tenants`) and salts `prefer`'s look at the KV index. `tenant` is the key owner's salt
        alone (no client `cache_salt`, which a client may vary at will): the share of the cache its answers count
        against."""
        cfg = self.cfg
        if not cfg.enabled:
            return self.passthrough(model, messages)
        t: dict[str, float] = {}
        t0 = time.perf_counter()
        scanned = [(i, m.get("role"), message_text(m.get("content"))) for i, m in enumerate(messages)
                   if m.get("role") in SCANNED_ROLES]
        scanned = [x for x in scanned if x[2].strip()]
        users = [x for x in scanned if x[1] == "user"]
        last = users[-1][2] if users else ""
        texts = list(dict.fromkeys(x[2] for x in scanned))  # each distinct text once
        # the user turns the category is folded from (farm.semantic.conversation), or the last one alone
        conversation = cfg.conversation.affinity and len(users) > 1
        user_texts = list(dict.fromkeys(x[2] for x in users)) if conversation else [last] if last else []

        # the PII pass of every message starts first, on its own thread, and runs while the texts are embedded
        pii_of = self._start_pii(texts, scope) if cfg.pii.enabled and self.pii is not None else None
        # embeddings of every message (the last user message's is shared by every stage below)
        vectors = self._embed(texts if cfg.jailbreak.enabled else user_texts, scope)
        vec, truncated = (vectors[last].vector, vectors[last].truncated) if last else (np.zeros(384, np.float32), False)
        t["embed"] = _ms(t0)
        explain: dict[str, Any] = {}

        # 1. jailbreak guard, on every message: an instruction hidden in a system, assistant or tool turn too
        if cfg.jailbreak.enabled and texts:
            s = time.perf_counter()
            found = self.jailbreak.screen(texts, lambda xs: self._guard_vectors(xs, scope))
            by_text = dict(zip(texts, found, strict=True))
            # the message furthest above (or least below) its role's threshold
            worst = max(scanned, key=lambda x: by_text[x[2]].confidence - self._jb_threshold(x[1]))
            jb = by_text[worst[2]]
            blocked = jb.confidence >= self._jb_threshold(worst[1])
            explain["jailbreak"] = {"blocked": blocked, "type": jb.type, "confidence": jb.confidence,
                                    "message": worst[0], "role": worst[1], "threshold": self._jb_threshold(worst[1])}
            if not blocked and self.remote is not None:  # the second check, on what the head was unsure of
                asked_roles = self.remote.cfg.roles
                remote, explain["jailbreak"]["remote"] = self._remote_screen(
                    list(dict.fromkeys(x[2] for x in scanned if x[1] in asked_roles)), by_text, scope)
                flagged = [x for x in scanned if x[1] in asked_roles and x[2] in remote and remote[x[2]].is_jailbreak]
                if flagged:
                    worst = max(flagged, key=lambda x: remote[x[2]].confidence)
                    jb, blocked = remote[worst[2]], True
                    explain["jailbreak"].update(blocked=True, type=jb.type, confidence=jb.confidence,
                                                message=worst[0], role=worst[1], guard="remote",
                                                threshold=self.cfg.jailbreak.remote.threshold)
            t["jailbreak"] = _ms(s)
            if blocked:
                return Verdict("block", model, messages, {
                    H_JB_BLOCKED: "true", H_JB_TYPE: jb.type, H_JB_CONF: f"{jb.confidence:.3f}"},
                    cfg.refusal_jailbreak, "content_filter", timings_ms=_total(t, t0), explain=explain)

        # the route (classification + selection) is needed by the PII policy of "MoM" and by the cache
        s = time.perf_counter()
        cat, affinity = None, ""
        if conversation:  # the conversation's category, as its deciding turn got it (not a follow-up's own)
            keywords = self.classifier.keywords
            conv = conversation_category([(vectors[x[2]], x[2]) for x in users], self._decide,
                                         cfg.classifier.threshold, cfg.conversation.switch_confidence,
                                         keyword=keywords.match if keywords is not None else None)
            cat = conv.category
            explain["conversation"] = {"user_turns": len(users), "decided_at_turn": conv.decided_at + 1,
                                       "switched": conv.switched, "last_turn": {
                                           "name": conv.turn.name, "confidence": conv.turn.confidence}}
            if conv.decided_at < len(users) - 1:
                affinity = f"turn={conv.decided_at + 1}" + ("; switched" if conv.switched else "")
        elif last:
            cat = self._decide(vectors[last], last)
        route = self.selector.select(model, cat.name if cat else "other", cat.confidence if cat else 0.0)
        if cat is not None:
            explain["category"] = {"name": cat.name, "confidence": cat.confidence, "rule": cat.rule,
                                   "accepted": route.category is not None, "alternatives": list(cat.alternatives)}
        chosen = cfg.category(route.category) if route.category and cat is not None else None
        if chosen is not None and chosen.fast_response:  # the category's fixed answer: no model, whatever was asked
            t["classify"] = _ms(s)
            return Verdict("block", route.model, messages,
                           {H_FAST: "true", **category_headers(chosen.name, cat, chosen.decision)},
                           chosen.fast_response, "stop", category=chosen.name, confidence=cat.confidence,
                           timings_ms=_total(t, t0), explain=explain)
        out_messages = messages
        cc = route.category_cfg
        if route.routed and cc and cc.system_prompt and cfg.inject_system_prompt:
            out_messages = inject_system_prompt(messages, cc.system_prompt, cc.system_prompt_mode or cfg.system_prompt_mode)
        t["classify"] = _ms(s)
        if route.tied and self.prefer is not None:  # models that score alike: where would the prompt start first?
            s = time.perf_counter()
            choice = self.prefer(route.tied, out_messages, scope)
            if choice is not None:  # the best-scored model becomes the first alternative
                others = tuple(m for m in (route.model, *route.alternatives) if m != choice[0])
                route = dataclasses.replace(route, model=choice[0], reason=choice[1],
                                            alternatives=others[:len(route.alternatives)])
                explain["selection"] = {"tied": list(route.tied), "model": choice[0], "reason": choice[1]}
            t["select"] = _ms(s)

        # 2. PII guard: every message, reported always, blocked by the answering model's policy
        headers: dict[str, str] = {}
        if pii_of is not None:
            s = time.perf_counter()
            per_text = pii_of()  # the time waited for the pass beyond the stages above
            found = set().union(*per_text.values()) if per_text else set()
            policy_name = self._pii_policy_model(model, route)
            bad = cfg.pii.policy(policy_name).violations(found)
            explain["pii"] = {"found": sorted(found), "denied": sorted(bad), "policy": policy_name,
                              "messages": [(i, role, sorted(per_text[text])) for i, role, text in scanned
                                           if per_text[text]]}
            t["pii"] = _ms(s)
            if found:
                headers[H_PII_DETECTED] = ",".join(sorted(found))
            if bad:
                labels = ",".join(f"B-{x}" for x in sorted(bad))
                return Verdict("block", route.model, messages,
                               {**headers, H_PII_VIOLATION: "true", H_PII_TYPES: labels},
                               cfg.refusal_pii.format(types=labels), "content_filter", timings_ms=_total(t, t0),
                               explain=explain)

        # 5./6. selection headers and system prompt injection
        headers[H_MODEL] = route.model
        if route.routed:
            headers[H_SELECTION_REASON] = route.reason
        if route.passed_over:
            headers[H_FALLBACK] = fallback_value(route.passed_over, route.model, "no-live-worker")
            explain["fallback"] = {"passed_over": list(route.passed_over), "model": route.model}
        if route.category and cat is not None:
            headers.update(category_headers(route.category, cat, chosen.decision if chosen is not None else ""))
            if affinity:
                headers[H_AFFINITY] = affinity
        if route.reasoning is not None:
            headers[H_REASONING] = "on" if route.reasoning else "off"
        if out_messages is not messages:
            headers[H_INJECTED] = "true"

        # 3. semantic cache, partitioned by scope + answering model + effective system prompt + earlier turns
        query = None
        if self.cache is not None and not no_cache and last:
            s = time.perf_counter()
            last_user = max(i for i, m in enumerate(out_messages) if m.get("role") == "user")
            history = [{"role": m.get("role"), "content": message_text(m.get("content"))}
                       for m in out_messages[:last_user] if m.get("role") not in ("system", "developer")]
            shared = cfg.cache.shared_across_tenants
            query = CacheQuery(partition_key(route.model, system_prompt_of(out_messages), history,
                                             "" if shared else scope), vec, text_sha(last), guard_signature(last),
                               truncated, word_sequence(last), "" if shared else tenant)
            hit = self.cache.lookup(query)
            t["cache"] = _ms(s)
            if hit is not None:
                headers[H_CACHE_HIT] = "true"
                return Verdict("cached", route.model, out_messages, headers, hit.answer, "stop",
                               route.category, route.confidence, route.reasoning, None, _total(t, t0), explain)
        return Verdict("forward", route.model, out_messages, headers, None, None, route.category,
                       route.confidence, route.reasoning, query, _total(t, t0), explain, route.alternatives)

    # -- one text's signals, each read on its own (the classification API) --------------------------------
    def signals(self, text: str, model: str = "", scope: str = "", want: frozenset[str] = ALL_SIGNALS) -> Signals:
        """What each stage reads in `text` (a user message), every stage run whatever the others found: the
        category and the model `model` (an alias, by default the first) would get, the jailbreak guard's
        probability, and the PII entities with their offsets. No cache, nothing blocked, nothing stored."""
        return self.signals_many([text], model, scope, want)[0]

    def signals_many(self, texts: list[str], model: str = "", scope: str = "",
                     want: frozenset[str] = ALL_SIGNALS) -> list[Signals]:
        """`signals` of each text, read together: the encoder's forwards shared by the texts (padded by length),
        one PII pass over all of them beside it. Each Signals' `ms` is the whole call's time."""
        t0 = time.perf_counter()
        model = model or self.cfg.aliases[0]
        pii = self.pii if "pii" in want and self.cfg.pii.enabled else None
        pending = pii.start_detect_many(texts) if pii is not None and texts else None
        if not self.cfg.jailbreak.enabled:
            want = want - {"jailbreak"}
        out = [Signals(text) for text in texts]
        if want & {"category", "jailbreak"} and texts:
            encoded = self._embed(list(dict.fromkeys(texts)), scope)
            if "category" in want:
                for sig in out:
                    sig.category = self._decide(encoded[sig.text], sig.text)
                    sig.route = self.selector.select(model, sig.category.name, sig.category.confidence)
            if "jailbreak" in want:
                threshold = self._jb_threshold("user")
                found = self.jailbreak.screen(texts, lambda xs: self._guard_vectors(xs, scope))
                unsure = {t: jb for t, jb in zip(texts, found, strict=True) if jb.confidence < threshold}
                remote = self._remote_screen(list(unsure), unsure, scope)[0] if self.remote is not None else {}
                for sig, jb in zip(out, found, strict=True):
                    sig.jailbreak, sig.jailbreak_threshold = jb, threshold
                    if sig.text in remote and remote[sig.text].is_jailbreak:  # the remote guard's block
                        sig.jailbreak = remote[sig.text]
                        sig.jailbreak_threshold = self.cfg.jailbreak.remote.threshold
        if pending is not None:
            for sig, entities in zip(out, pending(), strict=True):
                sig.pii = entities
                policy = self._pii_policy_model(model, sig.route)
                sig.pii_denied = self.cfg.pii.policy(policy).violations({e.type for e in entities})
        ms = _ms(t0)
        for sig in out:
            sig.ms = ms
        return out

    def _pii_policy_model(self, model: str, route: Route | None) -> str:
        """Whose PII policy decides: the model asked for when it has a policy or is not an alias, else the model
        the alias chose (the default model when no route was taken)."""
        if model in self.cfg.pii.policies or not self.is_alias(model):
            return model
        return route.model if route is not None else self.selector.default_model

    def _remote_screen(self, texts: list[str], local: dict[str, JailbreakResult],
                       scope: str) -> tuple[dict[str, JailbreakResult], dict[str, Any]]:
        """The remote guard's verdicts on the texts whose head probability reaches `ask_above` (remembered ones
        from the scope's memo), and what happened, for `explain`. On a failure `on_error` decides: `allow`
        leaves those texts to the head, `block` flags them as `guard_unavailable`."""
        assert self.remote is not None
        rcfg = self.remote.cfg
        asked = [t for t in texts if local[t].confidence >= rcfg.ask_above]
        out = {t: v for t in asked if (v := self._remote_found.get(t, scope)) is not None}
        todo = [t for t in asked if t not in out]
        report: dict[str, Any] = {"asked": len(todo), "remembered": len(out)}
        t0 = time.perf_counter()
        try:
            for text, (p, label) in zip(todo, self.remote.attack_probabilities(todo), strict=True):
                flagged = p >= rcfg.threshold
                out[text] = JailbreakResult(flagged, label if flagged else "benign", p)
                self._remote_found.put(text, out[text], scope)
        except RemoteGuardError as e:
            log.warning("remote jailbreak guard failed (on_error=%s): %s", rcfg.on_error, e)
            report["error"] = str(e)
            if rcfg.on_error == "block":
                out.update({t: JailbreakResult(True, "guard_unavailable", 1.0) for t in todo})
        if todo:
            report["ms"] = _ms(t0)
        return out, report

    def _jb_threshold(self, role: str) -> float:
        """The attack probability that blocks a message of this role (operators' turns: see system_threshold)."""
        base = self.jailbreak.threshold
        return max(base, self.cfg.jailbreak.system_threshold) if role in ("system", "developer") else base

    def _embed(self, texts: list[str], scope: str) -> dict[str, Encoded]:
        """Each text through the encoder: from the scope's memo, the rest in one call to the encoder."""
        out: dict[str, Encoded] = {}
        todo = []
        for text in texts:
            hit = self._vectors.get(text, scope)
            if hit is None:
                todo.append(text)
            else:
                out[text] = hit
        if todo:
            for text, enc in zip(todo, self.embedder.encode_texts(todo), strict=True):
                self._vectors.put(text, enc, scope)
                out[text] = enc
        return out

    def _guard_vectors(self, texts: list[str], scope: str) -> np.ndarray:
        """The texts' guard vectors in their order (what the jailbreak guard scores: messages and their decodings)."""
        encoded = self._embed(texts, scope)
        return np.stack([encoded[t].for_head("jb") for t in texts])

    def _decide(self, enc: Encoded, text: str) -> Category:
        """A text's category from its encoding: the head reads its adapter's vector, custom categories the embedding."""
        return self.classifier.decide(enc.vector, text, head_vec=enc.for_head("cat"))

    def _start_pii(self, texts: list[str], scope: str) -> Callable[[], dict[str, frozenset[str]]]:
        """The PII types in each text, started now and waited for by the returned function: remembered ones
        (earlier turns come back with every request), the rest found in one pass of the detector, which runs on
        its own thread while this one embeds the texts (farm.semantic.pii)."""
        assert self.pii is not None
        out = {text: self._pii_types.get(text, scope) for text in texts}
        todo = [text for text, types in out.items() if types is None]
        pending = self.pii.start_detect_many(todo) if todo else None

        def result() -> dict[str, frozenset[str]]:
            if pending is not None:
                for text, entities in zip(todo, pending(), strict=True):
                    types = frozenset(e.type for e in entities)
                    self._pii_types.put(text, types, scope)
                    out[text] = types
            return {text: types or frozenset() for text, types in out.items()}

        return result

    def after(self, verdict: Verdict, answer_text: str, finish_reason: str = "stop") -> bool:
        """Store a forwarded request's complete answer in the semantic cache; True when stored."""
        if (verdict.action != "forward" or verdict.cache_query is None or self.cache is None
                or finish_reason != "stop" or not answer_text.strip()):
            return False
        self.cache.store(verdict.cache_query, answer_text)
        return True


def category_headers(name: str, cat: Category, decision: str = "") -> dict[str, str]:
    """x-vsr-selected-category, its decision, its confidence and the x-vsr-matched-* header of the rule that
    decided it."""
    return {H_CATEGORY: name, H_DECISION: decision or name, H_CONFIDENCE: f"{cat.confidence:.3f}",
            MATCHED_PREFIX + SIGNAL_OF_RULE[cat.rule]: name}


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def _total(t: dict[str, float], t0: float) -> dict[str, float]:
    t["total"] = _ms(t0)
    return t
