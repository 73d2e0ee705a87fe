"""The supervisor with real processes: a managed redis-server, stop order, fail-fast, Ctrl-C, `farm down`.

No model workers are started here (the end-to-end test does that); every test runs in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from farm import redis_server
from farm.config import ConfigError, load_config
from farm.supervisor import Farm, FarmStartError, Proc, read_state, stop_ordered
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp_path: Path, redis: int | str, **extra: str) -> dict[str, str]:
    """A farm's environment: a state dir under tmp_path and Redis (a URL, or a local port's database 0)."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith("FARM_") and k != "FARM_SECRET")}
    env.update({
        "FARM_STATE_DIR": str(tmp_path / "state"),
        "FARM_REDIS__URL": redis if isinstance(redis, str) else f"redis://127.0.0.1:{redis}/0",
        "FARM_SECRET": "test-secret-not-for-production",
        **extra,
    })
    return env


def _farm_cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "farm.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _wait_for(pred, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_redis_server_helpers_start_ping_stop_with_aof(tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    assert redis_server.is_local(url)
    assert not redis_server.is_local("redis://10.1.2.3:6379/0")
    assert redis_server.parse_url("redis://h:7000/3") == ("h", 7000, 3)
    assert not redis_server.ping(url)
    data = tmp_path / "redis"
    proc = redis_server.start_managed(url, data, tmp_path / "redis.log", appendonly=True)
    try:
        assert redis_server.ping(url)
        redis.Redis.from_url(url).set("farm:test", "kept")
        _wait_for(lambda: redis_server.aof_files(data))
    finally:
        assert redis_server.stop(proc) == 0
    assert not redis_server.ping(url)
    assert b"farm:test" in b"".join(p.read_bytes() for p in redis_server.aof_files(data))


def test_managed_redis_recorded_and_farm_down_stops_it(tmp_path):
    port = free_port()
    env = _env(tmp_path, port)
    cfg = load_config(environ=env)
    farm = Farm(cfg, prefill=0, decode=0, both=0, api=False, flower=False)
    try:
        farm.start()
        assert farm.redis_managed
        assert farm.wait_healthy(10)["ready"]
        url = farm.cfg.redis.url  # with the password generated for the managed Redis
        redis.Redis.from_url(url).set("farm:k", "v")
        _wait_for(lambda: redis_server.aof_files(cfg.state_path / "redis"))

        state = read_state(cfg)
        assert state and [p["name"] for p in state["processes"]] == ["redis"]
        rec = state["processes"][0]
        assert rec["role"] == "redis" and rec["pid"] == farm.procs[0].pid
        assert "--appendonly" in rec["command"] and str(cfg.state_path / "redis") in rec["command"]
        assert rec["log"] == str(cfg.state_path / "logs" / "redis.log")

        st = json.loads(_farm_cli(env, "status", "--json").stdout)
        assert st["processes"][0]["name"] == "redis" and st["processes"][0]["alive"] is True

        down = _farm_cli(env, "down")
        assert down.returncode == 0, down.stderr
        assert "redis" in down.stdout
        assert not redis_server.ping(url)
        assert not (cfg.state_path / "farm.json").exists()
        assert _farm_cli(env, "down").stdout.startswith("no farm is running")
    finally:
        farm.stop()


def test_uses_a_redis_that_already_answers_and_never_stops_it(tmp_path, redis_url):
    cfg = load_config(environ=_env(tmp_path, redis_url))
    farm = Farm(cfg, prefill=0, decode=0, both=0, api=False, flower=False)
    farm.start()
    assert not farm.redis_managed and farm.procs == []
    farm.stop()
    assert redis_server.ping(redis_url)


def test_child_dying_during_start_fails_fast_with_its_log_tail(tmp_path, capsys):
    cfg = load_config(environ=_env(tmp_path, free_port()))
    farm = Farm(cfg, prefill=0, decode=0, both=0, port=free_port(), flower=False,
                api_app="no_such_module_for_farm_test:create_app()")
    t0 = time.monotonic()
    assert farm.serve(timeout=60) == 1
    assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert "api exited with status" in err
    assert "no_such_module_for_farm_test" in err  # the tail of gunicorn's log
    assert all(not p["alive"] for p in farm.processes())
    assert not redis_server.ping(cfg.redis.url)
    assert not (cfg.state_path / "farm.json").exists()


def test_wait_healthy_raises_when_a_child_exits(tmp_path):
    cfg = load_config(environ=_env(tmp_path, free_port()))
    farm = Farm(cfg, prefill=0, decode=0, both=0, api=False, flower=False)
    try:
        farm.start()
        farm.procs[0].popen.kill()
        with pytest.raises(FarmStartError, match="redis exited"):
            farm.wait_healthy(10)
    finally:
        farm.stop()


