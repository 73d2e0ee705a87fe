"""Item 3: the semantic cache leaked answers between tenants (key k2 got k1's answer, with
`x-vsr-cache-hit: true`, which also told k2 what k1 had asked). It is partitioned by the API key's owner
by default; `semantic.cache.shared_across_tenants` opts in to one cache for all.

No worker runs here: a request that misses the cache reaches the gateway and gets 503 (no workers), so a
200 with `x-vsr-cache-hit` can only be the cache. k1's answer is stored as the chat route stores it after a
generation (`layer.before(..., tenant=k1's owner)` then `layer.after`)."""

from __future__ import annotations

import pytest

from farm.tenancy.api_keys import OWNER_ANONYMOUS, KeyRing
from tests.security_helpers import KEY_A, KEY_B, bearer, farm_app

QUESTION = "Which river flows through Budapest?"
ANSWER = "The Danube."


def ask(app, key: str | None):
    body = {"model": "MoM", "messages": [{"role": "user", "content": QUESTION}]}
    return app.test_client().post("/v1/chat/completions", json=body, headers=bearer(key) if key else {})


def store_answer_of(app, owner: str) -> None:
    layer = app.extensions["farm"].semantic()
    v = layer.before("MoM", [{"role": "user", "content": QUESTION}], tenant=owner)
    assert v.action == "forward" and layer.after(v, ANSWER)


def owner_of(app, key: str) -> str:
    return KeyRing.from_config(app.extensions["farm"].cfg).owner(key)


def assert_hit(resp) -> None:
    assert resp.status_code == 200 and resp.headers["x-vsr-cache-hit"] == "true"
    assert resp.get_json()["choices"][0]["message"]["content"] == ANSWER


def assert_miss(resp) -> None:
    assert resp.status_code == 503 and "x-vsr-cache-hit" not in resp.headers, resp.get_data(as_text=True)[:300]
    assert ANSWER not in resp.get_data(as_text=True)


def test_one_keys_answer_is_never_served_to_another(redis_url, tmp_path, redis_client):
    with farm_app(redis_url, tmp_path, FARM_API_KEYS=f"{KEY_A},{KEY_B}") as app:
        store_answer_of(app, owner_of(app, KEY_A))
        assert_hit(ask(app, KEY_A))
        assert_miss(ask(app, KEY_B))
        assert_hit(ask(app, KEY_A))  # still k1's
        store_answer_of(app, owner_of(app, KEY_B))  # k2's own answer is k2's
        assert_hit(ask(app, KEY_B))


def test_keyless_clients_are_a_tenant_of_their_own(redis_url, tmp_path, redis_client):
    with farm_app(redis_url, tmp_path / "keyed", FARM_API_KEYS=KEY_A) as keyed:
        store_answer_of(keyed, owner_of(keyed, KEY_A))
    with farm_app(redis_url, tmp_path / "keyless") as keyless:  # the same Redis, now without keys
        assert_miss(ask(keyless, None))
        store_answer_of(keyless, OWNER_ANONYMOUS)
        assert_hit(ask(keyless, None))


def test_sharing_across_tenants_is_an_explicit_opt_in(redis_url, tmp_path, redis_client):
    with farm_app(redis_url, tmp_path, FARM_API_KEYS=f"{KEY_A},{KEY_B}",
                  FARM_SEMANTIC__CACHE__SHARED_ACROSS_TENANTS="true") as app:
        store_answer_of(app, owner_of(app, KEY_A))
        assert_hit(ask(app, KEY_B))


@pytest.mark.parametrize("shared", [False, True])
def test_the_default_is_partitioned(shared):
    from farm.config import load_config

    env = {"FARM_SEMANTIC__CACHE__SHARED_ACROSS_TENANTS": "true"} if shared else {}
    assert load_config(environ=env).semantic.cache.shared_across_tenants is shared
