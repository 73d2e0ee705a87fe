"""`farm serve` (one model, like `vllm serve`), the progress `farm up` prints while it waits, `farm logs`, and
log rotation. One real farm: `farm serve <the default model's GGUF> --workers 1 --detach` from the command line,
a chat completion through the OpenAI SDK, then `farm logs` and `farm down`."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from farm.cli.main import build_parser, main, serve_config
from farm.config import load_config
from farm.infra import logfiles
from farm.models.directories import _builtin_gguf
from farm.supervisor.progress import ProgressPrinter, describe
from tests.conftest import free_port, make_farm_env

ROOT = Path(__file__).resolve().parents[1]


def test_rotation_keeps_backups_and_the_writer_keeps_appending(tmp_path):
    log = tmp_path / "api.log"
    with open(log, "ab", buffering=0) as writer:  # a child's O_APPEND descriptor, held across rotations
        for i in range(5):
            writer.write(b"x" * 100 + f" round {i}\n".encode())
            assert logfiles.rotate(log, max_bytes=50, backups=3)
        assert not logfiles.rotate(log, max_bytes=50, backups=3), "an empty log is not rotated"
        writer.write(b"after\n")
    assert log.read_bytes() == b"after\n", "the writer's next line lands at the start of the truncated file"
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["api.log", "api.log.1", "api.log.2", "api.log.3"], "the oldest rotations are dropped"
    assert log.with_name("api.log.1").read_text().endswith("round 4\n")
    assert log.with_name("api.log.3").read_text().endswith("round 2\n")
    assert logfiles.tail_lines(log.with_name("api.log.1"), 1) == ["x" * 100 + " round 4"]


def test_progress_prints_changes_and_reminders():
    out = io.StringIO()
    p = ProgressPrinter(out, every_s=3600)
    starting = {"redis": True, "api": False, "flower": None, "workers": {"prefill-1": True, "decode-1": False}}
    p(starting, 1.0)
    p(starting, 1.5)  # unchanged: nothing new
    p({**starting, "api": True, "workers": {"prefill-1": True, "decode-1": True}}, 9.0)
    lines = out.getvalue().splitlines()
    assert lines == ["farm: [   1s] redis up | api waiting | workers 1/2 ready (waiting: decode-1)",
                     "farm: [   9s] redis up | api up | workers 2/2 ready"]
    assert describe({"redis": False, "api": None, "flower": None, "workers": {}}) == "redis waiting"


def test_serve_configuration_from_flags(tmp_path):
    cfg = load_config(environ={"FARM_STATE_DIR": str(tmp_path)})
    args = build_parser().parse_args(["serve", cfg.default_model, "--router-temperature", "0.5",
                                      "--kv-overlap-score-weight", "2", "--max-model-len", "2048"])
    out = serve_config(cfg, args)
    assert [m.name for m in out.models] == [cfg.default_model] and out.default_model == cfg.default_model
    assert (out.router.temperature, out.router.overlap_weight, out.router.cost) == (0.5, 2.0, "dynamo")
    assert out.models[0].max_model_len == 2048
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--backend", "tgi"])
    assert main(["serve", str(tmp_path / "missing.gguf")]) == 2, "no such model: a configuration error"


def test_farm_serve_a_gguf_file_from_the_command_line(redis_url, tmp_path):
    import openai

    env = {**os.environ, **make_farm_env(redis_url, tmp_path)}
    env.pop("FARM_CONFIG")  # the farm's defaults, as from a fresh clone
    env["FARM_LOGS__FORMAT"] = "json"  # JSON log lines on request
    port = free_port()
    gguf = _builtin_gguf("builtin:smollm2")
    farm = [sys.executable, "-m", "farm.cli"]
    up = subprocess.run([*farm, "serve", str(gguf), "--workers", "1", "--port", str(port), "--no-flower",
                         "--detach", "--timeout", "240"], env=env, cwd=ROOT, capture_output=True, text=True,
                        timeout=400)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "farm is up" in up.stdout and f"http://127.0.0.1:{port}/v1" in up.stdout
        progress = [line for line in up.stderr.splitlines() if line.startswith("farm: [")]
        assert progress and "workers 1/1 ready" in progress[-1], up.stderr
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        name = gguf.stem
        ids = {m.id for m in client.models.list().data}
        assert name in ids and load_config().default_model not in ids, ids  # the one model (and semantic aliases)
        resp = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Say hi."}],
                                              max_tokens=8, temperature=0)
        assert resp.choices[0].message.content and resp.usage.completion_tokens > 0
        logs = subprocess.run([*farm, "logs", "-n", "3"], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert logs.returncode == 0 and "==> api (" in logs.stdout and "==> both-1 (" in logs.stdout
        one = subprocess.run([*farm, "logs", "api", "-n", "200"], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert "POST /v1/chat/completions" in one.stdout or "chat/completions" in one.stdout, one.stdout[-2000:]
        bad = subprocess.run([*farm, "logs", "nope"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "there are:" in bad.stderr
        logs = Path(env["FARM_STATE_DIR"]) / "logs"
        access = [r for r in json_records(logs / "api.log") if "POST /v1/chat/completions" in r["msg"]]
        assert access and access[0]["logger"] == "gunicorn.access" and access[0]["level"] == "INFO"
        worker = json_records(logs / "both-1.log")
        assert any(r["logger"].startswith("farm.") for r in worker), "the worker logs JSON lines too"
    finally:
        down = subprocess.run([*farm, "down", "--grace", "10"], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            import requests

            requests.get(f"http://127.0.0.1:{port}/health/live", timeout=1)
        except requests.RequestException:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the API still answers after `farm down`")


def json_records(path: Path) -> list[dict]:
    """The JSON log records of a log file (the supervisor's own banner lines and library prints aside)."""
    import json

    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    assert out, f"no JSON lines in {path}"
    assert all({"ts", "level", "logger", "msg", "pid"} <= r.keys() for r in out)
    return out


def test_logs_without_a_farm(tmp_path, monkeypatch):
    monkeypatch.setenv("FARM_STATE_DIR", str(tmp_path / "none"))
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["logs"]) == 1


def test_client_commands_honour_the_openai_environment(monkeypatch):
    import argparse

    from farm.batch.cli import _client

    cfg = load_config(environ={})
    for k in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "FARM_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    plain = _client(cfg, argparse.Namespace(url=None))
    assert plain.base == f"http://127.0.0.1:{cfg.api.port}" and "Authorization" not in plain.s.headers
    monkeypatch.setenv("OPENAI_BASE_URL", "http://farm.example:9000/v1/")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    c = _client(cfg, argparse.Namespace(url=None))
    assert c.base == "http://farm.example:9000" and c.s.headers["Authorization"] == "Bearer sk-openai"
    monkeypatch.setenv("FARM_API_KEY", "sk-farm")
    c = _client(cfg, argparse.Namespace(url="http://other:1"))
    assert c.base == "http://other:1" and c.s.headers["Authorization"] == "Bearer sk-farm"