_TRAP = textwrap.dedent("""
    import signal, sys, time
    name, out, delay, ignore = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
    def on_term(*_):
        if ignore:
            return
        time.sleep(delay)
        with open(out, "a") as f:
            f.write(name + "\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
""")


def test_stop_order_workers_first_redis_last_and_sigkill_after_grace(tmp_path):
    script = tmp_path / "trap.py"
    script.write_text(_TRAP)
    out = tmp_path / "order.txt"
    procs = []
    # (name, role, seconds it takes to finish on SIGTERM, ignores SIGTERM)
    for name, role, delay, ignore in [("redis", "redis", 0, False), ("api", "api", 0, False),
                                      ("flower", "flower", 0, False), ("decode-1", "decode", 0.5, False),
                                      ("prefill-1", "prefill", 0, False), ("stuck-1", "both", 0, True)]:
        cmd = [sys.executable, str(script), name, str(out), str(delay), "1" if ignore else "0"]
        popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
        assert popen.stdout.readline().strip() == b"ready"
        procs.append(Proc(name, role, cmd, str(tmp_path / f"{name}.log"), pid=popen.pid, popen=popen))
    t0 = time.monotonic()
    stop_ordered(procs, grace_s=1.5)
    assert 1.4 < time.monotonic() - t0 < 10
    order = out.read_text().split()
    assert set(order[:2]) == {"decode-1", "prefill-1"}  # workers (in parallel) before everything else
    assert order[2:] == ["api", "flower", "redis"]
    stuck = procs[-1].popen
    assert stuck.returncode == -signal.SIGKILL  # ignored SIGTERM: killed after the grace period
    assert all(p.popen.poll() is not None for p in procs)


def _foreground_script(tmp_path: Path) -> Path:
    script = tmp_path / "fg.py"
    script.write_text(textwrap.dedent("""
        import sys
        from farm.config import load_config
        from farm.supervisor import Farm
        sys.exit(Farm(load_config(), prefill=0, decode=0, both=0, api=False, flower=False).serve(timeout=20))
    """))
    return script


