"""Issue 26 item 1 (the parts below the API): cache salts scope the prefix cache to one tenant.

The hash chain of a salted prompt starts from its salt's root, so equal prompts of different tenants share no
block hash (the router's index, the engine's prefix cache, the KV tiers, KV events and handles all key on these
hashes); the request message carries the salt as validated input; the built-in engine reuses blocks only within
one salt; vLLM's KV events of a salted prompt are re-hashed into the same salted chain."""

from __future__ import annotations

import json
import uuid

import pytest

from farm.backends.vllm_events import VllmKVEventTranslator, first_block_salt
from farm.config import EngineConfig
from farm.engine.engine import Engine
from farm.protocol import GenerationRequest, InvalidTask, SamplingParams
from farm.protocol.hashing import block_hashes, chain_hash, local_block_hash, salt_root
from farm.tenancy.api_keys import OWNER_ANONYMOUS, digest, owner_of, tenant_cache_salt
from tests.test_engine import Collector

BS = 16
PROMPT = list(range(300, 300 + 4 * BS + 3))


# -- hashing -----------------------------------------------------------------------------------------------
def test_unsalted_chains_are_unchanged():
    assert salt_root("") is None and salt_root(None) is None
    assert block_hashes(PROMPT, BS, salt_root("")) == block_hashes(PROMPT, BS)
    assert block_hashes(PROMPT, BS)[0] == local_block_hash(PROMPT[:BS])


def test_a_salted_chain_starts_from_its_salts_root():
    root = salt_root("t-a")
    hs = block_hashes(PROMPT, BS, root)
    assert hs[0] == chain_hash(root, local_block_hash(PROMPT[:BS]))
    assert hs[1] == chain_hash(hs[0], local_block_hash(PROMPT[BS:2 * BS]))
    assert block_hashes(PROMPT, BS, salt_root("t-a")) == hs  # deterministic: every process computes the same


def test_salted_chains_are_disjoint_across_salts_and_from_the_unsalted_one():
    chains = {s: block_hashes(PROMPT, BS, salt_root(s)) for s in ("", "t-a", "t-b", "t-a2", "a")}
    for s, hs in chains.items():
        for o, other in chains.items():
            if s != o:
                assert not set(hs) & set(other), (s, o)
    # a longer prompt of the same salt shares its prefix blocks, as unsalted chains do
    longer = block_hashes(PROMPT + [7] * BS, BS, salt_root("t-a"))
    assert longer[:len(chains["t-a"])] == chains["t-a"]


# -- the request message -----------------------------------------------------------------------------------
def _msg(**kw) -> dict:
    d = GenerationRequest(uuid.uuid4().hex, "m", [1, 2, 3], SamplingParams(max_tokens=4)).to_dict()
    d.update(kw)
    return json.loads(json.dumps(d))


def test_the_salt_travels_with_the_request():
    salt = tenant_cache_salt(owner_of(digest("key-b")))
    back = GenerationRequest.from_dict(_msg(cache_salt=salt), vocab_size=100)
    assert back.cache_salt == salt and back.to_dict()["cache_salt"] == salt
    assert GenerationRequest.from_dict(_msg(), vocab_size=100).cache_salt == ""
    old = _msg()
    del old["cache_salt"]  # a message from before salts: unsalted
    assert GenerationRequest.from_dict(old, vocab_size=100).cache_salt == ""
    assert GenerationRequest.from_dict(_msg(cache_salt="a" * 128)).cache_salt == "a" * 128


@pytest.mark.parametrize("salt", [5, None, ["t-a"], "a" * 129, "t a", "t@a", "t/a", "t\\a", "t\0a", "ü"])
def test_a_bad_salt_is_refused(salt):
    with pytest.raises(InvalidTask, match="cache_salt"):
        GenerationRequest.from_dict(_msg(cache_salt=salt), vocab_size=100)


def test_tenant_salts():
    a, b = owner_of(digest("key-a")), owner_of(digest("key-b"))
    assert tenant_cache_salt(OWNER_ANONYMOUS) == ""  # a farm without keys: no salt, nothing changes
    salts = {tenant_cache_salt(a), tenant_cache_salt(b), tenant_cache_salt(a, "x"), tenant_cache_salt(b, "x"),
             tenant_cache_salt(OWNER_ANONYMOUS, "x")}
    assert len(salts) == 5  # a client's salt narrows its tenant's scope, never reaches another tenant's
    assert tenant_cache_salt(a) == tenant_cache_salt(a, None) == tenant_cache_salt(a, "")
    for s in salts:  # what the message and vLLM accept
        GenerationRequest.from_dict(_msg(cache_salt=s))
        assert len(s) <= 128 and not set(s) & set("@/\\\0")


