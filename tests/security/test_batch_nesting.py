"""Item 11: one batch line nested 100k deep failed the whole batch with one `validation_error` ("maximum
recursion depth exceeded"), no line number, the other lines' errors lost. Each line is now judged on its
own: the deep line is its own line-numbered error and the others' errors are kept (the driver in-process,
on a real Redis, with the real tokenizer; no worker needed)."""

from __future__ import annotations

import io
import json

import pytest

from api.app import create_app
from farm.batch.driver import BatchDriver
from farm.batch.validate import MAX_LINE_DEPTH, validate_input
from farm.config import get_config

CHAT = "/v1/chat/completions"


def chat_line(cfg, cid: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": CHAT,
                       "body": {"model": cfg.default_model, "messages": [{"role": "user", "content": "Hi"}], **body}})


def deep(n: int, opener: str = "[") -> str:
    closer = {"[": "]", '{"a":': "}"}[opener]
    head = json.dumps({"custom_id": "deep", "method": "POST", "url": CHAT})[:-1]
    return f'{head}, "body": {opener * n}1{closer * n}}}'


@pytest.fixture
def api(farm_env, redis_client):
    app = create_app(get_config())
    yield app.test_client(), get_config(), redis_client
    app.extensions["farm"].gateway.stop()


def test_a_line_nested_100k_deep_is_its_own_error_and_the_others_are_kept(api):
    c, cfg, r = api
    rows = [chat_line(cfg, "ok"), deep(100_000), chat_line(cfg, "bad", temperature=9), deep(50_000, '{"a":'),
            "{oops", chat_line(cfg, "ok-2")]
    data = "\n".join(rows).encode()
    fid = c.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(data), "deep.jsonl")},
                 content_type="multipart/form-data").get_json()["id"]
    bid = c.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT, "completion_window": "24h"}
                 ).get_json()["id"]
    assert BatchDriver(cfg, r=r).drive(bid) == "failed"
    b = c.get(f"/v1/batches/{bid}").get_json()
    assert [(e["line"], e["code"]) for e in b["errors"]["data"]] == [
        (2, "json_too_deep"), (3, "invalid_value"), (4, "json_too_deep"), (5, "invalid_json_line")]
    assert str(MAX_LINE_DEPTH) in b["errors"]["data"][0]["message"]
    assert b["request_counts"] == {"total": 0, "completed": 0, "failed": 0}


def test_moderate_nesting_still_gets_the_endpoints_own_checks(api):
    _, cfg, _ = api
    from farm.models.tokenization import get_tokenizer

    tok = get_tokenizer(cfg, cfg.default_model)
    line = json.dumps({"custom_id": "s", "method": "POST", "url": CHAT,
                       "body": {"model": cfg.default_model, "messages": [{"role": "user", "content": "Hi"}],
                                "stop": [[[["x"]]]]}})
    _, errors = validate_input(line.encode(), CHAT, [cfg.default_model], lambda m: tok, lambda m: 4096)
    assert [(e["line"], e["param"]) for e in errors] == [(1, "body.stop")]
