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

import psutil
import pytest
import redis

from farm.config import ConfigError, load_config
from farm.config.redis import is_local
from farm.infra import redis_server
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
    assert is_local(url)
    assert not is_local("redis://10.1.2.3:6379/0")
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

        out = _farm_cli(env, "status", "--json")
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
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


def test_a_stop_signal_whose_interrupt_was_swallowed_still_ends_the_start_up_wait(tmp_path):
    """serve()'s first stop signal during start-up raises KeyboardInterrupt wherever the main thread is; raised
    inside a finalizer (a redis ConnectionPool.__del__, seen in CI) Python prints it and drops it, and `farm up`
    waited out its whole start-up timeout. The signal it counted ends wait_healthy() all the same."""
    cfg = load_config(environ=_env(tmp_path, free_port()))
    farm = Farm(cfg, prefill=0, decode=0, both=0, api=False, flower=False)
    try:
        farm.start()
        farm._stop_signals = 1  # what _on_stop_signal counted before its raise was lost
        with pytest.raises(KeyboardInterrupt):
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
    """`farm up` in the foreground with a managed Redis and, given a worker script, one fake worker that
    ignores SIGTERM (a warm shutdown that never ends: only a kill stops it)."""
    script = tmp_path / "fg.py"
    script.write_text(textwrap.dedent("""
        import sys
        from farm.config import load_config
        from farm.supervisor import Farm
        worker = sys.argv[1] if len(sys.argv) > 1 else None

        class FakeWorkerFarm(Farm):
            def worker_command(self, role, model, name):
                return [sys.executable, worker, role, model, self.worker_id(name), self.cfg.redis.url, "ignore-term"]

        farm = FakeWorkerFarm(load_config(), prefill=0, decode=0, both=1 if worker else 0, api=False, flower=False,
                              prepare=False, grace_s=600)
        sys.exit(farm.serve(timeout=60))
    """))
    return script


