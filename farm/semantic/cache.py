"""Semantic cache: one interface, two backends (Redis hashes + numpy by default, Milvus when scaled).

Partitions: every entry lives in a partition named by a hash of (tenant, model that answers, effective
system prompt, earlier turns of the conversation), so an answer is never served across API keys (unless
`shared_across_tenants`), models, system prompts or conversations; only the last user message is compared semantically. A hit needs cosine similarity
at or above the threshold *and* the same "guard signature" (the numbers in the text, as digits or words, and its negations:
"2+2" vs "2+3", "is" vs "is not" embed almost identically but have different answers) *and* no lexical
conflict (the same words reordered, or one content word swapped: "good"/"bad"). Below the threshold, by up to
`rephrased_margin`, a question asked in other words still hits unless it is the stored sentence with its
content changed in place (`same_frame_edit`: "... in the world" / "... in Africa"): sentence embeddings score real
rephrasings and such one-place edits alike (0.82-0.89), but the edits keep the stored sentence's frame and the
rephrasings do not. Prompts longer than the embedding window are only served on an exact text match.

Redis backend (default): entries are hashes with the vector as float32 bytes, a TTL, a per-partition
sorted set, a per-tenant one and a global one (oldest evicted first past `max_entries`, past
`max_partition_entries` in one partition, or past the tenant's share, `CacheConfig.tenant_share`, so one key's
flood evicts its own answers, not every tenant's), all written by one Lua script so concurrent API processes agree. Each process keeps
a numpy mirror per partition, reloaded only when the partition's version token in Redis changes, and
searches it by brute force (bounded by `max_partition_entries`). Shared by every API process; survives
restarts with Redis's AOF.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from farm.config.semantic import CacheConfig

# numbers as digits or as words ("the last three commits" is not "the last commit"); not "one", which is as
# often a pronoun ("how does one ...") or an article's stand-in ("one way to ...") as a count
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero _ two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen".split()) if w != "_"}
_NUMBER_WORDS.update({w: str(10 * i) for i, w in enumerate(
    "twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)})
_NUMBER_WORDS.update({"hundred": "100", "thousand": "1000", "million": "1000000", "billion": "1000000000",
                      "dozen": "12"})
_NUM = re.compile(r"\d+(?:[.,]\d+)?|\b(?:" + "|".join(_NUMBER_WORDS) + r")\b", re.I)
_NEG = re.compile(r"\b(?:not|no|never|none|cannot|without|n't)\b|n't\b", re.I)
_WORD = re.compile(r"[a-z0-9]+")


def guard_signature(text: str) -> str:
    """Numbers (in order; digits or number words) and the count of negations: two texts must agree on both to
    share an answer."""
    nums = ",".join(_NUMBER_WORDS.get(n.lower(), n).replace(",", ".") for n in _NUM.findall(text))
    return f"{nums}|{len(_NEG.findall(text))}"


_FUNCTION_WORDS = frozenset("""a an the is are was were be been am do does did can could would should will shall may might
must i you we they he she it my your our their me us what which who whom whose how why when where that this
these those of in on at to for from by with about into as and or so if please just exactly really tell give
explain show me some any kind way using via""".split())


_CONTRACTIONS = {"'s": "is", "n't": "not", "'re": "are", "'m": "am", "'ll": "will", "'ve": "have", "'d": "would"}
_CONTRACTION = re.compile(r"('s|n't|'re|'m|'ll|'ve|'d)\b")


def _norm_word(w: str) -> str:
    """Spelling variants compare equal: British -ise/-our, plural -s."""
    w = re.sub(r"is(e|ed|ing|ation)$", r"iz\1", w)
    w = re.sub(r"our$", "or", w)
    return w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w


# the function words as `word_sequence` writes them too ("does" -> "doe", "this" -> "thi")
_FUNCTION_WORDS = _FUNCTION_WORDS | frozenset(_norm_word(w) for w in _FUNCTION_WORDS)

# A one-place edit keeps at least this share of the longer sentence's words, in order: the development pairs' near
# misses kept 0.62-0.89 of it, their rephrasings 0.17-0.64 (tools/semantic/cache_held_out.py, bench/semantic.py).
_FRAME_SHARE = 0.6


def word_sequence(text: str) -> str:
    """Normalised lower-case words, space-joined: what the lexical guard compares."""
    text = _CONTRACTION.sub(lambda m: " " + _CONTRACTIONS[m.group(1)], text.lower().replace("\u2019", "'"))
    return " ".join(_norm_word(w) for w in _WORD.findall(text))


def lexical_conflict(a: str, b: str) -> bool:
    """True when two similar texts differ in a way embeddings blur: the same words reordered ("10 miles to
    km" / "10 km to miles"; a phrase moved whole, "In economics, what is inflation?", is the same question), or the
    same sentence with a content word swapped ("good" / "bad")."""
    wa, wb = a.split(), b.split()
    if wa == wb or len(wa) != len(wb):
        return False
    if sorted(wa) == sorted(wb):
        return not _one_block_moved(wa, wb)
    diff = [(x, y) for x, y in zip(wa, wb, strict=True) if x != y]
    return len(diff) <= 2 and any(x not in _FUNCTION_WORDS or y not in _FUNCTION_WORDS for x, y in diff)


def _one_block_moved(wa: list[str], wb: list[str]) -> bool:
    """wb is wa with one run of words moved elsewhere: between their common prefix and suffix, one side is a
    rotation of the other. Two words swapped are not ("miles to km" / "km to miles"; "dog food" / "food dog")."""
    n = len(wa)
    lo = next((i for i in range(n) if wa[i] != wb[i]), n)
    hi = next((i for i in range(n - 1, lo - 1, -1) if wa[i] != wb[i]), lo - 1) + 1
    mid_a, mid_b = wa[lo:hi], wb[lo:hi]
    return len(mid_a) > 2 and any(mid_b == mid_a[k:] + mid_a[:k] for k in range(1, len(mid_a)))


def _same_word(x: str, y: str) -> bool:
    """One word in two forms ("discovered" / "discoverer", "main" / "mainly"): a shared stem of 4+ letters that is
    most of the shorter word."""
    if x == y:
        return True
    n = len(x) if y.startswith(x) else len(y) if x.startswith(y) else next(
        i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b)
    return n >= 4 and n >= 0.75 * min(len(x), len(y))


def _only_one_side(words: list[str], other: list[str]) -> bool:
    """Whether `words` has a content word that `other` lacks in every form (`_same_word`): the other side's
    words indexed by their first 4 letters, the only ones a form of one word can share."""
    exact = set(other)
    by_stem: dict[str, list[str]] = {}
    for v in exact:
        by_stem.setdefault(v[:4], []).append(v)
    return any(w not in _FUNCTION_WORDS and w not in exact
               and not any(_same_word(w, v) for v in by_stem.get(w[:4], ())) for w in words)


def same_frame_edit(a: str, b: str) -> bool:
    """True when two word sequences (`word_sequence`) are one sentence with content changed in place: a content
    word that only one side has, while most of the words stand in the same order on both ("the tallest mountain in
    the world" / "in Africa", "center a div" / "center a div vertically"). A question rephrased shares little of
    its frame ("Which mountain is the highest on Earth?")."""
    wa, wb = a.split(), b.split()
    if not wa or not wb:
        return False
    if not _only_one_side(wa, wb) and not _only_one_side(wb, wa):
        return False
    kept = sum(m.size for m in difflib.SequenceMatcher(None, wa, wb, autojunk=False).get_matching_blocks())
    return kept >= _FRAME_SHARE * max(len(wa), len(wb))


def text_sha(text: str) -> str:
    return hashlib.sha256(" ".join(_WORD.findall(text.lower())).encode()).hexdigest()[:32]


def partition_key(model: str, system_prompt: str, history: list[dict], tenant: str = "") -> str:
    """sha256 of the tenant ("" = shared by all), the answering model, the effective system prompt and the
    turns before the last user message."""
    h = hashlib.sha256()
    if tenant:
        h.update(b"tenant\0" + tenant.encode() + b"\0")
    h.update(model.encode() + b"\0" + system_prompt.encode() + b"\0")
    h.update(json.dumps(history, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class CacheQuery:
    partition: str
    vector: np.ndarray  # unit length float32
    sha: str  # text_sha of the compared text
    signature: str  # guard_signature of the compared text
    exact_only: bool  # the text was truncated for embedding: only an exact match may hit
    words: str = ""  # word_sequence of the compared text (the lexical guard)
    # whose share of the cache a stored answer counts against (`CacheConfig.tenant_share`): the key owner's
    # cache salt, "" for none (a keyless farm, or a cache shared across tenants)
    tenant: str = ""


@dataclass(frozen=True)
class CacheHit:
    answer: str
    similarity: float
    entry_id: str


class SemanticCache(Protocol):
    def lookup(self, q: CacheQuery) -> CacheHit | None: ...
    def store(self, q: CacheQuery, answer: str) -> str: ...
    def clear(self) -> None: ...


def _acceptable(sim: float, q: CacheQuery, sha: str, sig: str, exact: bool, words: str, cfg: CacheConfig) -> bool:
    if q.exact_only or exact:
        return sha == q.sha
    if sim < cfg.lowest_hit or sig != q.signature:
        return False
    if lexical_conflict(words, q.words):
        return False
    return sim >= cfg.similarity_threshold or not same_frame_edit(words, q.words)


# -- Redis ------------------------------------------------------------------------------------------------
_STORE_LUA = """
local prefix, pid, eid = ARGV[1], ARGV[2], ARGV[3]
local ttl, now = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_all, max_part = tonumber(ARGV[6]), tonumber(ARGV[7])
local tenant, max_tenant = ARGV[15], tonumber(ARGV[16])
local ekey = prefix .. ':e:' .. pid .. ':' .. eid
local pkey = prefix .. ':p:' .. pid
local allkey = prefix .. ':all'
redis.call('HSET', ekey, 'v', ARGV[8], 'a', ARGV[9], 's', ARGV[10], 'g', ARGV[11], 'x', ARGV[12], 't', ARGV[5],
           'w', ARGV[14], 'o', tenant)
redis.call('EXPIRE', ekey, ttl)
redis.call('ZADD', pkey, now, eid)
redis.call('EXPIRE', pkey, ttl)
redis.call('ZADD', allkey, now, pid .. ':' .. eid)
redis.call('SET', prefix .. ':ver:' .. pid, ARGV[13], 'EX', ttl)
local function drop(member)
  local sep = string.find(member, ':', 1, true)
  local p, e = string.sub(member, 1, sep - 1), string.sub(member, sep + 1)
  local ek = prefix .. ':e:' .. p .. ':' .. e
  local owner = redis.call('HGET', ek, 'o')
  if owner and owner ~= '' then redis.call('ZREM', prefix .. ':t:' .. owner, member) end
  redis.call('DEL', ek)
  redis.call('ZREM', prefix .. ':p:' .. p, e)
  redis.call('ZREM', allkey, member)
  redis.call('SET', prefix .. ':ver:' .. p, ARGV[13], 'EX', ttl)
end
local evicted = 0
for _, m in ipairs(redis.call('ZRANGEBYSCORE', allkey, '-inf', now - ttl)) do drop(m); evicted = evicted + 1 end
local over = redis.call('ZCARD', pkey) - max_part
if over > 0 then
  for _, e in ipairs(redis.call('ZRANGE', pkey, 0, over - 1)) do drop(pid .. ':' .. e); evicted = evicted + 1 end
end
if tenant ~= '' then
  local tkey = prefix .. ':t:' .. tenant
  redis.call('ZREMRANGEBYSCORE', tkey, '-inf', now - ttl)
  redis.call('ZADD', tkey, now, pid .. ':' .. eid)
  redis.call('EXPIRE', tkey, ttl)
  over = redis.call('ZCARD', tkey) - max_tenant
  if over > 0 then
    for _, m in ipairs(redis.call('ZRANGE', tkey, 0, over - 1)) do drop(m); evicted = evicted + 1 end
  end
end
over = redis.call('ZCARD', allkey) - max_all
if over > 0 then
  for _, m in ipairs(redis.call('ZRANGE', allkey, 0, over - 1)) do drop(m); evicted = evicted + 1 end
end
return evicted
"""


@dataclass
class _Mirror:
    version: bytes | None
    ids: list[str]
    matrix: np.ndarray
    shas: list[str]
    sigs: list[str]
    exact: np.ndarray
    created: np.ndarray
    words: list[str]


class RedisSemanticCache:
    """Entries in Redis, searched through a per-process numpy mirror of each partition."""

    def __init__(self, client, cfg: CacheConfig, dim: int = 384) -> None:
        self.r = client
        self.cfg = cfg
        self.dim = dim
        self.prefix = cfg.key_prefix
        self._store = client.register_script(_STORE_LUA)
        self._mirrors: dict[str, _Mirror] = {}
        self._lock = threading.Lock()
        self.last_evicted = 0

    def _load(self, pid: str, version: bytes | None) -> _Mirror:
        members = self.r.zrange(f"{self.prefix}:p:{pid}", 0, -1)
        ids = [m.decode() for m in members]
        pipe = self.r.pipeline(transaction=False)
        for eid in ids:
            pipe.hmget(f"{self.prefix}:e:{pid}:{eid}", "v", "s", "g", "x", "t", "w")
        rows = pipe.execute() if ids else []
        keep = [(eid, row) for eid, row in zip(ids, rows, strict=True) if row[0] is not None]
        n = len(keep)
        mat = np.zeros((n, self.dim), dtype=np.float32)
        for i, (_, row) in enumerate(keep):
            mat[i] = np.frombuffer(row[0], dtype=np.float32)
        return _Mirror(version, [e for e, _ in keep], mat, [row[1].decode() for _, row in keep],
                       [row[2].decode() for _, row in keep], np.array([row[3] == b"1" for _, row in keep], dtype=bool),
                       np.array([float(row[4]) for _, row in keep], dtype=np.float64),
                       [(row[5] or b"").decode() for _, row in keep])

    def _mirror(self, pid: str) -> _Mirror:
        version = self.r.get(f"{self.prefix}:ver:{pid}")
        with self._lock:
            m = self._mirrors.get(pid)
        if m is None or m.version != version:
            m = self._load(pid, version) if version is not None else _Mirror(
                None, [], np.zeros((0, self.dim), np.float32), [], [], np.zeros(0, bool), np.zeros(0), [])
            with self._lock:
                if len(self._mirrors) > 4096:  # bound the number of mirrored partitions per process
                    self._mirrors.clear()
                self._mirrors[pid] = m
        return m

    def lookup(self, q: CacheQuery) -> CacheHit | None:
        m = self._mirror(q.partition)
        if not m.ids:
            return None
        sims = m.matrix @ q.vector
        sims[m.created < time.time() - self.cfg.ttl_s] = -2.0
        for i in np.argsort(-sims)[:8]:
            sim = float(sims[i])
            if sim < min(self.cfg.lowest_hit, 0.5) and not q.exact_only:
                break
            if not _acceptable(sim, q, m.shas[i], m.sigs[i], bool(m.exact[i]), m.words[i], self.cfg):
                continue
            answer = self.r.hget(f"{self.prefix}:e:{q.partition}:{m.ids[i]}", "a")
            if answer is None:  # expired or evicted since the mirror was loaded
                continue
            return CacheHit(answer.decode(), sim, m.ids[i])
        return None

    def store(self, q: CacheQuery, answer: str) -> str:
        eid = uuid.uuid4().hex[:16]
        self.last_evicted = int(self._store(args=[
            self.prefix, q.partition, eid, self.cfg.ttl_s, f"{time.time():.6f}", self.cfg.max_entries,
            self.cfg.max_partition_entries, q.vector.astype(np.float32).tobytes(), answer, q.sha, q.signature,
            "1" if q.exact_only else "0", uuid.uuid4().hex, q.words, q.tenant, self.cfg.tenant_share]))
        return eid

    def size(self) -> int:
        return int(self.r.zcard(f"{self.prefix}:all"))

    def clear(self) -> None:
        keys = list(self.r.scan_iter(match=f"{self.prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            self.r.delete(*keys[i:i + 500])
        with self._lock:
            self._mirrors.clear()


# -- Milvus ------------------------------------------------------------------------------------------------
class MilvusSemanticCache:
    """The same contract on Milvus (pymilvus `MilvusClient`): for a farm whose cache outgrows one Redis.

    One collection with a COSINE index; the partition, signature, text hash and creation time are scalar
    fields used in the search filter. TTL: entries older than ttl_s are filtered out of searches and
    deleted every `_SWEEP_EVERY` stores, together with each tenant's oldest past its share and the oldest
    entries past `max_entries`.
    """

    _SWEEP_EVERY = 64

    def __init__(self, cfg: CacheConfig, dim: int = 384, client=None) -> None:
        if client is None:
            try:
                from pymilvus import MilvusClient
            except ImportError as e:
                raise RuntimeError("semantic.cache.backend is milvus but pymilvus is not installed "
                                   "(pip install pymilvus)") from e
            client = MilvusClient(uri=cfg.milvus.uri, token=cfg.milvus.token or "")
        self.c = client
        self.cfg = cfg
        self.name = cfg.milvus.collection
        self.dim = dim
        self._stores = 0
        if not self.c.has_collection(self.name):
            self.c.create_collection(self.name, dimension=dim, metric_type="COSINE", primary_field_name="id",
                                     id_type="string", max_length=64, vector_field_name="vector",
                                     enable_dynamic_field=True, consistency_level="Strong")

    def lookup(self, q: CacheQuery) -> CacheHit | None:
        cutoff = time.time() - self.cfg.ttl_s
        res = self.c.search(self.name, data=[q.vector.astype(np.float32).tolist()], limit=8,
                            filter=f'partition == "{q.partition}" and created >= {cutoff}',
                            output_fields=["answer", "sha", "sig", "exact", "words"],
                            search_params={"metric_type": "COSINE"})
        for hit in res[0] if res else []:
            ent = hit.get("entity", hit)
            sim = float(hit.get("distance", 0.0))
            if _acceptable(sim, q, ent["sha"], ent["sig"], bool(ent["exact"]), ent.get("words", ""), self.cfg):
                return CacheHit(ent["answer"], sim, str(hit.get("id")))
        return None

    def store(self, q: CacheQuery, answer: str) -> str:
        eid = uuid.uuid4().hex
        self.c.insert(self.name, data=[{"id": eid, "vector": q.vector.astype(np.float32).tolist(),
                                        "partition": q.partition, "answer": answer, "sha": q.sha,
                                        "sig": q.signature, "exact": bool(q.exact_only), "words": q.words,
                                        "tenant": q.tenant, "created": time.time()}])
        self._stores += 1
        if self._stores % self._SWEEP_EVERY == 0:
            self.sweep()
        return eid

    def sweep(self) -> None:
        """Delete expired entries, then each tenant's oldest past its share, then the oldest past max_entries."""
        self.c.delete(self.name, filter=f"created < {time.time() - self.cfg.ttl_s}")
        rows = [dict(r) for r in self.c.query(self.name, filter="created >= 0",
                                              output_fields=["id", "created", "tenant"],
                                              limit=self.cfg.max_entries + 1024)]  # materialise the lazy rows
        rows.sort(key=lambda r: r["created"])
        per_tenant: dict[str, list[dict]] = {}
        for r in rows:
            if r.get("tenant"):
                per_tenant.setdefault(r["tenant"], []).append(r)
        gone = {r["id"] for own in per_tenant.values() for r in own[:max(0, len(own) - self.cfg.tenant_share)]}
        rows = [r for r in rows if r["id"] not in gone]
        gone.update(r["id"] for r in rows[:max(0, len(rows) - self.cfg.max_entries)])
        if gone:
            self.c.delete(self.name, ids=sorted(gone))

    def clear(self) -> None:
        self.c.drop_collection(self.name)
        self.c.create_collection(self.name, dimension=self.dim, metric_type="COSINE", primary_field_name="id",
                                 id_type="string", max_length=64, vector_field_name="vector",
                                 enable_dynamic_field=True, consistency_level="Strong")


def make_cache(cfg: CacheConfig, redis_client=None) -> SemanticCache:
    """The configured backend."""
    if cfg.backend == "milvus":
        return MilvusSemanticCache(cfg)
    if redis_client is None:
        raise ValueError("the redis cache backend needs a Redis client")
    return RedisSemanticCache(redis_client, cfg)
