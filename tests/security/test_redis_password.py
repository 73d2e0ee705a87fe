"""Item 2 (the open Redis): the managed Redis had no password (`redis-cli -p 6379 ping` -> PONG), so any
local process could queue work for the workers and read every completion from `farm:out:*`.

`farm up` now gives a Redis it starts a password generated once into `<state_dir>/redis.password` (0600);
every process it starts gets it through config.resolved.yaml, every later `farm` command through the file;
FARM_REDIS_PASSWORD wins, a URL's own password is left alone, and a Redis of this user's that already answers
without one (not ours) is used as it is; another user's on the farm's port is refused."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator

import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from farm.config import load_config
from farm.config.redis import PASSWORD_FILE, url_password
from farm.infra import redis_server
from farm.supervisor import Farm
from tests.conftest import free_port


@pytest.fixture(scope="module")
def farm(tmp_path_factory) -> Iterator[tuple[Farm, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("redis-password")
    env = {"FARM_STATE_DIR": str(tmp / "state"), "FARM_REDIS__URL": f"redis://127.0.0.1:{free_port()}/0",
           "FARM_REDIS__APPENDONLY": "false"}
    cfg = load_config(environ=env)
    assert url_password(cfg.redis.url) is None  # nothing configured: before, an open Redis
    with Farm(cfg, prefill=0, decode=0, api=False, flower=False, prepare=False, batch_drivers=1,
              env={"FARM_REDIS_PASSWORD": ""}).running(30) as f:
        yield f, env


def test_the_managed_redis_refuses_clients_without_the_password(farm):
    f, _ = farm
    assert f.redis_managed
    password = url_password(f.cfg.redis.url)
    path = f.state_dir / PASSWORD_FILE
    assert password and len(password) >= 32 and path.read_text().strip() == password
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    owner = redis.Redis.from_url(f.cfg.redis.url)
    owner.xadd("farm:out:chatcmpl-victim", {"e": '{"type": "delta", "text": "a secret answer"}'})
    host, port, _ = redis_server.parse_url(f.cfg.redis.url)
    once = Retry(NoBackoff(), 0)  # redis-py retries an AuthenticationError (a ConnectionError) otherwise
    stranger = redis.Redis(host=host, port=port, retry=once)
    for attempt in (lambda: stranger.xread({"farm:out:chatcmpl-victim": 0}), lambda: stranger.keys("farm:out:*"),
                    lambda: stranger.lpush("farm.SmolLM2-135M-Instruct.generate", "{}"), stranger.ping):
        with pytest.raises(redis.AuthenticationError):
            attempt()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=host, port=port, password="guess", retry=once).ping()
    [proc] = [p for p in f.procs if p.role == "redis"]
    assert password not in " ".join(psutil.Process(proc.pid).cmdline())  # never on a command line


def test_every_process_of_the_farm_gets_it(farm):
    f, env = farm
    password = url_password(f.cfg.redis.url)
    # children (workers, API, Flower, batch drivers, planner-started workers) load the resolved config
    resolved = load_config(f.child_env()["FARM_CONFIG"], environ={})
    assert url_password(resolved.redis.url) == password
    # a batch driver started by the supervisor is connected and consuming: it authenticated
    [batch] = [p for p in f.procs if p.role == "batch"]
    deadline = time.monotonic() + 60
    while "ready" not in (log := open(batch.log, errors="replace").read()) and time.monotonic() < deadline:
        assert batch.alive(), log[-2000:]
        time.sleep(0.2)
    assert "ready" in log and "NOAUTH" not in log and "Authentication" not in log, log[-2000:]
    # `farm status`, `farm down`, `farm batch` ... from another shell read the same state dir
    assert url_password(load_config(environ=env).redis.url) == password
    assert redis.Redis.from_url(load_config(environ=env).redis.url).ping()


def test_an_explicit_password_wins_and_a_urls_own_is_kept(farm):
    f, env = farm
    port = redis_server.parse_url(f.cfg.redis.url)[1]
    assert url_password(load_config(environ={**env, "FARM_REDIS_PASSWORD": "mine"}).redis.url) == "mine"
    url = f"redis://:given@127.0.0.1:{port}/0"
    assert load_config(environ={**env, "FARM_REDIS__URL": url}).redis.url == url
    # not managed: the URL is used as written
    unmanaged = load_config(environ={**env, "FARM_REDIS__MANAGED": "false"})
    assert url_password(unmanaged.redis.url) is None


def test_a_redis_that_already_answers_is_left_as_it_is(redis_url, tmp_path):
    cfg = load_config(environ={"FARM_STATE_DIR": str(tmp_path), "FARM_REDIS__URL": redis_url})
    f = Farm(cfg, prefill=0, decode=0, api=False, flower=False, prepare=False)
    try:
        f.start()
        assert not f.redis_managed and f.cfg.redis.url == redis_url
        assert not (tmp_path / PASSWORD_FILE).exists()
    finally:
        f.stop()


def test_another_users_redis_on_the_farms_port_is_refused(tmp_path, monkeypatch):
    """A local user who starts a password-less Redis on the farm's port first (after a reboot, say) got every prompt
    and answer: `farm up` used any Redis that answered. A managed farm now refuses one another user runs, naming
    the way out; `redis.managed: false` still uses it on purpose."""
    import subprocess

    from farm.supervisor.procs import FarmError

    port = free_port()
    cmd = [redis_server.executable(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", "/tmp"]
    if os.geteuid() == 0:  # a real other user: nobody
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    else:  # not root: the farm plays another user than the one running this Redis
        monkeypatch.setattr("farm.supervisor.redis_nodes.os.geteuid", lambda: os.getuid() + 1)
    squatter = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        redis_server.wait_ready(url, squatter)
        env = {"FARM_STATE_DIR": str(tmp_path), "FARM_REDIS__URL": url, "FARM_REDIS__APPENDONLY": "false"}
        f = Farm(load_config(environ=env), prefill=0, decode=0, api=False, flower=False, prepare=False)
        try:
            with pytest.raises(FarmError, match=f"port {port} is run by another user"):
                f.start()
        finally:
            f.stop()
        assert not redis.Redis.from_url(url).keys("farm:*")  # nothing of the farm went there
        f = Farm(load_config(environ={**env, "FARM_REDIS__MANAGED": "false"}), prefill=0, decode=0, api=False,
                 flower=False, prepare=False)
        try:
            f.start()  # said on purpose: used as it is
            assert not f.redis_managed and f.cfg.redis.url == url
        finally:
            f.stop()
    finally:
        squatter.kill()
        squatter.wait()
