"""The Redis semantic cache on a real redis-server: hits, misses, partitions, TTL, eviction, sharing
between processes and persistence across a Redis restart. Vectors are synthetic unit vectors, so these
tests exercise the cache alone (the layer tests use the real embedding model)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import redis

from farm.config.semantic import CacheConfig
from farm.semantic.cache import (
    CacheQuery,
    RedisSemanticCache,
    guard_signature,
    lexical_conflict,
    partition_key,
    same_frame_edit,
    text_sha,
    word_sequence,
)
from tests.conftest import free_port, start_redis


def unit(seed: int, near: np.ndarray | None = None, eps: float = 0.0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(384).astype(np.float32)
    if near is not None:
        v = near + eps * v / np.linalg.norm(v)
    return (v / np.linalg.norm(v)).astype(np.float32)


def q(vec: np.ndarray, text: str = "hello there", model: str = "m1", system: str = "", history=None) -> CacheQuery:
    return CacheQuery(partition_key(model, system, history or []), vec, text_sha(text), guard_signature(text), False,
                      word_sequence(text))


def at_cosine(v: np.ndarray, c: float, seed: int) -> np.ndarray:
    """A unit vector whose cosine with the unit vector v is exactly c."""
    u = np.random.default_rng(seed).standard_normal(v.shape[0])
    u -= (u @ v) * v
    return (c * v + np.sqrt(1 - c * c) * u / np.linalg.norm(u)).astype(np.float32)


def make(client, **kw) -> RedisSemanticCache:
    return RedisSemanticCache(client, CacheConfig(**{"similarity_threshold": 0.9, **kw}))


def test_hit_and_miss(redis_client):
    c = make(redis_client)
    base = unit(1)
    assert c.lookup(q(base)) is None
    c.store(q(base), "the answer")
    hit = c.lookup(q(unit(2, near=base, eps=0.1)))  # cosine ~0.995
    assert hit is not None and hit.answer == "the answer" and hit.similarity > 0.99
    assert c.lookup(q(unit(3))) is None  # unrelated vector
    assert c.lookup(q(unit(4, near=base, eps=1.0))) is None  # cosine ~0.7: below the threshold


def test_partitions_never_cross_models_or_system_prompts(redis_client):
    c = make(redis_client)
    v = unit(5)
    c.store(q(v, model="m1", system="You are terse."), "m1 terse")
    assert c.lookup(q(v, model="m1", system="You are terse.")).answer == "m1 terse"
    assert c.lookup(q(v, model="m2", system="You are terse.")) is None
    assert c.lookup(q(v, model="m1", system="You are verbose.")) is None
    assert c.lookup(q(v, model="m1", system="")) is None
    assert c.lookup(q(v, model="m1", system="You are terse.", history=[{"role": "user", "content": "hi"}])) is None


def test_numbers_and_negation_must_agree(redis_client):
    c = make(redis_client)
    v = unit(6)
    c.store(q(v, text="What is 2+2?"), "4")
    assert c.lookup(q(v, text="what is 2 + 2")).answer == "4"
    assert c.lookup(q(v, text="What is 2+3?")) is None
    c.store(q(unit(7), text="Is coffee good for you?"), "yes")
    assert c.lookup(q(unit(7), text="Is coffee not good for you?")) is None


def test_exact_only_for_truncated_prompts(redis_client):
    c = make(redis_client)
    v = unit(8)
    long = CacheQuery(partition_key("m1", "", []), v, text_sha("long text A"), guard_signature("A"), True)
    c.store(long, "answer A")
    same = CacheQuery(long.partition, v, text_sha("long text A"), long.signature, True)
    other = CacheQuery(long.partition, v, text_sha("long text B"), long.signature, True)
    assert c.lookup(same).answer == "answer A"
    assert c.lookup(other) is None


def test_ttl_expiry(redis_client):
    c = make(redis_client, ttl_s=1)
    v = unit(9)
    c.store(q(v), "short-lived")
    assert c.lookup(q(v)) is not None
    time.sleep(1.3)
    assert c.lookup(q(v)) is None
    assert redis_client.exists(f"farm:sc:ver:{q(v).partition}") == 0  # Redis dropped the keys too


def test_size_bound_evicts_oldest(redis_client):
    c = make(redis_client, max_entries=3)
    vecs = [unit(10 + i) for i in range(5)]
    for i, v in enumerate(vecs):
        c.store(q(v, model=f"m{i % 2}"), f"a{i}")
    assert c.size() == 3
    assert c.last_evicted == 1
    assert c.lookup(q(vecs[0], model="m0")) is None
    assert c.lookup(q(vecs[1], model="m1")) is None
    assert c.lookup(q(vecs[4], model="m0")).answer == "a4"
    assert len(list(redis_client.scan_iter(match="farm:sc:e:*"))) == 3


def test_partition_bound(redis_client):
    c = make(redis_client, max_partition_entries=2)
    vecs = [unit(20 + i) for i in range(3)]
    for i, v in enumerate(vecs):
        c.store(q(v), f"a{i}")
    assert c.lookup(q(vecs[0])) is None
    assert c.lookup(q(vecs[2])).answer == "a2"


def test_one_tenants_flood_evicts_its_own_answers_not_the_others(redis_client):
    """Past its share of the cache, a tenant's oldest entries go, not the oldest of all: one key storing many
    answers cannot push every other tenant's out (before, eviction was global, oldest first)."""
    c = make(redis_client, max_entries=8, max_tenant_entries=3)
    kept = unit(40)
    c.store(replace(q(kept), tenant="t-a"), "a's answer")
    flood = [unit(41 + i) for i in range(12)]
    for i, v in enumerate(flood):
        c.store(replace(q(v, model=f"m{i % 3}"), tenant="t-b"), f"b{i}")
    assert c.lookup(q(kept)).answer == "a's answer"
    assert [c.lookup(q(v, model=f"m{i % 3}")) is not None for i, v in enumerate(flood)] == [False] * 9 + [True] * 3
    assert c.size() == 4
    assert redis_client.zcard("farm:sc:t:t-b") == 3


