"""Redis gets a password when it is not local, the managed redis-server enforces it (requirepass from a
0600 file, never on the command line), and everything binds to localhost by default."""

from __future__ import annotations

import os
import stat

import psutil
import pytest
import redis

from farm.config import ConfigError, load_config, redact_url
from farm.config.redis import url_password
from farm.infra import redis_server
from farm.supervisor import Farm
from tests.conftest import free_port

PASSWORD = "s3cret p@ss/word"


def test_password_from_environment_goes_into_the_url():
    cfg = load_config(environ={"FARM_REDIS_PASSWORD": PASSWORD})
    assert cfg.redis.url == "redis://:s3cret%20p%40ss%2Fword@127.0.0.1:6379/0"
    assert url_password(cfg.redis.url) == PASSWORD
    # a password already in the URL wins
    cfg = load_config(environ={"FARM_REDIS_PASSWORD": "other", "FARM_REDIS__URL": "redis://:mine@10.0.0.5:6379/1"})
    assert cfg.redis.url == "redis://:mine@10.0.0.5:6379/1"
    assert redact_url(cfg.redis.url) == "redis://:***@10.0.0.5:6379/1"


def test_non_local_redis_without_password_is_refused():
    with pytest.raises(ConfigError, match="FARM_REDIS_PASSWORD"):
        load_config(environ={"FARM_REDIS__URL": "redis://10.0.0.5:6379/0"})
    with pytest.raises(ConfigError):
        load_config(environ={"FARM_REDIS__URL": "rediss://redis.example:6380/0"})
    assert load_config(environ={"FARM_REDIS__URL": "redis://10.0.0.5:6379/0", "FARM_REDIS_PASSWORD": "x"})
    assert load_config(environ={"FARM_REDIS__URL": "redis://10.0.0.5:6379/0",
                                "FARM_REDIS__ALLOW_NO_PASSWORD": "true"})
    assert load_config(environ={"FARM_REDIS__URL": "redis://localhost:6380/0"})  # local: no password needed


def test_managed_redis_requires_the_password(tmp_path):
    port = free_port()
    url = load_config(environ={"FARM_REDIS_PASSWORD": PASSWORD,
                               "FARM_REDIS__URL": f"redis://127.0.0.1:{port}/0"}).redis.url
    proc = redis_server.start_managed(url, tmp_path / "data", tmp_path / "redis.log", appendonly=False)
    try:
        assert redis_server.ping(url)
        assert not redis_server.ping(f"redis://127.0.0.1:{port}/0")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(f"redis://127.0.0.1:{port}/0").set("k", "v")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(f"redis://:wrong@127.0.0.1:{port}/0").ping()
        # never on a command line (ps, farm.json); the file holding it is private
        cmdline = " ".join(psutil.Process(proc.pid).cmdline())
        assert PASSWORD not in cmdline and "s3cret" not in cmdline
        conf = tmp_path / "data" / redis_server.AUTH_CONF
        assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600
        assert "--bind 127.0.0.1" in " ".join(redis_server.command(port, tmp_path, password=PASSWORD))
    finally:
        redis_server.stop(proc)


def test_everything_binds_to_localhost_by_default(tmp_path):
    cfg = load_config(environ={"FARM_STATE_DIR": str(tmp_path)})
    assert cfg.api.host == "127.0.0.1" and cfg.flower.host == "127.0.0.1"
    assert cfg.transfer.bind_host == "127.0.0.1"
    farm = Farm(cfg, prefill=0, decode=0, flower=True, prepare=False)
    assert any(a == "--address=127.0.0.1" for a in farm.flower_command())
    from api.server import settings  # what the API's gunicorn binds (api/gunicorn_conf.py)

    assert settings(cfg)["bind"] == [f"127.0.0.1:{cfg.api.port}"]


def test_flower_beyond_localhost_needs_credentials(tmp_path, monkeypatch):
    monkeypatch.delenv("FARM_FLOWER_AUTH", raising=False)
    cfg = load_config(environ={"FARM_STATE_DIR": str(tmp_path), "FARM_FLOWER__HOST": "0.0.0.0"})
    with pytest.raises(ConfigError, match="FARM_FLOWER_AUTH"):
        Farm(cfg, prefill=0, decode=0, api=False, prepare=False)
    monkeypatch.setenv("FARM_FLOWER_AUTH", "admin:pw")
    farm = Farm(cfg, prefill=0, decode=0, api=False, prepare=False)
    assert farm.flower_env()["FLOWER_BASIC_AUTH"] == "admin:pw"
    assert not {"FLOWER_BASIC_AUTH", "FARM_FLOWER_AUTH"} & set(farm.child_env())  # Flower's alone: an admin login
    assert "admin:pw" not in " ".join(farm.flower_command())


def test_printed_urls_hide_the_redis_password(tmp_path):
    cfg = load_config(environ={"FARM_STATE_DIR": str(tmp_path), "FARM_REDIS_PASSWORD": PASSWORD})
    farm = Farm(cfg, prefill=0, decode=0, flower=False, api=False, prepare=False)
    assert "s3cret" not in str(farm.urls()) and ":***@" in farm.urls()["redis"]