@pytest.mark.parametrize("how", ["ctrl-c", "farm-down"])
def test_foreground_supervisor_stops_cleanly(tmp_path, how):
    port = free_port()
    env = _env(tmp_path, port)
    fg = subprocess.Popen([sys.executable, str(_foreground_script(tmp_path))], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state = tmp_path / "state" / "farm.json"

    def url() -> str:  # as any later `farm` command sees it: with the managed Redis's generated password
        return load_config(environ=env).redis.url

    head = []
    try:
        # stop it only once it says it is up (a Ctrl-C during start-up is another test's business)
        deadline = time.time() + 60
        while not any("farm is up" in line for line in head):
            line = fg.stdout.readline()
            assert line or fg.poll() is None, "supervisor exited before it was up"
            assert time.time() < deadline, "supervisor did not come up"
            head.append(line)
        _wait_for(lambda: state.exists() and redis_server.ping(url()), 20)
        assert json.loads(state.read_text())["supervisor"]["pid"] == fg.pid
        if how == "ctrl-c":
            fg.send_signal(signal.SIGINT)
        else:
            down = _farm_cli(env, "down")
            assert down.returncode == 0 and "redis" in down.stdout
        out, err = fg.communicate(timeout=30)
        out = "".join(head) + out
    finally:
        if fg.poll() is None:
            fg.kill()
    assert fg.returncode == 0, err
    assert "farm is up" in out and "stopping" in err
    assert not redis_server.ping(url())
    assert not state.exists()


def test_flower_on_a_public_address_needs_basic_auth(tmp_path, monkeypatch):
    monkeypatch.delenv("FARM_FLOWER_AUTH", raising=False)
    cfg = load_config(environ=_env(tmp_path, free_port(), FARM_FLOWER__HOST="0.0.0.0"))
    with pytest.raises(ConfigError, match="FARM_FLOWER_AUTH"):
        Farm(cfg)
    Farm(cfg, flower=False)  # fine without Flower

    monkeypatch.setenv("FARM_FLOWER_AUTH", "admin:s3cret")
    farm = Farm(cfg)
    assert farm.child_env()["FLOWER_BASIC_AUTH"] == "admin:s3cret"
    assert not any("s3cret" in a for a in farm.flower_command())  # never on a command line / in farm.json
    assert "--address=0.0.0.0" in farm.flower_command()


def test_worker_names_commands_and_child_config(tmp_path):
    env = _env(tmp_path, free_port(), FARM_API__WORKER_CONNECTIONS="7")
    cfg = load_config(environ=env)
    farm = Farm(cfg, prefill=2, decode=1, both=1, port=18123, flower=False, hostname="hostA")
    assert farm.expected_workers == [
        ("prefill-1", "prefill", cfg.default_model), ("prefill-2", "prefill", cfg.default_model),
        ("decode-1", "decode", cfg.default_model), ("both-1", "both", cfg.default_model),
    ]
    assert farm.worker_command("decode", cfg.default_model, "decode-1")[1:] == [
        "-m", "tasks.worker", "--role", "decode", "--model", cfg.default_model, "--name", "decode-1@hostA"]
    assert farm.api_command()[1:] == ["-m", "gunicorn", "-c", "python:api.gunicorn_conf", "api.app:create_app()"]
    assert farm.urls()["api"] == "http://127.0.0.1:18123/v1" and farm.urls()["flower"] is None

    # Children load exactly this configuration, whatever FARM_* the parent had.
    cfg.state_path.mkdir(parents=True)
    path = farm._write_resolved_config()
    child = load_config(environ={"FARM_CONFIG": str(path)})
    assert child.api.port == 18123 and child.api.worker_connections == 7
    from api.server import settings  # what the API's gunicorn (the child) runs with

    server = settings(child)
    assert (server["worker_class"], server["workers"], server["bind"], server["worker_connections"],
            server["keepalive"], server["timeout"], server["graceful_timeout"]) == (
        "gevent", 1, ["127.0.0.1:18123"], 7, child.api.header_timeout_s, 0, 30)
    with pytest.raises(ConfigError, match="api.threads was removed.*api.worker_connections"):
        load_config(environ={**env, "FARM_API__THREADS": "64"})
    assert child.redis.url == cfg.redis.url and child.state_path == cfg.state_path
    with pytest.raises(ConfigError, match="unknown model"):
        Farm(cfg, models=["no-such-model"])


_FAKE_WORKER = textwrap.dedent("""
    # Stands in for `python -m tasks.worker`: registers after a short "model load", heartbeats,
    # deregisters on SIGTERM (warm shutdown).
    import signal, sys, time
    import redis
    from farm import registry
    role, model, wid, url = sys.argv[1:5]
    r = redis.Redis.from_url(url)
    time.sleep(0.3)
    info = registry.WorkerInfo(worker_id=wid, role=role, model=model, hostname="h", pid=__import__("os").getpid(),
                               block_size=16)
    registry.register(r, info)
    hb = registry.Heartbeat(r, info)
    hb.start()
    def stop(*_):
        hb.stop()
        registry.deregister(r, wid)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(0.1)
""")


def test_wait_healthy_waits_for_each_worker_in_its_role(tmp_path, redis_url, redis_client):
    from farm import registry

    script = tmp_path / "fake_worker.py"
    script.write_text(_FAKE_WORKER)

    class FakeWorkersFarm(Farm):
        def worker_command(self, role, model, name):
            return [sys.executable, str(script), role, model, self.worker_id(name), self.cfg.redis.url]

    cfg = load_config(environ=_env(tmp_path, redis_url))
    farm = FakeWorkersFarm(cfg, prefill=1, decode=2, both=0, api=False, flower=False, hostname="hostB",
                           prepare=False)
    # A record left by an earlier run under the same name must not count as this farm's worker.
    registry.register(redis_client, registry.WorkerInfo(worker_id="decode-1@hostB", role="decode",
                                                        model=cfg.default_model, hostname="hostB",
                                                        pid=1, block_size=16, started_at=1.0))
    try:
        farm.start()
        assert farm.health()["workers"]["decode-1"] is False
        h = farm.wait_healthy(20)
        assert h["workers"] == {"prefill-1": True, "decode-1": True, "decode-2": True}
        by_role = {p["name"]: p["role"] for p in farm.processes() if p["alive"]}
        assert by_role == {"prefill-1": "prefill", "decode-1": "decode", "decode-2": "decode"}

        env = _env(tmp_path, redis_url)
        st = json.loads(_farm_cli(env, "status", "--json").stdout)
        roles = st["workers"][cfg.default_model]
        assert [w["worker_id"] for w in roles["decode"]] == ["decode-1@hostB", "decode-2@hostB"]
        assert [w["worker_id"] for w in roles["prefill"]] == ["prefill-1@hostB"]
        assert {p["name"] for p in st["processes"] if p["alive"]} == set(by_role)
    finally:
        farm.stop()
    assert registry.live_workers(redis_client) == []  # warm shutdown deregistered them
    assert not (cfg.state_path / "farm.json").exists()
