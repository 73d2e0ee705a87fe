"""The farm's logs: rotation of the supervisor's log files, what `farm logs` reads, JSON lines on request.

A child writes its log through an O_APPEND descriptor it holds for its whole life, so a log is rotated by
copy and truncate: the bytes so far go to `<name>.log.1` (older copies shift up to `.<backups>`, the oldest
is dropped) and the live file is truncated in place; the child's next write lands at the new end. A few
lines written during the copy may be lost, never reordered (logrotate's copytruncate, the same trade).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from farm.infra import logcontext, tracing
from farm.infra.filemodes import open_private, private_umask

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line (`logs.format: json`): time, level, logger, message, process id, exception, and
    where known the request's id, model, worker and trace id (farm.infra.logcontext, farm.infra.tracing)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
                               "msg": record.getMessage(), "pid": record.process}
        out.update(logcontext.fields())
        if tracing.ENABLED and (tid := tracing.trace_id()):
            out["trace_id"] = tid  # the span current where the line was logged
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str | int, as_json: bool) -> None:
    """The root logger of a farm process (worker, batch driver): to stderr, as text or as JSON lines. Also
    the files the process creates from now on become its user's alone (umask 077, farm.infra.filemodes), however
    it was started (`farm up`, the Procfile, a container)."""
    private_umask()
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if as_json else logging.Formatter(TEXT_FORMAT))
    # force (replace handlers set up earlier) only for JSON, so the text setup stays what it always was
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, handlers=[handler], force=as_json)


def gunicorn_logconfig(as_json: bool) -> dict[str, Any] | None:
    """gunicorn's `logconfig_dict` for JSON lines (its error and access logs, and the app's), else None."""
    if not as_json:
        return None
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"json": {"()": "farm.infra.logfiles.JsonFormatter"}},
            "handlers": {"console": handler, "error_console": handler},
            "root": {"level": "INFO", "handlers": ["console"]},
            "loggers": {"gunicorn.error": {"level": "INFO", "handlers": ["error_console"], "propagate": False},
                        "gunicorn.access": {"level": "INFO", "handlers": ["console"], "propagate": False}}}


def rotate(path: Path, max_bytes: int, backups: int) -> bool:
    """Rotate `path` if it is larger than `max_bytes`; True when it was rotated."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    if backups > 0:
        for i in range(backups - 1, 0, -1):
            older = path.with_name(f"{path.name}.{i}")
            if older.exists():
                os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
        with open(path, "rb") as src, os.fdopen(open_private(path.with_name(f"{path.name}.1"),  # 0600: logs
                                                             os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as dst:
            shutil.copyfileobj(src, dst)
    with open(path, "r+b") as f:
        f.truncate(0)
    return True


def log_names(log_dir: Path) -> list[str]:
    """The components that have a log (the process names of `farm up`)."""
    return sorted(p.name[: -len(".log")] for p in log_dir.glob("*.log"))


def tail_lines(path: Path, n: int) -> list[str]:
    """The last `n` lines of a file (read from its end, so a large log costs little)."""
    if n <= 0 or not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = pos = f.tell()
        data = b""
        while pos > 0 and data.count(b"\n") <= n:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[-n:] if end else []


def follow(path: Path, poll_s: float = 0.25) -> Iterator[str]:
    """Lines appended to `path` from now on, across rotations (a truncated file is read again from its start)."""
    pos = path.stat().st_size if path.exists() else 0
    buf = b""
    while True:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size < pos:  # rotated (truncated): start over
            pos = 0
        if size > pos:
            with open(path, "rb") as f:
                f.seek(pos)
                buf += f.read(size - pos)
                pos = f.tell()
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", "replace")
        else:
            time.sleep(poll_s)