def _start_foreground(tmp_path: Path, env: dict[str, str], *args: str, ignore_sigint: bool = False):
    """The supervisor in a process of its own, once it says it is up: (Popen, stdout so far, farm.json).
    `ignore_sigint`: it inherits an ignored SIGINT, as from a shell that starts it in the background."""
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    fg = subprocess.Popen([sys.executable, str(_foreground_script(tmp_path)), *args], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    head: list[str] = []
    try:
        # stopped only once it says it is up (a Ctrl-C during start-up is another test's business)
        deadline = time.time() + 60
        while not any("farm is up" in line for line in head):
            line = fg.stdout.readline()
            assert line or fg.poll() is None, f"supervisor exited before it was up: {fg.stderr.read()}"
            assert time.time() < deadline, "supervisor did not come up"
            head.append(line)
        state = tmp_path / "state" / "farm.json"
        _wait_for(lambda: state.exists() and redis_server.ping(load_config(environ=env).redis.url), 20)
        assert json.loads(state.read_text())["supervisor"]["pid"] == fg.pid
    except BaseException:
        fg.kill()
        fg.wait()
        raise
    return fg, "".join(head), json.loads(state.read_text())


def _pids(state: dict) -> dict[str, psutil.Process]:
    return {p["name"]: psutil.Process(p["pid"]) for p in state["processes"]}


@pytest.mark.parametrize("how", ["ctrl-c", "ctrl-c-with-sigint-ignored-by-its-parent", "farm-down"])
def test_foreground_supervisor_stops_cleanly(tmp_path, how):
    env = _env(tmp_path, free_port())
    fg, head, _state = _start_foreground(tmp_path, env, ignore_sigint=how.endswith("parent"))
    url = load_config(environ=env).redis.url  # as any later `farm` command sees it: with the generated password
    try:
        if how.startswith("ctrl-c"):
            fg.send_signal(signal.SIGINT)
        else:
            down = _farm_cli(env, "down")
            assert down.returncode == 0 and "redis" in down.stdout
        out, err = fg.communicate(timeout=30)
        out = head + out
    finally:
        if fg.poll() is None:
            fg.kill()
            fg.wait()
    assert fg.returncode == 0, err
    assert "farm is up" in out and "stopping" in err
    assert not redis_server.ping(url)
    assert not (tmp_path / "state" / "farm.json").exists()


def test_a_second_ctrl_c_kills_at_once(tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(_FAKE_WORKER)
    env = _env(tmp_path, free_port())
    fg, _head, state = _start_foreground(tmp_path, env, str(script))
    children = _pids(state)
    try:
        fg.send_signal(signal.SIGINT)
        time.sleep(2)  # the worker ignores its SIGTERM: the supervisor would wait out its 600 s grace
        assert fg.poll() is None and children["both-1"].is_running()
        t0 = time.monotonic()
        fg.send_signal(signal.SIGINT)
        _out, err = fg.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if fg.poll() is None:
            fg.kill()
            fg.wait()
    assert fg.returncode == 0, err
    assert "killing what is left" in err
    assert took < 15
    _wait_for(lambda: not any(p.is_running() for p in children.values()), 5)
    assert b"SIGTERM" in (tmp_path / "state" / "logs" / "redis.log").read_bytes()  # Redis still shut down cleanly
    assert not (tmp_path / "state" / "farm.json").exists()


def test_ctrl_c_during_start_up_stops_what_was_started(tmp_path):
    """A worker that never becomes ready keeps `farm up` in wait_healthy(); Ctrl-C there stops it at once."""
    never_ready = tmp_path / "never_ready.py"
    never_ready.write_text("import time\ntime.sleep(600)\n")
    env = _env(tmp_path, free_port())
    fg = subprocess.Popen([sys.executable, str(_foreground_script(tmp_path)), str(never_ready)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state = tmp_path / "state" / "farm.json"
    try:
        _wait_for(lambda: state.exists() and {"redis", "both-1"} <= {p["name"] for p in
                                                                   json.loads(state.read_text())["processes"]}, 60)
        children = _pids(json.loads(state.read_text()))
        fg.send_signal(signal.SIGINT)
        out, err = fg.communicate(timeout=30)
    finally:
        if fg.poll() is None:
            fg.kill()
            fg.wait()
    assert fg.returncode == 0 and "farm is up" not in out and "stopping" in err, err
    _wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children.values()), 5)
    assert not state.exists()


def test_children_die_with_a_supervisor_killed_by_sigkill(tmp_path):
    """kill -9 of the supervisor runs no cleanup: the parent-death signal takes Redis (SIGTERM: AOF flushed)
    and the worker (SIGKILL) down with it, instead of leaving them to pid 1."""
    script = tmp_path / "fake_worker.py"
    script.write_text(_FAKE_WORKER)
    env = _env(tmp_path, free_port())
    fg, _head, state = _start_foreground(tmp_path, env, str(script))
    children = _pids(state)
    assert set(children) == {"redis", "both-1"}
    fg.kill()
    fg.wait()
    _wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children.values()), 10)
    assert b"SIGTERM" in (tmp_path / "state" / "logs" / "redis.log").read_bytes()
    down = _farm_cli(env, "down")  # the stale farm.json is cleared without touching anything
    assert down.returncode == 0 and "no farm is running" in down.stdout


_LEAKING_TEST = """
import subprocess
def test_leaves_a_process_behind():
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)  # no parent-death signal, never stopped
    open({pidfile!r}, "w").write(str(p.pid))
"""


def test_the_suite_fails_when_a_process_it_started_outlives_it(tmp_path):
    """The session-end check of tests/conftest.py: a run whose test leaves a process behind fails, names it
    and kills it (here in a pytest of its own, loading the suite's conftest as a plugin)."""
    pidfile = tmp_path / "pid"
    test = tmp_path / "test_leak.py"
    test.write_text(_LEAKING_TEST.format(pidfile=str(pidfile)))
    env = {**os.environ, "FARM_TEST_LEFTOVER_GRACE_S": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(test)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    pid = int(pidfile.read_text())
    assert run.returncode == 1, run.stdout + run.stderr  # the test itself passed: the leftover fails the run
    assert "1 passed" in run.stdout and "outlived them" in run.stdout and "sleep 600" in run.stdout
    _wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 5)


