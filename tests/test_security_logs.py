"""Prompts never reach the logs at info level (or Flower's task view): requests carrying a canary string
go through validation errors, queueing, a timeout and an unexpected failure, and the canary (and its
token ids) appear in no captured record and in no Celery message header."""

from __future__ import annotations

import json
import logging

import pytest

from farm.protocol.queues import direct_queue
from tests.ghosts import ghost_alive
from tests.security_helpers import farm_app

CANARY = "CANARY-7f3a9-private-patient-record"
GHOST = "ghost-logs@test"


@pytest.fixture
def app(redis_url, tmp_path, redis_client):
    with farm_app(redis_url, tmp_path) as app:
        yield app


def test_prompts_are_not_logged(app, redis_client, caplog, monkeypatch):
    cfg = app.extensions["farm"].cfg
    c = app.test_client()
    model = cfg.default_model
    msg = [{"role": "user", "content": f"Please summarise the record {CANARY} for me"}]
    tok = app.extensions["farm"].tokenizer(model)
    canary_ids = tok.encode(CANARY, add_special_tokens=False)
    caplog.set_level(logging.INFO)
    # 1. rejected by validation; 2. no workers (503)
    assert c.post("/v1/chat/completions", json={"model": model, "messages": msg, "temperature": 7}).status_code == 400
    assert c.post("/v1/chat/completions", json={"model": model, "messages": msg}).status_code == 503
    assert c.post("/v1/completions", json={"model": model, "prompt": CANARY, "bogus": 1}).status_code == 400
    # 3. queued on a worker that never answers: 504, and the Celery message is in Redis to inspect
    with ghost_alive(redis_client, GHOST, model, cfg.engine.block_size):  # taken away, queue and all, at the end
        monkeypatch.setattr(cfg.api, "first_event_timeout_s", 1)
        assert c.post("/v1/chat/completions", json={"model": model, "messages": msg, "max_tokens": 4}).status_code == 504
        assert c.post("/v1/chat/completions", json={"model": model, "messages": msg, "max_tokens": 4,
                                                    "stream": True}).status_code == 504
        # 4. an unexpected exception while handling it (logged with a traceback)
        gw = app.extensions["farm"].gateway

        def boom(req):
            raise RuntimeError("submit failed")

        monkeypatch.setattr(gw, "submit", boom)
        assert c.post("/v1/completions", json={"model": model, "prompt": CANARY, "max_tokens": 2}).status_code == 500
        assert any(r.levelno >= logging.INFO for r in caplog.records), "the capture works: something was logged"
        ids_text = ", ".join(map(str, canary_ids))
        for r in caplog.records:
            text = r.getMessage() + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
            assert CANARY not in text, f"{r.name}: {text[:300]}"
            assert ids_text not in text, f"{r.name} logs the prompt's token ids"
        # Celery puts `argsrepr` in worker logs and task events (Flower): only the request id is there
        messages = redis_client.lrange(direct_queue(GHOST), 0, -1)
        assert len(messages) == 2
        for raw in messages:
            headers = json.loads(raw)["headers"]
            assert "prompt not shown" in headers["argsrepr"] and headers["id"]
            assert ids_text not in headers["argsrepr"] and "prompt_token_ids" not in headers["argsrepr"]
