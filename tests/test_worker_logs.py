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


def test_the_runtimes_line_per_request_carries_the_tasks_context_from_the_engines_thread():
    """The request ends on the engine's thread, whose context knows no request: the line is written in the context
    the task thread had when it submitted the request (farm.worker.runtime._submit)."""
    import contextvars
    import json
    import threading

    from farm.engine.contract import RequestOutput
    from farm.infra import logcontext
    from farm.infra.logfiles import JsonFormatter
    from farm.worker.runtime import _log_finished

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("farm.worker")
    logger.addHandler(handler)
    before = logger.level
    logger.setLevel(logging.INFO)
    lines: list[dict] = []
    try:
        def task() -> contextvars.Context:
            logcontext.bind(request_id="req-1", model="m")
            return contextvars.copy_context()

        box: list[contextvars.Context] = []
        t = threading.Thread(target=lambda: box.append(task()))
        t.start()
        t.join()
        out = RequestOutput("req-1", finished=True, finish_reason="length", prompt_tokens=12, cached_tokens=8,
                            completion_tokens=5)

        def in_the_tasks_context() -> None:  # the formatter reads the context where a handler formats the record
            _log_finished("both", out, 0.25)
            lines.extend(json.loads(JsonFormatter().format(r)) for r in records)

        def engine_thread() -> None:
            box[0].run(in_the_tasks_context)
            assert "request_id" not in logcontext.fields()  # nothing leaked into the engine thread's own context

        e = threading.Thread(target=engine_thread)
        e.start()
        e.join()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
    assert len(lines) == 1
    assert lines[0]["request_id"] == "req-1" and lines[0]["model"] == "m" and lines[0]["level"] == "INFO"
    assert lines[0]["msg"] == "request req-1 finished in 0.250 s: length, 12 prompt tokens (8 cached), 5 generated"
