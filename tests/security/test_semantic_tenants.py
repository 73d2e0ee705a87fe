"""Item 3: the semantic cache leaked answers between tenants (key k2 got k1's answer, with
`x-vsr-cache-hit: true`, which also told k2 what k1 had asked). It is partitioned by the API key's owner
by default; `semantic.cache.shared_across_tenants` opts in to one cache for all.

No worker runs here: a request that misses the cache reaches the gateway and gets 503 (no workers), so a
200 with `x-vsr-cache-hit` can only be the cache. k1's answer is stored as the chat route stores it after a
generation (`layer.before(..., scope=k1's scope)` then `layer.after`). A request's scope is its KV cache salt: its
key's owner and its own `cache_salt`, so one key's end users are kept apart as well, and the layer's memo (whose
speed would tell what was sent) keeps to it on every route."""

from __future__ import annotations

import pytest

from farm.tenancy.api_keys import OWNER_ANONYMOUS, KeyRing, tenant_cache_salt
from tests.security_helpers import KEY_A, KEY_B, bearer, farm_app

QUESTION = "Which river flows through Budapest?"
ANSWER = "The Danube."


def ask(app, key: str | None, cache_salt: str | None = None):
    body = {"model": "MoM", "messages": [{"role": "user", "content": QUESTION}]}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return app.test_client().post("/v1/chat/completions", json=body, headers=bearer(key) if key else {})


def store_answer_of(app, owner: str, cache_salt: str | None = None, question: str = QUESTION,
                    answer: str = ANSWER) -> None:
    layer = app.extensions["farm"].semantic()
    v = layer.before("MoM", [{"role": "user", "content": question}], scope=tenant_cache_salt(owner, cache_salt),
                     tenant=tenant_cache_salt(owner))
    assert v.action == "forward" and layer.after(v, answer)


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


def test_one_keys_end_users_are_kept_apart_by_their_cache_salt(redis_url, tmp_path, redis_client):
    """The README's advice, one `cache_salt` per end user, keeps them apart in the semantic cache as in the KV
    cache: an answer stored for one end user is not served to another end user of the same key, nor to the key's
    requests without a salt."""
    with farm_app(redis_url, tmp_path, FARM_API_KEYS=KEY_A) as app:
        store_answer_of(app, owner_of(app, KEY_A), "end-user-1")
        assert_hit(ask(app, KEY_A, "end-user-1"))
        assert_miss(ask(app, KEY_A, "end-user-2"))
        assert_miss(ask(app, KEY_A))


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_the_layers_memo_keeps_each_key_to_its_own_texts_on_every_route(redis_url, tmp_path, redis_client, route):
    """The layer remembers each text's embedding per scope. A text another key sent must be computed again for
    this key: a hit would answer faster, and the time (milliseconds apart) would tell B what A sent. Text
    completions shared one scope for all keys (their `decide` got no tenant)."""
    prompt = "Memo for Margaret Oyelaran-Whitfield: the review is moved to Thursday."
    body = {"model": "MoM", "prompt": prompt} if "chat" not in route else \
        {"model": "MoM", "messages": [{"role": "user", "content": prompt}]}
    with farm_app(redis_url, tmp_path, FARM_API_KEYS=f"{KEY_A},{KEY_B}") as app:
        embedder = app.extensions["farm"].semantic().embedder
        encoded: list[str] = []
        encode = embedder.encode_texts

        def counting(texts):
            encoded.extend(texts)
            return encode(texts)

        embedder.encode_texts = counting
        try:
            for key in (KEY_A, KEY_A, KEY_B, KEY_B):
                app.test_client().post(route, json=body, headers=bearer(key))
        finally:
            embedder.encode_texts = encode
    assert encoded.count(prompt) == 2, encoded  # once for A, once for B; each key's repeat from its own memo


def test_one_keys_flood_of_answers_leaves_the_others_cached(redis_url, tmp_path, redis_client):
    """The cache's room is shared, but each key's owner has a share of it (`semantic.cache.max_tenant_entries`):
    B storing many answers, under any number of `cache_salt`s, evicts B's own oldest, not A's answer."""
    with farm_app(redis_url, tmp_path, FARM_API_KEYS=f"{KEY_A},{KEY_B}", FARM_SEMANTIC__CACHE__MAX_ENTRIES="12",
                  FARM_SEMANTIC__CACHE__MAX_TENANT_ENTRIES="4") as app:
        store_answer_of(app, owner_of(app, KEY_A))
        for i in range(14):
            store_answer_of(app, owner_of(app, KEY_B), f"user-{i}", f"What is {i * 7919} in binary?", f"n{i}")
        assert_hit(ask(app, KEY_A))


def test_the_route_counts_a_stored_answer_against_the_keys_owner(redis_url, tmp_path, redis_client):
    """The share is the owner's, not the request's scope: a client's own `cache_salt` (one per end user, or a
    new one per request) narrows what it may hit, not whose room its answers take."""
    with farm_app(redis_url, tmp_path, FARM_API_KEYS=f"{KEY_A},{KEY_B}") as app:
        layer = app.extensions["farm"].semantic()
        before = layer.before
        seen: list[tuple[str, str]] = []

        def recording(*args, **kw):
            v = before(*args, **kw)
            seen.append((kw["scope"], v.cache_query.tenant))
            return v

        layer.before = recording
        for key, salt in ((KEY_A, None), (KEY_A, "end-user-1"), (KEY_B, "end-user-1")):
            assert_miss(ask(app, key, salt))
        a, b = tenant_cache_salt(owner_of(app, KEY_A)), tenant_cache_salt(owner_of(app, KEY_B))
    assert [t for _, t in seen] == [a, a, b]
    assert len({s for s, _ in seen}) == 3


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
