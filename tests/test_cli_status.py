"""`farm status`, `farm down`, argument and configuration errors, against a real Redis."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from farm.cli.main import main
from farm.cluster import registry
from farm.config import load_config
from farm.protocol import PRIORITY_SEP, queue_name
from farm.supervisor import worker_counts
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cli_env(tmp_path, redis_url, monkeypatch) -> dict[str, str]:
    """This process's environment for in-process `main()`, and a copy for `python -m farm.cli`."""
    for k in [k for k in os.environ if k.startswith("FARM_") and k != "FARM_SECRET"]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("FARM_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FARM_REDIS__URL", redis_url)
    return dict(os.environ)


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "farm.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def _worker(model: str, role: str, wid: str) -> registry.WorkerInfo:
    return registry.WorkerInfo(worker_id=wid, role=role, model=model, hostname="testhost", pid=4242,
                               block_size=16, transfer_endpoint="127.0.0.1:9999")


def test_status_json_shows_workers_by_role_and_queue_depths(cli_env, redis_client):
    cfg = load_config()
    model = cfg.default_model
    registry.register(redis_client, _worker(model, "decode", "decode-7@testhost"))
    registry.register(redis_client, _worker(model, "prefill", "prefill-3@testhost"))
    prefill_q = queue_name(model, "prefill")
    redis_client.lpush(prefill_q, "m1", "m2")
    redis_client.lpush(f"{prefill_q}{PRIORITY_SEP}9", "urgent")  # kombu's list for priority 9

    proc = _run(cli_env, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    assert {"workers", "queues", "processes", "models"} <= set(st)
    roles = st["workers"][model]
    assert [w["worker_id"] for w in roles["decode"]] == ["decode-7@testhost"]
    assert [w["worker_id"] for w in roles["prefill"]] == ["prefill-3@testhost"]
    assert roles["both"] == []
    assert st["queues"][prefill_q] == 3
    assert st["queues"][queue_name(model, "decode")] == 0
    assert st["processes"] == []
    assert [m["name"] for m in st["models"] if m["default"]] == [model]
    assert st["redis"]["ok"] is True


def test_status_text_and_dead_worker_is_gone(cli_env, redis_client, capsys):
    model = load_config().default_model
    registry.register(redis_client, _worker(model, "both", "both-1@testhost"))
    registry.register(redis_client, _worker(model, "decode", "decode-dead@testhost"))
    redis_client.delete(registry.alive_key("decode-dead@testhost"))  # heartbeat expired
    redis_client.lpush(queue_name(model, "generate"), "x")
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "both: 1 (both-1@testhost)" in out
    assert "decode-dead" not in out
    assert re.search(rf"{re.escape(queue_name(model, 'generate'))} +1\n", out)


def test_status_with_redis_down_still_answers_and_exits_1(cli_env, monkeypatch, capsys):
    monkeypatch.setenv("FARM_REDIS__URL", f"redis://127.0.0.1:{free_port()}/0")
    assert main(["status", "--json"]) == 1
    st = json.loads(capsys.readouterr().out)
    assert st["redis"]["ok"] is False and st["redis"]["error"]
    assert st["queues"] == {} and st["models"]


def test_config_error_exits_2_with_message_not_traceback(cli_env):
    bad = dict(cli_env, FARM_API__PORT="not-a-port")
    proc = _run(bad, "status")
    assert proc.returncode == 2
    assert "api.port" in proc.stderr and "Traceback" not in proc.stderr

    missing = dict(cli_env, FARM_CONFIG="/nonexistent/farm.yaml")
    proc = _run(missing, "up", "--detach")
    assert proc.returncode == 2
    assert "config file not found: /nonexistent/farm.yaml" in proc.stderr and "Traceback" not in proc.stderr


def test_up_rejects_worker_layouts_that_cannot_serve(cli_env, capsys):
    assert main(["up", "--prefill-workers", "1", "--decode-workers", "0"]) == 2
    assert "decode" in capsys.readouterr().err
    assert main(["up", "--workers", "0"]) == 2
    assert "no workers" in capsys.readouterr().err
    assert main(["worker", "--role", "decode", "--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_worker_counts_from_flags(cli_env):
    cfg = load_config()
    d = cfg.workers
    assert worker_counts(cfg, None, None, None) == {"prefill": d.prefill, "decode": d.decode, "both": d.both}
    assert worker_counts(cfg, None, None, 3) == {"prefill": 0, "decode": 0, "both": 3}
    assert worker_counts(cfg, 2, None, 1) == {"prefill": 2, "decode": d.decode, "both": 1}
    assert worker_counts(cfg, 1, 0, 2) == {"prefill": 1, "decode": 0, "both": 2}


def test_down_without_a_farm(cli_env, capsys):
    assert main(["down"]) == 0
    assert "no farm is running" in capsys.readouterr().out