def test_flower_on_a_public_address_needs_basic_auth(tmp_path, monkeypatch):
    monkeypatch.delenv("FARM_FLOWER_AUTH", raising=False)
    cfg = load_config(environ=_env(tmp_path, free_port(), FARM_FLOWER__HOST="0.0.0.0"))
    with pytest.raises(ConfigError, match="FARM_FLOWER_AUTH"):
        Farm(cfg)
    Farm(cfg, flower=False)  # fine without Flower

    monkeypatch.setenv("FARM_FLOWER_AUTH", "admin:s3cret")
    farm = Farm(cfg)
    assert farm.flower_env()["FLOWER_BASIC_AUTH"] == "admin:s3cret"
    assert not {"FLOWER_BASIC_AUTH", "FARM_FLOWER_AUTH"} & set(farm.child_env())  # no other child gets it
    assert not any("s3cret" in a for a in farm.flower_command())  # never on a command line / in farm.json
    assert "--address=0.0.0.0" in farm.flower_command()


def test_a_local_flower_gets_a_generated_login(tmp_path, monkeypatch, redis_url):
    """Flower on 127.0.0.1 without FARM_FLOWER_AUTH had no login: every local user read the farm's request ids,
    queues and workers from it. `farm up` now generates one once into the state dir (0600), which Flower gets
    through its environment; its pages refuse a visitor without it."""
    import requests

    from farm.supervisor.flower_login import FLOWER_LOGIN_FILE

    monkeypatch.delenv("FARM_FLOWER_AUTH", raising=False)
    cfg = load_config(environ=_env(tmp_path, redis_url))
    port = free_port()
    with Farm(cfg, prefill=0, decode=0, api=False, prepare=False, flower_port=port).running(90) as farm:
        path = farm.state_dir / FLOWER_LOGIN_FILE
        login = path.read_text().strip()
        user, _, password = login.partition(":")
        assert user and len(password) >= 24 and os.stat(path).st_mode & 0o077 == 0
        assert farm.flower_env()["FLOWER_BASIC_AUTH"] == login and "FLOWER_BASIC_AUTH" not in farm.child_env()
        assert not any(password in a for a in farm.flower_command())
        flower = next(p for p in farm.procs if p.role == "flower")
        assert psutil.Process(flower.pid).environ()["FLOWER_BASIC_AUTH"] == login  # Flower's own environment
        url = f"http://127.0.0.1:{port}/workers"
        assert requests.get(url, timeout=10).status_code == 401
        assert requests.get(url, timeout=10, auth=("admin", "admin")).status_code == 401
        assert requests.get(url, timeout=10, auth=(user, password)).status_code == 200
    assert Farm(cfg, prefill=0, decode=0, api=False).flower_auth == login  # the same login next time


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
    from farm.cluster import registry
    role, model, wid, url = sys.argv[1:5]
    if sys.argv[5:] == ["ignore-term"]:  # a warm shutdown that never ends
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    if sys.argv[5:] != ["ignore-term"]:
        signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(0.1)
