"""Issue 26 item 1 through vLLM: the tenant's cache salt reaches vLLM (its `cache_salt`, in the extra keys of a
prompt's first block hash), so vLLM's own prefix cache serves a key only its own prompts; and vLLM's KV events of
a salted prompt are re-hashed into the farm's salted chain (farm/backends/vllm_events.py), so the router's index
holds the tenant's blocks under the tenant's hashes only. The probe of the finding (key A guessing the secret in
key B's memo with `max_tokens: 1`) gets the same counts for the right and the wrong guess."""

from __future__ import annotations

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
from tests.security_helpers import KEY_A, KEY_B, bearer
from tests.vllm.conftest import BLOCK_SIZE, MODEL, vllm_farm

pytestmark = pytest.mark.slow

SECRET, WRONG = "Margaret Oyelaran-Whitfield", ["Jonathan Pemberton-Ashcroft", "Oliver Kwiatkowski-Lindqvist"]


def memo(ref: str, name: str) -> str:
    return (f"Internal memo {ref}. Confidential: do not forward outside the leadership team of the company. "
            "Subject: the reorganisation of the northern region's logistics department, its warehouses, its fleet "
            "of delivery vans and the planning office that schedules the routes of every driver in the region. "
            f"The new head of the department will be {name}, who starts on the first of next month. Please keep "
            "this to yourself until the official announcement at the general meeting in the main hall next Monday, "
            "when all staff will be informed and questions can be asked.")


@pytest.fixture(scope="module")
def farm(tmp_path_factory, real_model_dir) -> Iterator[Farm]:
    with vllm_farm(tmp_path_factory.mktemp("vllm-salt"), real_model_dir, both=1,
                   env={"FARM_API_KEYS": f"{KEY_A},{KEY_B}"}) as f:
        yield f


def probe(farm: Farm, key: str, prompt: str) -> tuple[int, int, dict]:
    """(cached tokens by vLLM, the router's predicted overlap in tokens, usage) of one `max_tokens: 1` completion."""
    r = requests.post(f"http://127.0.0.1:{farm.api_port}/v1/completions", headers=bearer(key), timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text[:500]
    usage = r.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], int(r.headers["x-farm-router-overlap-tokens"]), usage


def indexed(farm: Farm, hashes: list[int]) -> int:
    """Leading blocks of `hashes` the router's index (rebuilt from the workers' KV events in Redis) has."""
    follower = IndexFollower(redis.Redis.from_url(farm.cfg.redis.url))
    follower.snapshot()
    return max(follower.index.overlaps(hashes).values(), default=0)


def test_vllm_prefix_cache_and_router_index_are_per_tenant(farm, real_model_dir):
    tok: Any = AutoTokenizer.from_pretrained(real_model_dir)
    ref = uuid.uuid4().hex[:8]
    secret_memo = memo(ref, SECRET)
    ids = text_prompt_ids(tok, secret_memo)
    n_blocks = len(ids) // BLOCK_SIZE
    assert n_blocks >= 3

    assert probe(farm, KEY_B, secret_memo)[0] == 0
    salt_b = tenant_cache_salt(owner_of(digest(KEY_B)))
    salt_a = tenant_cache_salt(owner_of(digest(KEY_A)))
    # vLLM's events of B's prompt, re-hashed by the worker, are in the index under B's salted chain
    deadline = time.monotonic() + 20
    while indexed(farm, block_hashes(ids, BLOCK_SIZE, salt_root(salt_b))) < n_blocks:
        assert time.monotonic() < deadline, "B's vLLM blocks never reached the router's index under B's salt"
        time.sleep(0.3)
    assert indexed(farm, block_hashes(ids, BLOCK_SIZE)) == 0  # not under the unsalted chain
    assert indexed(farm, block_hashes(ids, BLOCK_SIZE, salt_root(salt_a))) == 0  # nor A's
    # B's repeat: vLLM's cache and the router both find B's own prefix
    cached_b, overlap_b, usage = probe(farm, KEY_B, secret_memo)
    assert usage["prompt_tokens"] == len(ids)
    assert cached_b == overlap_b == (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE > 0

    # key A: a first guess warms A's own cache with the template's head; then the right and a wrong guess
    probe(farm, KEY_A, memo(ref, WRONG[1]))
    deadline = time.monotonic() + 20
    head = block_hashes(text_prompt_ids(tok, memo(ref, WRONG[1])), BLOCK_SIZE, salt_root(salt_a))
    while indexed(farm, head) == 0:  # A's head reached the index (so A's probes below see the same state)
        assert time.monotonic() < deadline, "A's vLLM blocks never reached the router's index under A's salt"
        time.sleep(0.3)
    right = probe(farm, KEY_A, memo(ref, SECRET))
    wrong = probe(farm, KEY_A, memo(ref, WRONG[0]))
    assert right[0] == wrong[0] < cached_b  # vLLM's cached tokens: the same for the right and the wrong guess
    assert right[1] == wrong[1] < overlap_b  # the router's overlap: the same
    assert right[0] > 0 and right[1] > 0  # A's own head is reused, in vLLM and by the router
