"""A worker's log at INFO has no lines per task from Celery (two formatted writes per request on the hot path,
and "succeeded" only meant the request reached the engine); at DEBUG they are back."""

from __future__ import annotations

import logging

import pytest

from tasks.worker import PER_TASK_LOGGERS, quiet_per_task_logs


@pytest.fixture(autouse=True)
def _restore_levels():
    before = {n: logging.getLogger(n).level for n in PER_TASK_LOGGERS}
    yield
    for n, level in before.items():
        logging.getLogger(n).setLevel(level)


@pytest.mark.parametrize("loglevel", ["INFO", "info", "WARNING"])
def test_celerys_per_task_lines_are_not_written_at_info(loglevel, caplog):
    logging.getLogger().setLevel(logging.DEBUG)
    quiet_per_task_logs(loglevel)
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("celery.worker.strategy").info("Task farm.generate[x] received")
        logging.getLogger("celery.app.trace").info("Task farm.generate[x] succeeded in 0.003s: None")
        logging.getLogger("celery.app.trace").error("Task farm.generate[y] raised unexpected: RuntimeError()")
    assert [r.getMessage() for r in caplog.records] == ["Task farm.generate[y] raised unexpected: RuntimeError()"]


def test_they_are_written_at_debug(caplog):
    for n in PER_TASK_LOGGERS:
        logging.getLogger(n).setLevel(logging.NOTSET)
    quiet_per_task_logs("DEBUG")
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("celery.worker.strategy").info("Task farm.generate[x] received")
    assert [r.getMessage() for r in caplog.records] == ["Task farm.generate[x] received"]