""")


def test_wait_healthy_waits_for_each_worker_in_its_role(tmp_path, redis_url, redis_client):
    from farm.cluster import registry

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
        out = _farm_cli(env, "status", "--json")
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        roles = st["workers"][cfg.default_model]
        assert [w["worker_id"] for w in roles["decode"]] == ["decode-1@hostB", "decode-2@hostB"]
        assert [w["worker_id"] for w in roles["prefill"]] == ["prefill-1@hostB"]
        assert {p["name"] for p in st["processes"] if p["alive"]} == set(by_role)
    finally:
        farm.stop()
    assert registry.live_workers(redis_client) == []  # warm shutdown deregistered them
    assert not (cfg.state_path / "farm.json").exists()


def _ha_env(tmp_path: Path) -> dict[str, str]:
    """A farm whose managed Redis is a Sentinel set: primary, replica and three sentinels on free ports."""
    return _env(tmp_path, free_port(), FARM_REDIS__HA__ENABLED="true", FARM_REDIS__HA__REPLICA_PORT=str(free_port()),
                FARM_REDIS__HA__SENTINELS=",".join(f"127.0.0.1:{free_port()}" for _ in range(3)),
                FARM_REDIS__HA__DOWN_AFTER_MS="1000")


def _role(url: str) -> str:
    try:
        return redis.Redis.from_url(url, socket_timeout=2).execute_command("ROLE")[0].decode()
    except redis.ConnectionError:
        return "down"


def _writes(client: redis.Redis, key: str, value: str) -> bool:
    try:
        return bool(client.set(key, value))
    except redis.ConnectionError:
        return False


def test_redis_ha_farm_runs_a_sentinel_set_that_fails_over_and_rejoins(tmp_path):
    from farm.infra.broker import make_celery
    from farm.infra.redis_client import connect, primary_address

    env = {**_ha_env(tmp_path), "FARM_REDIS__HA__MIN_REPLICAS_MAX_LAG_S": "5"}  # split-brain protection on
    cfg = load_config(environ=env)
    farm = Farm(cfg, prefill=0, decode=0, both=0, api=False, flower=False)
    try:
        farm.start()
        assert farm.wait_healthy(20)["ready"]
        rcfg = farm.cfg.redis  # with the generated password
        procs = {p.name: p for p in farm.procs}
        assert set(procs) == {"redis", "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"}
        for node in ("redis", "redis-replica"):  # split-brain protection (redis.ha.min_replicas_max_lag_s)
            cmd = " ".join(procs[node].command)
            assert f"--min-replicas-to-write 1 --min-replicas-max-lag {rcfg.ha.min_replicas_max_lag_s}" in cmd
        url_port, replica_port = redis_server.parse_url(rcfg.url)[1], rcfg.ha.replica_port
        primary_url, replica_url = (redis_server.node_url(rcfg.url, p) for p in (url_port, replica_port))
        assert _role(primary_url) == "master" and _role(replica_url) == "slave"
        with pytest.raises(redis.AuthenticationError):  # the sentinels want the password too
            redis.Redis(port=rcfg.ha.sentinel_addresses()[0][1]).execute_command("SENTINEL", "masters")

        client = connect(rcfg)  # through the sentinels: the one client survives the failover below
        client.set("farm:ha", "kept")
        client.execute_command("WAIT", 1, 2000)
        app = make_celery(farm.cfg)  # kombu through the sentinels (sentinel:// URLs, master_name)
        app.send_task("farm.test.noop", queue="farm.hatest")
        assert redis.Redis.from_url(primary_url).llen("farm.hatest") == 1

        procs["redis"].popen.kill()  # kill -9 the primary
        t0 = time.monotonic()
        _wait_for(lambda: (primary_address(rcfg) or (None, 0))[1] == replica_port, 30)
        promoted_s = time.monotonic() - t0
        assert client.get("farm:ha") == b"kept"  # same client, new primary
        assert promoted_s < 20
        # alone, the promoted primary refuses writes (redis.ha.min_replicas_max_lag_s) until a replica is back;
        # the client sees a connection error (farm.infra.redis_client.no_replicas_error) and would retry
        with pytest.raises(redis.ConnectionError, match="good replicas"):
            client.set("farm:ha2", "new")
        assert farm.supervise_once() is None  # a dead node of a Sentinel set is no reason to stop the farm
        _wait_for(lambda: procs["redis"].alive() and _role(primary_url) == "slave", 20)  # rejoined as replica
        _wait_for(lambda: _writes(client, "farm:ha2", "new"), 10)  # and the primary takes writes again
        _wait_for(lambda: redis.Redis.from_url(primary_url).get("farm:ha2") == b"new", 20)
    finally:
        farm.stop()
    assert not any(p.alive() for p in farm.procs)

    again = Farm(load_config(environ=env), prefill=0, decode=0, both=0, api=False, flower=False)
    try:  # the next start keeps the promoted node as the primary: its writes are never resynced away
        again.start()
        assert again.wait_healthy(20)["ready"]
        assert _role(replica_url) == "master" and _role(primary_url) == "slave"
        assert connect(again.cfg.redis).get("farm:ha2") == b"new"
    finally:
        again.stop()
