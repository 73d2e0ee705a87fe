"""Shared by tests/test_security_*.py, tests/security/ and tests/test_openapi.py: a real app on a real Redis
with extra env."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from flask import Flask

from api.app import create_app
from farm.config import get_config
from tests.conftest import make_farm_env

KEY_A = "sk-farm-test-key-a-0123456789"
KEY_B = "sk-farm-test-key-b-9876543210"


@contextmanager
def farm_app(redis_url: str, tmp: Path, **env: str) -> Iterator[Flask]:
    """`create_app()` under the farm's test environment plus `env` (e.g. FARM_API_KEYS)."""
    tmp.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        for k in ("FARM_API_KEYS", "FARM_METRICS_TOKEN", "FARM_REDIS_PASSWORD"):  # another app's, still set
            mp.delenv(k, raising=False)
        for k, v in {**make_farm_env(redis_url, tmp), **env}.items():
            mp.setenv(k, v)
        get_config.cache_clear()
        app = create_app()
        try:
            yield app
        finally:
            app.extensions["farm"].gateway.stop()
            get_config.cache_clear()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_error(resp, status: int, code: str | None = None, type_: str | None = None,
                        param: str | None = None) -> dict:
    """OpenAI's error shape exactly: {"error": {message, type, param, code}} as JSON with `status`."""
    assert resp.status_code == status, resp.get_data(as_text=True)[:500]
    assert resp.content_type.startswith("application/json")
    body = resp.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    if type_ is not None:
        assert err["type"] == type_
    if param is not None:
        assert err["param"] == param
    return err


def fuzz(strategy, base_url: str, check: Callable[[Any, Any], None], max_examples: int,
         timeout_s: float) -> list[int]:
    """Send `max_examples` schemathesis cases drawn from `strategy` to `base_url` with KEY_A, each answered
    within `timeout_s`, and `check(case, response)` each; returns the statuses seen. Driven through
    hypothesis directly (deterministic, no example database): schemathesis' pytest plugin does not support
    this pytest."""
    from hypothesis import HealthCheck, Phase, given, settings

    statuses: list[int] = []

    @given(case=strategy)
    @settings(max_examples=max_examples, deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    def run(case) -> None:
        started = time.monotonic()
        resp = case.call(base_url=base_url, headers=bearer(KEY_A), timeout=timeout_s)
        assert time.monotonic() - started < timeout_s
        statuses.append(resp.status_code)
        check(case, resp)

    run()
    return statuses


def schema_operation(schema, method: str, path: str):
    """The schemathesis operation of `method` `path`."""
    [op] = [r.ok() for r in schema.get_all_operations() if r.ok().method == method and r.ok().path == path]
    return op
