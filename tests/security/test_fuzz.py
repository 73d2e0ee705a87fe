"""Fuzzing the whole API from /openapi.json with schemathesis, against a farm that can answer: the API as
`farm up` serves it, one real worker (the tiny random-weight model with the real tokenizer: generation
is fast, and the API cannot tell), API keys on. Per operation, schema-valid requests, schema-violating
ones (schemathesis' negative mode) and valid ones naming objects that exist (a file, a batch, a model:
what a stateful run would reach through links, which the document does not declare) get no 5xx at all
(tests/test_openapi.py runs the same without workers, where 503 is the documented answer), every error
is OpenAI-shaped (Anthropic-shaped on /v1/messages), every stream ends with [DONE] (message_stop there) and no
generation error, and every answer comes within REQUEST_TIMEOUT_S."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from api.openapi import build_document
from tests.security.farms import base_url, real_farm
from tests.security_helpers import KEY_A, bearer, fuzz, schema_operation

MAX_EXAMPLES = 20  # per operation (~16 operations); generation answers in well under a second here
REQUEST_TIMEOUT_S = 30
MAX_MODEL_LEN = 96  # bounds every generated completion (and the chat template fits)


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory, tiny_model_dir) -> Iterator[str]:
    with real_farm(redis_url, tmp_path_factory.mktemp("fuzz"), tiny_model_dir, both=1, max_model_len=MAX_MODEL_LEN,
                   env={"FARM_API_KEYS": KEY_A}, config={"batch": {"max_file_bytes": 65536}}) as farm:
        yield base_url(farm)


@pytest.fixture(scope="module")
def api_schema(server) -> tuple[Any, dict[str, list[str]]]:
    """The served document, with `model` narrowed to the names this farm serves (otherwise nearly every
    generated request stops at 404 model_not_found and generation is never reached), and real ids for the
    path parameters (a file, a batch), so the routes behind them are reached too."""
    doc = requests.get(server + "/openapi.json", timeout=10).json()
    names = [m["id"] for m in requests.get(server + "/v1/models", headers=bearer(KEY_A), timeout=10).json()["data"]]
    for name in ("ChatCompletionRequest", "CompletionRequest", "AnthropicMessagesRequest"):
        doc["components"]["schemas"][name]["properties"]["model"] = {"enum": names}
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": names[0], "messages": [{"role": "user", "content": "hi"}]}})
    files = [requests.post(server + "/v1/files", headers=bearer(KEY_A), data={"purpose": "batch"}, timeout=10,
                           files={"file": ("in.jsonl", line.encode())}).json()["id"] for _ in range(3)]
    batch = requests.post(server + "/v1/batches", headers=bearer(KEY_A), timeout=10, json={
        "input_file_id": files[0], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()["id"]
    return schemathesis.openapi.from_dict(doc), {"model_id": names, "file_id": files, "batch_id": [batch]}


def _operations() -> list[tuple[str, str]]:
    return [(method, path) for path, ops in build_document()["paths"].items() for method in ops]


@pytest.mark.parametrize("method,path", _operations())
def test_no_request_gets_a_server_error(api_schema, server, method, path):
    schema, known = api_schema
    op = schema_operation(schema, method, path)
    # schema-valid requests, schema-violating ones, and valid ones naming objects that exist
    strategies = [op.as_strategy(), op.as_strategy(GenerationMode.NEGATIVE)]
    ids = [name for name in known if "{" + name + "}" in path]
    if ids:
        strategies.append(st.one_of(*[op.as_strategy(path_parameters={ids[0]: v}) for v in known[ids[0]]]))

    anthropic = path.startswith("/v1/messages")  # Anthropic's error shape (and event stream) there

    def check(case, resp) -> None:
        assert resp.status_code < 500, (case.method, case.path, case.body, resp.text[:500])
        case.validate_response(resp, checks=[not_a_server_error])
        if resp.status_code >= 400:
            body = resp.json()
            if anthropic:
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
            else:
                assert set(body["error"]) == {"message", "type", "param", "code"}
        elif resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            end = 'data: {"type":"message_stop"}' if anthropic else "data: [DONE]"
            assert "generation failed" not in resp.text and resp.text.rstrip().endswith(end)

    assert fuzz(st.one_of(*strategies), server, check, MAX_EXAMPLES, REQUEST_TIMEOUT_S), "requests were made"


def test_a_request_gunicorn_cannot_parse_gets_a_json_error(server):
    """A request line over gunicorn's 4,094 bytes, too many headers and a malformed request line are refused by
    the server before the app sees them; the answer is the API's JSON error, not gunicorn's HTML page (the
    fuzz test met the HTML one with a long query string on GET /v1/batches)."""
    def check(resp: requests.Response, status: int, code: str) -> None:
        assert resp.status_code == status and resp.headers["Content-Type"] == "application/json", resp.text[:200]
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["code"] == code and err["message"]

    check(requests.get(server + "/v1/batches?after=" + "a" * 5000, headers=bearer(KEY_A), timeout=10), 414,
          "uri_too_long")
    many = {f"x-h{i}": "1" for i in range(120)}  # gunicorn's limit_request_fields is 100
    check(requests.get(server + "/v1/models", headers={**bearer(KEY_A), **many}, timeout=10), 431, "headers_too_large")
    host, port = server.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"NOT A REQUEST LINE AT ALL\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"Content-Type: application/json" in head, raw[:300]
    assert json.loads(body)["error"]["code"] == "bad_request"