def test_a_tenants_index_forgets_entries_evicted_for_room(redis_client):
    """Entries evicted past `max_entries` or a partition's bound leave their tenant's index too, so a tenant's
    count is of entries that exist (a stale member would evict the tenant's live answers early)."""
    c = make(redis_client, max_entries=4, max_tenant_entries=3, max_partition_entries=2)
    for i in range(12):
        c.store(replace(q(unit(60 + i), model=f"m{i % 2}"), tenant=f"t-{i % 3}"), f"x{i}")
    live = {m.decode() for m in redis_client.zrange("farm:sc:all", 0, -1)}
    assert len(live) == 4
    indexed = set()
    for key in redis_client.scan_iter(match="farm:sc:t:*"):
        indexed |= {m.decode() for m in redis_client.zrange(key, 0, -1)}
    assert indexed == live


def test_a_cache_without_tenants_has_no_share(redis_client):
    """A keyless farm (tenant "") is one tenant: the whole cache is its."""
    c = make(redis_client, max_entries=5, max_tenant_entries=1)
    vecs = [unit(80 + i) for i in range(5)]
    for i, v in enumerate(vecs):
        c.store(q(v), f"a{i}")
    assert all(c.lookup(q(v)) is not None for v in vecs)


@pytest.mark.parametrize(("kw", "share"), [({}, 2500), ({"max_entries": 3}, 1), ({"max_tenant_entries": 7}, 7)])
def test_a_tenants_share_defaults_to_a_quarter(kw, share):
    assert CacheConfig(**kw).tenant_share == share


def test_a_share_above_the_whole_cache_is_refused():
    with pytest.raises(ValueError, match="max_tenant_entries"):
        CacheConfig(max_entries=10, max_tenant_entries=11)


def test_shared_between_instances_and_mirror_refresh(redis_client):
    a, b = make(redis_client), make(redis_client)
    v = unit(30)
    assert b.lookup(q(v)) is None  # b mirrors the empty partition
    a.store(q(v), "from a")
    assert b.lookup(q(v)).answer == "from a"  # b sees the new version token and reloads
    a.clear()
    assert b.lookup(q(v)) is None


def test_shared_with_another_process(redis_client, redis_url):
    v = unit(31)
    code = (
        "import sys, numpy as np, redis\n"
        "from farm.semantic.cache import RedisSemanticCache, CacheQuery, partition_key, text_sha, guard_signature\n"
        "from farm.config.semantic import CacheConfig\n"
        "v = np.frombuffer(bytes.fromhex(sys.argv[2]), dtype=np.float32)\n"
        "c = RedisSemanticCache(redis.Redis.from_url(sys.argv[1]), CacheConfig())\n"
        "c.store(CacheQuery(partition_key('m1', '', []), v, text_sha('hello there'), guard_signature('hello there'), False), 'from process 2')\n"
    )
    subprocess.run([sys.executable, "-c", code, redis_url, v.tobytes().hex()], check=True, timeout=60)
    assert make(redis_client).lookup(q(v)).answer == "from process 2"


def test_survives_redis_restart(tmp_path):
    port = free_port()
    proc, url = start_redis(tmp_path / "r", port)
    v = unit(40)
    try:
        client = redis.Redis.from_url(url)
        make(client).store(q(v), "persisted")
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    proc, url = start_redis(tmp_path / "r", port)  # same dir: the AOF is replayed
    try:
        client = redis.Redis.from_url(url)
        assert make(client).lookup(q(v)).answer == "persisted"
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize(("a", "b", "same"), [
    ("What is 2+2?", "what is 2 + 2", True), ("2+2", "2+3", False), ("Is it safe?", "Isn't it safe?", False),
    ("pi 3.14", "pi 3,14", True),
    # numbers written as words count as numbers; "one" does not (a pronoun as often as a count)
    ("Undo the last commit in git", "Undo the last three commits in git", False),
    ("What is two plus two?", "What is 2 + 2?", True), ("A dozen eggs", "12 eggs", True),
    ("How does one learn French?", "How do you learn French?", True)])
