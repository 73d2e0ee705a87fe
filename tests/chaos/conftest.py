"""Chaos tests: faults injected into real processes (redis-server, Celery workers, a reading gateway).

Workers run the tiny random-weight Llama (tests/conftest.py `tiny_model_dir`) with the real tokenizer,
so greedy runs are deterministic and fast enough to kill mid-stream on a small CPU box."""

from __future__ import annotations

import pytest

from tests.chaos.harness import ChaosFarm


@pytest.fixture(scope="module")
def chaos_farm_factory(tmp_path_factory, tiny_model_dir):
    farms: list[ChaosFarm] = []

    def make(**overrides: str) -> ChaosFarm:
        f = ChaosFarm(tmp_path_factory.mktemp("chaos"), tiny_model_dir, **overrides)
        farms.append(f)
        return f

    yield make
    for f in farms:
        f.stop()
