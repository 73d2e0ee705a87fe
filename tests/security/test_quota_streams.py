"""The token quota holds against what the probe of issue 26 used to overshoot it: streams the client closes early
are charged for what they received, and a request of many choices (or a long default max_tokens) can never take a
key past its quota, because a generation reserves the most it may use before it is queued."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flask import Flask

from farm.tenancy.api_keys import owner_of
from tests.ghosts import ghost_alive
from tests.security_helpers import KEY_A, assert_openai_error, bearer, farm_app
from tests.test_api_stream import GHOST, ScriptedWorker, both_start, deltas, done

QUOTA = 400


@pytest.fixture(scope="module")
def app(redis_url, tmp_path_factory) -> Iterator[Flask]:
    env = {"FARM_API_KEYS": KEY_A, "FARM_API__LIMITS__TOKEN_QUOTA": str(QUOTA),
           "FARM_SEMANTIC__ENABLED": "false"}
    with farm_app(redis_url, tmp_path_factory.mktemp("quota"), **env) as app:
        yield app


@pytest.fixture
def ctx(app, redis_client):
    cfg = app.extensions["farm"].cfg
    app.extensions["farm"].tokenizer(cfg.default_model)  # loaded before the first request
    import hashlib

    owner = owner_of(hashlib.sha256(KEY_A.encode()).hexdigest())
    limiter = app.extensions["farm_auth"].limiter
    with ghost_alive(redis_client, GHOST, cfg.default_model, cfg.engine.block_size):
        yield app.test_client(), cfg, limiter, owner


def chat(cfg, **kw):
    return {"model": cfg.default_model, "messages": [{"role": "user", "content": "Tell me a story."}], **kw}


def test_a_stream_closed_early_is_charged_for_its_prompt_and_the_tokens_it_received(ctx):
    c, cfg, limiter, owner = ctx
    w = ScriptedWorker(limiter.r, [both_start(), *deltas(*"abcdefghij")])  # ten tokens, then it would go on
    resp = c.post("/v1/chat/completions", headers=bearer(KEY_A), json=chat(cfg, stream=True, max_tokens=100),
                  buffered=False)
    assert resp.status_code == 200
    chunks = iter(resp.response)
    received = b""
    while received.count(b'"content":') < 4:  # the role chunk and three tokens
        received += next(chunks)
    held = limiter.used_tokens(owner)
    prompt = len(w.request.prompt_token_ids)
    assert held == prompt + 100  # while it streams, the most it may use is held
    resp.close()  # the client leaves
    used = limiter.used_tokens(owner)
    assert prompt + 3 <= used <= prompt + 10, (prompt, used)  # what it received, not the reservation, not zero


def test_many_choices_are_capped_to_what_is_left_and_never_overshoot(ctx):
    c, cfg, limiter, owner = ctx
    before = limiter.used_tokens(owner)
    workers = [ScriptedWorker(limiter.r, [both_start(), *deltas("x"), done("length")]) for _ in range(2)]
    resp = c.post("/v1/chat/completions", headers=bearer(KEY_A), json=chat(cfg, n=2, max_tokens=1000))
    assert resp.status_code == 200, resp.get_data(as_text=True)
    prompt = len(workers[0].request.prompt_token_ids)
    capped = (QUOTA - before - prompt) // 2
    assert resp.headers["x-farm-quota-max-tokens"] == str(capped)
    assert [w.request.sampling.max_tokens for w in workers] == [capped, capped]
    # the scripted workers report 2 completion tokens each (their done event's usage), the prompt counted once
    assert limiter.used_tokens(owner) == before + prompt + 2 + 2
    assert limiter.used_tokens(owner) <= QUOTA


def test_a_spent_quota_refuses_before_anything_is_queued(ctx, redis_client):
    c, cfg, limiter, owner = ctx
    left = QUOTA - limiter.used_tokens(owner)
    assert limiter.reserve(owner, QUOTA, least=1).tokens == left  # everything that is left
    err = assert_openai_error(c.post("/v1/chat/completions", headers=bearer(KEY_A), json=chat(cfg, max_tokens=5)),
                              429, "insufficient_quota", "insufficient_quota")
    assert "Limit 400" in err["message"]
    from farm.protocol.queues import direct_queue

    assert redis_client.llen(direct_queue(GHOST)) == 0  # nothing was queued for a worker