def test_guard_signature(a, b, same):
    assert (guard_signature(a) == guard_signature(b)) is same


def test_milvus_backend_same_contract(tmp_path):
    """The Milvus backend against Milvus Lite (a real Milvus in a local file, same MilvusClient API)."""
    pytest.importorskip("pymilvus")
    pytest.importorskip("milvus_lite")
    from farm.config.semantic import MilvusConfig
    from farm.semantic.cache import MilvusSemanticCache, word_sequence

    cfg = CacheConfig(backend="milvus", similarity_threshold=0.9, max_entries=2,
                      milvus=MilvusConfig(uri=str(tmp_path / "milvus.db")))
    c = MilvusSemanticCache(cfg)

    def mq(vec, text="hello there", model="m1", system=""):
        return CacheQuery(partition_key(model, system, []), vec, text_sha(text), guard_signature(text), False,
                          word_sequence(text))

    base = unit(50)
    assert c.lookup(mq(base)) is None
    c.store(mq(base), "milvus answer")
    assert c.lookup(mq(unit(51, near=base, eps=0.1))).answer == "milvus answer"
    assert c.lookup(mq(base, model="m2")) is None
    assert c.lookup(mq(base, system="other")) is None
    assert c.lookup(mq(base, text="hello 2")) is None
    c.store(mq(unit(52)), "b")
    c.store(mq(unit(53)), "c")
    c.sweep()  # past max_entries: the oldest goes
    assert c.lookup(mq(base)) is None
    assert c.lookup(mq(unit(53))).answer == "c"

    # a tenant past its share loses its own oldest, not another tenant's
    c.clear()
    c.cfg = cfg.model_copy(update={"max_entries": 4, "max_tenant_entries": 2})
    c.store(replace(mq(unit(54)), tenant="t-a"), "a's")
    for i in range(3):
        c.store(replace(mq(unit(55 + i)), tenant="t-b"), f"b{i}")
    c.sweep()
    assert c.lookup(mq(unit(54))).answer == "a's"
    assert [c.lookup(mq(unit(55 + i))) is not None for i in range(3)] == [False, True, True]


@pytest.mark.parametrize(("a", "b", "edit"), [
    # one sentence, content changed in place: another entity, an antonym, a qualifier added
    ("What is the tallest mountain in the world?", "What is the tallest mountain in Africa?", True),
    ("Should I take vitamin D in the morning?", "Should I take vitamin D at night?", True),
    ("How do I center a div in CSS?", "How do I center a div vertically in CSS?", True),
    ("How do I make my cat stop scratching the sofa?", "How do I make my dog stop chewing the sofa?", True),
    # the question asked in other words
    ("What is the tallest mountain in the world?", "Which mountain is the highest on Earth?", False),
    ("How do I calculate compound interest?", "What's the formula for compound interest?", False),
    ("What is the function of the mitochondria?", "What do mitochondria do in a cell?", False),
    # only function words or forms of one word differ
    ("Who discovered penicillin?", "Who was the discoverer of penicillin?", False),
    ("How do I center text in HTML?", "How can I center text in HTML?", False)])
def test_an_edit_in_place_is_told_from_a_rephrasing(a, b, edit):
    assert same_frame_edit(word_sequence(a), word_sequence(b)) is edit


@pytest.mark.parametrize(("a", "b", "conflict"), [
    ("Convert 5 feet to meters", "Convert 5 meters to feet", True),
    ("Is Python faster than Java?", "Is Java faster than Python?", True),
    ("What is inflation in economics?", "In economics, what is inflation?", False),  # a phrase moved whole
    ("Flights from London to Paris", "Flights to Paris from London", False),
    ("Write a haiku about autumn", "Write a haiku about spring", True)])
def test_reordered_words(a, b, conflict):
    assert lexical_conflict(word_sequence(a), word_sequence(b)) is conflict


def test_rephrased_questions_hit_below_the_threshold_but_edits_in_place_do_not(redis_client):
    """Within `rephrased_margin` below the threshold a rephrasing hits and a one-place edit does not; below the
    margin nothing hits, and a margin of 0 is the threshold alone."""
    c = make(redis_client)
    base = unit(40)
    stored = "What is the tallest mountain in the world?"
    c.store(q(base, text=stored), "Everest")
    rephrased = c.lookup(q(at_cosine(base, 0.87, 41), text="Which mountain is the highest on Earth?"))
    assert rephrased is not None and rephrased.answer == "Everest" and abs(rephrased.similarity - 0.87) < 1e-4
    assert c.lookup(q(at_cosine(base, 0.87, 42), text="What is the tallest mountain in Africa?")) is None
    assert c.lookup(q(at_cosine(base, 0.80, 44), text="Which mountain is the highest on Earth?")) is None
    off = make(redis_client, rephrased_margin=0.0)
    assert off.lookup(q(at_cosine(base, 0.87, 45), text="Which mountain is the highest on Earth?")) is None
