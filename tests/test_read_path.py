"""Issue 32: every reader of a request's events goes through the typed read path (farm.gateway.replies parses a
reply batch into typed events, farm.gateway.reading and Submission consume them). Raw-dict reads of stream events
(`ev.get("type") == "delta"`, `ev["type"] in ("done", "error")`) would bypass it; the only places that handle the
wire dicts are the types themselves and the worker's writer, which builds them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIRE_SIDE = {"farm/protocol/stream_events.py", "farm/worker/stream_writer.py"}
RAW_EVENT_READ = re.compile(
    r"""(\.get\(\s*["']type["']\s*\)|\[\s*["']type["']\s*\])\s*(==|!=|not\s+in|in)\s*[\(\[{]?\s*["'](start|delta|done|error)["']""")


def test_no_module_reads_stream_events_as_raw_dicts():
    offenders = []
    for base in ("farm", "api", "tasks"):
        for path in sorted((ROOT / base).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in WIRE_SIDE:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if RAW_EVENT_READ.search(line):
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "stream events read as raw dicts (use farm.gateway.reading / the typed events):\n" + \
        "\n".join(offenders)


def test_the_pattern_catches_what_it_is_for():
    for line in ('if ev.get("type") == "delta":', 'kind = ev["type"] in ("done", "error")', "x['type'] != 'start'"):
        assert RAW_EVENT_READ.search(line), line
    for line in ('if v.get("type") not in RESPONSE_FORMATS:', 'part.get("type") == "text"'):
        assert not RAW_EVENT_READ.search(line), line
