"""/openapi.json describes every route, and a bounded schemathesis run against the real API (gunicorn,
a real redis-server, API keys on, no workers: generation answers 503) finds no 5xx and no hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import requests
import schemathesis
from jsonschema import Draft202012Validator
from schemathesis.checks import not_a_server_error

from api.openapi import build_document
from tests.conftest import free_port, make_farm_env
from tests.procs import ROOT
from tests.security_helpers import KEY_A, bearer, farm_app, fuzz, schema_operation

MAX_EXAMPLES = 15  # per operation: ~16 operations, each request answered in milliseconds
REQUEST_TIMEOUT_S = 10  # "no hang": any answer slower than this fails the run


def _flask_routes(app) -> set[tuple[str, str]]:
    out = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = rule.rule
        for conv in rule.arguments:
            path = path.replace(f"<path:{conv}>", f"{{{conv}}}").replace(f"<{conv}>", f"{{{conv}}}")
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            out.add((method.lower(), path))
    return out


def test_every_route_is_documented_and_nothing_else(redis_url, tmp_path, redis_client):
    with farm_app(redis_url, tmp_path) as app:
        served = app.test_client().get("/openapi.json")
        assert served.status_code == 200
        doc = served.get_json()
        documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
        routes = _flask_routes(app)
    assert routes, "the app has routes"
    assert routes - documented == set(), "routes missing from /openapi.json"
    assert documented - routes == set(), "documented operations the app does not serve"


def test_document_is_openapi_3_1_with_valid_schemas():
    doc = build_document()
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for schema in schemas.values():
        Draft202012Validator.check_schema(schema)
    refs = []

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    assert refs and all(r.removeprefix("#/components/schemas/") in schemas for r in refs)
    chat = schemas["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and {"model", "messages"} <= set(chat["required"])
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    # the generation routes document their errors, 401 and 429 included
    assert {"400", "401", "429", "503"} <= set(doc["paths"]["/v1/chat/completions"]["post"]["responses"])
    messages = doc["paths"]["/v1/messages"]["post"]
    assert {"400", "401", "429", "503", "529"} <= set(messages["responses"])
    assert messages["responses"]["401"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/AnthropicErrorResponse")
    assert {"model", "max_tokens", "messages"} <= set(schemas["AnthropicMessagesRequest"]["required"])


# ---- schemathesis against the real server ----------------------------------------------------------
@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("openapi")
    port = free_port()
    env = {**os.environ, **make_farm_env(redis_url, tmp), "FARM_API_KEYS": KEY_A,
           "FARM_BATCH__MAX_FILE_BYTES": "65536"}
    log = (tmp / "api.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-k", "gthread", "--threads", "8", "-w", "1", "-b", f"127.0.0.1:{port}",
         "--timeout", "0", "api.app:create_app()"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp / "api.log").read_text()[-3000:]
            try:
                if requests.get(base + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "the API did not start"
            time.sleep(0.2)
        # gthread loads the embedding model on a thread after it starts serving (gevent before it accepts, as
        # deployed): let the first /v1/embeddings wait for it here, not within a fuzzed request's time limit
        warm = requests.post(base + "/v1/embeddings", json={"input": "warm up"}, headers=bearer(KEY_A), timeout=120)
        assert warm.status_code == 200, warm.text
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _operations() -> list[tuple[str, str]]:
    doc = build_document()
    return [(method, path) for path, ops in doc["paths"].items() for method in ops]


@pytest.fixture(scope="module")
def api_schema(server):
    # the served document (from_url leaves out the operation serving the schema itself)
    return schemathesis.openapi.from_dict(requests.get(server + "/openapi.json", timeout=10).json())


@pytest.mark.parametrize("method,path", _operations())
def test_schemathesis_finds_no_server_error(api_schema, server, method, path):
    """Generated requests (MAX_EXAMPLES per operation, with a valid key) get no 5xx except the documented
    503 (no workers), every error is OpenAI-shaped, and every answer comes within REQUEST_TIMEOUT_S.
    (Driven through hypothesis directly: schemathesis' pytest plugin does not support this pytest.)"""
    op = schema_operation(api_schema, method, path)

    anthropic = path == "/v1/messages"  # Anthropic's error shape there, OpenAI's everywhere else

    def check(case, resp) -> None:
        if resp.status_code == 503:  # no workers / Redis down: documented, OpenAI-shaped, with Retry-After
            err = resp.json()["error"]
            if anthropic:
                assert err["type"] in ("overloaded_error", "api_error")
            else:
                assert err["code"] in ("no_workers", "overloaded", "redis_unavailable")
            assert int(resp.headers["Retry-After"]) > 0
            return
        case.validate_response(resp, checks=[not_a_server_error])
        if resp.status_code >= 400 and resp.headers.get("Content-Type", "").startswith("application/json"):
            body = resp.json()
            if anthropic:
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
            else:
                assert set(body["error"]) == {"message", "type", "param", "code"}

    assert fuzz(op.as_strategy(), server, check, MAX_EXAMPLES, REQUEST_TIMEOUT_S), "requests were made"
