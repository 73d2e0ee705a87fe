"""How every farm process reaches Redis: `redis.url`, or with `redis.ha` through the sentinels (the HA set
itself is exercised with real processes in tests/test_supervisor.py and tests/chaos/test_redis_failover.py)."""

from __future__ import annotations

import pytest

from farm.config import ConfigError, load_config
from farm.infra.redis_client import celery_broker, primary_address


def test_without_ha_celery_uses_the_url_as_it_is(tmp_path):
    cfg = load_config(environ={"FARM_STATE_DIR": str(tmp_path), "FARM_REDIS__URL": "redis://:pw@127.0.0.1:7000/3"})
    assert celery_broker(cfg.redis) == ("redis://:pw@127.0.0.1:7000/3", {})


def test_with_ha_celery_gets_one_sentinel_url_per_sentinel_with_password_and_db(tmp_path):
    cfg = load_config(environ={
        "FARM_STATE_DIR": str(tmp_path), "FARM_REDIS__URL": "redis://:p%40ss@127.0.0.1:7000/3",
        "FARM_REDIS__HA__ENABLED": "true", "FARM_REDIS__HA__MASTER_NAME": "prod",
        "FARM_REDIS__HA__SENTINELS": "10.0.0.1:26379, 10.0.0.2:26380",
    })
    assert cfg.redis.ha.sentinel_addresses() == [("10.0.0.1", 26379), ("10.0.0.2", 26380)]
    url, options = celery_broker(cfg.redis)
    assert url == "sentinel://:p%40ss@10.0.0.1:26379/3;sentinel://:p%40ss@10.0.0.2:26380/3"
    assert options == {"master_name": "prod", "sentinel_kwargs": {"password": "p@ss"}}  # sentinels want it too


@pytest.mark.parametrize(("key", "value"), [("SENTINELS", "10.0.0.1"), ("QUORUM", "4"), ("MASTER_NAME", "a b"),
                                            ("MIN_REPLICAS_MAX_LAG_S", "-1")])
def test_bad_ha_settings_are_configuration_errors(tmp_path, key, value):
    with pytest.raises(ConfigError):
        load_config(environ={"FARM_STATE_DIR": str(tmp_path), "FARM_REDIS__HA__ENABLED": "true",
                             f"FARM_REDIS__HA__{key}": value})


def test_no_sentinel_answering_means_no_primary(tmp_path):
    from tests.conftest import free_port

    cfg = load_config(environ={"FARM_STATE_DIR": str(tmp_path), "FARM_REDIS__HA__ENABLED": "true",
                               "FARM_REDIS__HA__SENTINELS": f"127.0.0.1:{free_port()}", "FARM_REDIS__HA__QUORUM": "1"})
    assert primary_address(cfg.redis, timeout=0.5) is None


def test_every_connection_gets_timeouts_and_keepalive_from_the_config(tmp_path):
    """A partition must end in an error and a reconnect, never a call that waits forever: redis-py clients and
    Celery's broker get redis.socket's timeouts and TCP keepalive; an explicit timeout still wins."""
    import socket

    from farm.infra.broker import celery_settings
    from farm.infra.redis_client import connect

    cfg = load_config(environ={"FARM_STATE_DIR": str(tmp_path), "FARM_REDIS__URL": "redis://:pw@127.0.0.1:7000/3",
                               "FARM_REDIS__SOCKET__TIMEOUT_S": "7", "FARM_REDIS__SOCKET__KEEPALIVE_IDLE_S": "9"})
    kw = connect(cfg.redis).connection_pool.connection_kwargs
    assert (kw["socket_timeout"], kw["socket_connect_timeout"], kw["socket_keepalive"]) == (7.0, 5.0, True)
    assert kw["socket_keepalive_options"][socket.TCP_KEEPIDLE] == 9 and kw["health_check_interval"] == 10
    assert connect(cfg.redis, timeout=2.0).connection_pool.connection_kwargs["socket_timeout"] == 2.0
    assert connect("redis://127.0.0.1:7000/0").connection_pool.connection_kwargs["socket_keepalive"] is True
    options = celery_settings(cfg)["broker_transport_options"]
    assert options["socket_timeout"] == 7.0 and options["socket_keepalive"] is True
    assert options["health_check_interval"] == 10  # kombu also drops a consumer's overdue BRPOP connection
    with pytest.raises(ConfigError):  # below the 1 s blocking reads of the reply reader and the router
        load_config(environ={"FARM_STATE_DIR": str(tmp_path), "FARM_REDIS__SOCKET__TIMEOUT_S": "1"})


def test_a_primary_without_a_replica_refuses_writes_and_clients_see_a_connection_error(tmp_path):
    """redis.ha.min_replicas_max_lag_s: a data node of a Sentinel set runs with min-replicas-to-write 1, so alone
    (cut off from its replicas) it refuses writes. Through `connect()` the refusal (NOREPLICAS) is a connection
    error, which is also a ResponseError: the connection is dropped (the next one asks the sentinels where the
    primary is), the farm's retry paths wait it out, kombu reconnects; reads are still served."""
    import subprocess

    import redis

    from farm.infra import redis_server
    from farm.infra.redis_client import connect, no_replicas_error
    from tests.conftest import free_port

    port = free_port()
    cmd = redis_server.command(port, tmp_path, appendonly=False, password="pw", min_replicas_max_lag_s=3)
    assert " --min-replicas-to-write 1 --min-replicas-max-lag 3 " in f" {' '.join(cmd)} "
    assert "--min-replicas-to-write" not in redis_server.command(port, tmp_path, password="pw")  # 0: off
    with pytest.raises(redis_server.RedisServerError):
        redis_server.command(port, tmp_path, min_replicas_max_lag_s=-1)
    url = f"redis://:pw@127.0.0.1:{port}/0"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        redis_server.wait_ready(url, proc)
        r = connect(url)
        with pytest.raises(redis.ConnectionError, match="good replicas") as e:
            r.set("k", "v")
        assert isinstance(e.value, no_replicas_error()) and isinstance(e.value, redis.ResponseError)
        with pytest.raises(redis.ConnectionError):
            r.pipeline(transaction=False).xadd("s", {"e": "1"}).expire("s", 60).execute()
        assert r.get("k") is None
    finally:
        proc.terminate()
        proc.wait(10)