# -- vLLM's events of a salted prompt ----------------------------------------------------------------------
class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, kind, hashes, parent, tier=None):
        self.events.append((kind, list(hashes), parent, tier))


def test_first_block_salt_reads_vllms_untagged_extra_keys():
    assert first_block_salt(None) == "" and first_block_salt([]) == "" and first_block_salt([None, None]) == ""
    assert first_block_salt([["t-a"], None]) == "t-a" and first_block_salt([("t-a",)]) == "t-a"
    assert first_block_salt([[["mm-1", 0], "t-a"]]) == "t-a"  # beside multimodal pairs
    assert first_block_salt([[["mm-1", 0]]]) == ""
    assert first_block_salt([["lora-x", "t-a"]]) is None  # ambiguous (LoRA blocks are not indexed anyway)


def test_translator_chains_a_salted_prompt_from_its_salts_root():
    rec = Recorder()
    t = VllmKVEventTranslator(rec, BS)
    salted = [b"s0", b"s1", b"s2"]  # vLLM's hashes of the salted prompt (opaque here)
    t.apply([{"type": "BlockStored", "block_hashes": salted[:2], "parent_block_hash": None,
              "token_ids": PROMPT[:2 * BS], "block_size": BS, "medium": "GPU", "extra_keys": [["t-a"], None]}])
    t.apply([{"type": "BlockStored", "block_hashes": salted[2:], "parent_block_hash": salted[1],
              "token_ids": PROMPT[2 * BS:3 * BS], "block_size": BS, "medium": "GPU", "extra_keys": [None]}])
    ours = block_hashes(PROMPT[:3 * BS], BS, salt_root("t-a"))
    assert rec.events == [("stored", ours[:2], salt_root("t-a"), "device"), ("stored", ours[2:], ours[1], "device")]
    # the same tokens unsalted: the unsalted chain, not the salted one
    t.apply([{"type": "BlockStored", "block_hashes": [b"u0"], "parent_block_hash": None,
              "token_ids": PROMPT[:BS], "block_size": BS, "medium": "GPU", "extra_keys": None}])
    assert rec.events[-1] == ("stored", block_hashes(PROMPT[:BS], BS), None, "device")
    t.apply([{"type": "BlockRemoved", "block_hashes": salted, "medium": "GPU"}])
    assert rec.events[-1] == ("removed", ours, None, "device")


# -- the built-in engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = Engine(tiny_model_dir, EngineConfig(block_size=BS, kv_cache_mb=16, kv_tiers={"host_mb": 0, "disk_mb": 0}),
                 max_model_len=512).start()
    yield eng
    eng.stop()


def _cached(engine: Engine, prompt: list[int], salt: str) -> int:
    c = Collector()
    engine.submit(uuid.uuid4().hex, prompt, SamplingParams(max_tokens=1, temperature=0), c, cache_salt=salt)
    out = c.wait().last
    assert out.finish_reason == "length", out.finish_reason
    return out.cached_tokens


def test_engine_reuses_blocks_only_within_one_salt(engine):
    prompt = list(range(1000, 1000 + 5 * BS + 4))
    full = 5 * BS
    a, b = tenant_cache_salt(owner_of(digest("ka"))), tenant_cache_salt(owner_of(digest("kb")))
    assert _cached(engine, prompt, b) == 0
    assert _cached(engine, prompt, b) == full  # the tenant's own repeat is cached
    assert _cached(engine, prompt, a) == 0  # another tenant's identical prompt is not
    assert _cached(engine, prompt, "") == 0  # nor unsalted traffic
    assert _cached(engine, prompt, a) == full  # ... which now has a cache of its own
    assert _cached(engine, prompt, "") == full
    # the pool holds each tenant's blocks under its own chain
    cached = engine.call(lambda: set(engine.pool.cached))
    for salt in (a, b, ""):
        assert set(block_hashes(prompt, BS, salt_root(salt))) <= cached


def test_a_prefill_hands_over_the_salted_chain(engine):
    """Disaggregated: the handle's block hashes (and the blocks the decode side caches) are the salted chain."""
    prompt = list(range(2000, 2000 + 3 * BS + 1))
    salt = tenant_cache_salt(owner_of(digest("kc")))
    c = Collector()
    engine.submit(uuid.uuid4().hex, prompt, SamplingParams(max_tokens=4, temperature=0), c, prefill_only=True,
                  cache_salt=salt)
    out = c.wait().last
    assert out.finish_reason == "prefilled"
    assert out.block_hashes == block_hashes(prompt, BS, salt_root(salt))
    engine.release_held(out.request_id)
