"""Issue 26 item 1 (high): cross-tenant prompt disclosure through the shared KV prefix cache. Key B sent a memo
naming a secret; key A sent the same template once per guess with `max_tokens: 1`, and the right guess came back
with more `usage.prompt_tokens_details.cached_tokens` (and `x-farm-router-overlap-tokens`, and a shorter time to
first token) than the wrong ones.

Now every generation carries its tenant's cache salt (farm.tenancy.api_keys.tenant_cache_salt, from the API key's owner),
and every block hash of a salted prompt is chained from the salt (farm.protocol.hashing.salt_root): the router's
index, the engine's prefix cache and the KV events never match one tenant's prompt with another's. The probe is
replayed here on a real farm (the API as `farm up` serves it, one built-in worker on the tiny model, two keys)."""

from __future__ import annotations

import io
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import requests
from transformers import AutoTokenizer

from farm.models.tokenization import text_prompt_ids
from farm.protocol.hashing import block_hashes, salt_root
from farm.router.index import IndexFollower
from farm.supervisor import Farm
from farm.tenancy.api_keys import digest, owner_of, tenant_cache_salt
from tests.security.farms import MODEL, base_url, real_farm
from tests.security_helpers import KEY_A, KEY_B, bearer

BLOCK_SIZE = 16  # engine.block_size: the built-in engine's default
SECRET, WRONG = "Margaret Oyelaran-Whitfield", ["Jonathan Pemberton-Ashcroft", "Oliver Kwiatkowski-Lindqvist"]


def memo(ref: str, name: str) -> str:
    return (f"Internal memo {ref}. Confidential: do not forward outside the leadership team. Subject: the "
            f"reorganisation of the northern region's logistics department. The new head of the department will "
            f"be {name}, who starts on the first of next month. Please keep this to yourself until the official "
            "announcement at the general meeting in the main hall next Monday, when all staff will be informed.")


@pytest.fixture(scope="module")
def farm(redis_url, tmp_path_factory, tiny_model_dir) -> Iterator[Farm]:
    with real_farm(redis_url, tmp_path_factory.mktemp("cache-salt"), tiny_model_dir, both=1, max_model_len=512,
                   batch_drivers=1, env={"FARM_API_KEYS": f"{KEY_A},{KEY_B}"},
                   config={"semantic": {"enabled": False}}) as f:  # no answer cache: every request reaches a worker
        yield f


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def probe(farm: Farm, key: str, prompt: str, **extra: Any) -> tuple[int, int, dict]:
    """(cached tokens, the router's predicted overlap in tokens, usage) of one `max_tokens: 1` completion."""
    r = requests.post(base_url(farm) + "/v1/completions", headers=bearer(key), timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    assert r.status_code == 200, r.text[:500]
    usage = r.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], int(r.headers["x-farm-router-overlap-tokens"]), usage


def indexed(redis_url: str, hashes: list[int]) -> int:
    """Leading blocks of `hashes` the router's index (rebuilt from the workers' KV events in Redis) has."""
    follower = IndexFollower(redis.Redis.from_url(redis_url))
    follower.snapshot()
    return max(follower.index.overlaps(hashes).values(), default=0)


def test_another_tenants_prompt_is_not_found_in_the_cache(farm, redis_url, tokenizer):
    ref = uuid.uuid4().hex[:8]  # a prompt nothing cached before
    secret_memo = memo(ref, SECRET)
    ids = text_prompt_ids(tokenizer, secret_memo)
    full = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE  # what a repeat reuses (one token is always computed)

    # key B sends its memo, then repeats it: its own cache serves the repeat
    assert probe(farm, KEY_B, secret_memo)[0] == 0
    cached_b, overlap_b, usage = probe(farm, KEY_B, secret_memo)
    assert usage["prompt_tokens"] == len(ids) and cached_b == full > 0 and overlap_b == full
    # ... and the router's index holds B's blocks under B's salted chain only (the worker's KV events)
    salt_b = tenant_cache_salt(owner_of(digest(KEY_B)))
    salt_a = tenant_cache_salt(owner_of(digest(KEY_A)))
    n_blocks = len(ids) // BLOCK_SIZE
    deadline = time.monotonic() + 15
    while indexed(redis_url, block_hashes(ids, BLOCK_SIZE, salt_root(salt_b))) < n_blocks:
        assert time.monotonic() < deadline, "B's blocks never reached the router's index"
        time.sleep(0.2)
    assert indexed(redis_url, block_hashes(ids, BLOCK_SIZE, salt_root(salt_a))) == 0
    assert indexed(redis_url, block_hashes(ids, BLOCK_SIZE)) == 0

    # key A probes: a first guess warms A's own cache with the template's head; then the right and a wrong guess
    probe(farm, KEY_A, memo(ref, WRONG[1]))
    right = probe(farm, KEY_A, memo(ref, SECRET))
    wrong = probe(farm, KEY_A, memo(ref, WRONG[0]))
    assert right[0] == wrong[0] < cached_b  # cached_tokens: the same for the right and the wrong guess
    assert right[1] == wrong[1] < overlap_b  # x-farm-router-overlap-tokens: the same
    assert right[0] > 0  # A does reuse its own cache (the template's head it sent before)


def test_a_client_salt_narrows_the_tenants_scope_and_never_reaches_another(farm):
    """vLLM's `cache_salt` field: combined with the key's own salt, never in place of it."""
    prompt = memo(uuid.uuid4().hex[:8], SECRET)
    probe(farm, KEY_B, prompt)
    assert probe(farm, KEY_B, prompt)[0] > 0
    assert probe(farm, KEY_B, prompt, cache_salt="session-1")[0] == 0  # a scope of its own within B's
    assert probe(farm, KEY_B, prompt, cache_salt="session-1")[0] > 0
    # A naming B's salt (or B's session) gets a scope of A's own: nothing of B's
    assert probe(farm, KEY_A, prompt, cache_salt=tenant_cache_salt(owner_of(digest(KEY_B))))[0] == 0
    assert probe(farm, KEY_A, prompt, cache_salt="session-1")[0] == 0
    for bad in ("", "a/b", "x" * 129, 5):
        r = requests.post(base_url(farm) + "/v1/completions", headers=bearer(KEY_A), timeout=60,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text[:300]


def test_batch_lines_run_under_their_owners_salt(farm):
    """A batch line is its owner's request: it warms the owner's cache, not another key's."""
    prompt = memo(uuid.uuid4().hex[:8], SECRET)
    line = {"custom_id": "memo", "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}}
    url, auth = base_url(farm), bearer(KEY_B)
    fid = requests.post(url + "/v1/files", headers=auth, timeout=30, data={"purpose": "batch"},
                        files={"file": ("memo.jsonl", io.BytesIO(json.dumps(line).encode()))}).json()["id"]
    bid = requests.post(url + "/v1/batches", headers=auth, timeout=30, json={
        "input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h"}).json()["id"]
    deadline = time.monotonic() + 120
    while (b := requests.get(f"{url}/v1/batches/{bid}", headers=auth, timeout=30).json())["status"] != "completed":
        assert b["status"] not in ("failed", "expired", "cancelled") and time.monotonic() < deadline, b
        time.sleep(0.3)
    out = json.loads(requests.get(f"{url}/v1/files/{b['output_file_id']}/content", headers=auth, timeout=30).text)
    assert out["response"]["status_code"] == 200
    assert probe(farm, KEY_A, prompt)[0] == 0  # not in A's cache
    assert probe(farm, KEY_B, prompt)[0] > 0  # in B's: the batch line ran with B's salt
