"""The one way a farm process connects to Redis: `connect()` for redis-py clients, `celery_broker()` for
Celery/kombu.

Without `redis.ha`, both use `redis.url`. With it, both go through Redis Sentinel: the client asks the
sentinels where the primary of `redis.ha.master_name` is, connects there, and asks again whenever a
connection breaks or the server it reached turned into a replica (a failover), so every process follows
the primary without a restart. `redis.url` still gives the password, user and database; the sentinels
require the same password (the managed ones are started so, farm.infra.redis_server).

A primary that refuses writes for want of a replica (`NOREPLICAS`: redis.ha.min_replicas_max_lag_s, e.g. the old
primary on the minority side of a partition, or still unaware of the failover just after healing, its pooled
connections still open) is, to a client, a primary it should not be using: `connect()` and `celery_broker()` make
redis-py raise it as a connection error (`no_replicas_error()`, a ResponseError too), so the connection is dropped
and the next one asks the sentinels again, the farm's retry paths (stream flushes, heartbeats, kombu's reconnect)
treat it as Redis being briefly unreachable, and a Celery worker does not die of an "unrecoverable" reply.

redis is imported inside the functions: loading the configuration must not import it in gunicorn's
unpatched master process (the API's gevent worker imports it after patching, api/gunicorn_conf.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlsplit

if TYPE_CHECKING:
    import redis
    from redis.sentinel import Sentinel

    from farm.config import RedisConfig


def connect(target: RedisConfig | str, *, timeout: float | None = None, **options: Any) -> redis.Redis:
    """A client of the farm's Redis (`RedisConfig`: through the sentinels when `ha.enabled`), or of the one
    server a URL names. `timeout` bounds connecting and each command (else `redis.socket`); `options` go to
    redis-py. Every client gets socket timeouts and TCP keepalive (`socket_options`), so a partition from Redis
    ends in an error and a reconnect instead of a call that never returns."""
    import redis

    no_replicas_error()
    if timeout is not None:
        options.setdefault("socket_timeout", timeout)
        options.setdefault("socket_connect_timeout", timeout)
    for key, value in socket_options(target if not isinstance(target, str) else None).items():
        options.setdefault(key, value)
    if isinstance(target, str):
        return redis.Redis.from_url(target, **options)
    if not target.ha.enabled:
        return redis.Redis.from_url(target.url, **options)
    return sentinel(target, timeout).master_for(target.ha.master_name, **{**_url_options(target.url), **options})


@functools.cache
def no_replicas_error() -> type[Exception]:
    """The class redis-py raises for a NOREPLICAS reply in this process from the first call on: a ConnectionError
    (dropped connection, retried, a new primary asked of the sentinels; kombu reconnects) that is also a
    ResponseError (code telling error replies apart by class still sees one). In a pipeline it ends the
    pipeline's execute() as a connection error, like a broken connection would."""
    import redis
    from redis._parsers.base import BaseParser

    class NoReplicasError(redis.ResponseError, redis.ConnectionError):
        """NOREPLICAS: this primary refuses writes, no replica having acknowledged within its
        min-replicas-max-lag (cut off from its replicas, or no longer the primary)."""

    BaseParser.EXCEPTION_CLASSES["NOREPLICAS"] = NoReplicasError  # in place: every parser reads this dict
    return NoReplicasError


def socket_options(cfg: RedisConfig | None = None) -> dict[str, Any]:
    """redis-py's socket settings from `cfg.socket` (the defaults without `cfg`): connect and command timeouts,
    TCP keepalive probing idle connections, and a PING before using a connection idle for a while. Celery's
    broker takes the same as transport options (farm.infra.broker): kombu hands them to its redis-py pools,
    and its health_check_interval also drops a consumer's BRPOP connection whose answer is overdue."""
    import socket

    from farm.config import RedisConfig

    s = (cfg or RedisConfig()).socket
    wanted = {"TCP_KEEPIDLE": s.keepalive_idle_s, "TCP_KEEPINTVL": s.keepalive_interval_s,
              "TCP_KEEPCNT": s.keepalive_count}
    keepalive = {getattr(socket, k): v for k, v in wanted.items() if hasattr(socket, k)}  # Linux has all three
    return {"socket_connect_timeout": s.connect_timeout_s, "socket_timeout": s.timeout_s, "socket_keepalive": True,
            "socket_keepalive_options": keepalive, "health_check_interval": s.health_check_interval_s}


def sentinel(cfg: RedisConfig, timeout: float | None = None) -> Sentinel:
    """A redis-py Sentinel for `cfg.ha` (authenticating with the URL's password)."""
    from redis.sentinel import Sentinel

    kwargs: dict[str, Any] = {"socket_timeout": timeout or 2.0, "socket_connect_timeout": timeout or 2.0}
    password = _password(cfg.url)
    if password:
        kwargs["password"] = password
    return Sentinel(cfg.ha.sentinel_addresses(), sentinel_kwargs=kwargs)


def primary_address(cfg: RedisConfig, timeout: float = 2.0) -> tuple[str, int] | None:
    """Where the sentinels say the primary is now; None when no sentinel answers (or knows none)."""
    import redis
    from redis.sentinel import MasterNotFoundError

    try:
        host, port = sentinel(cfg, timeout).discover_master(cfg.ha.master_name)
    except (MasterNotFoundError, redis.RedisError, OSError):
        return None
    return str(host), int(port)


def celery_broker(cfg: RedisConfig) -> tuple[str, dict[str, Any]]:
    """Celery's broker URL and the transport options it needs besides the farm's own: kombu's
    `sentinel://` URLs (one per sentinel, `;`-separated) and `master_name` with HA, else `redis.url`."""
    if not cfg.ha.enabled:
        return cfg.url, {}
    no_replicas_error()
    u = urlsplit(cfg.url)
    userinfo = ""
    if u.username or u.password:
        userinfo = quote(unquote(u.username or ""), safe="")
        userinfo += (":" + quote(unquote(u.password), safe="")) if u.password else ""
        userinfo += "@"
    path = u.path or "/0"
    urls = ";".join(f"sentinel://{userinfo}{_hostport(h, p)}{path}" for h, p in cfg.ha.sentinel_addresses())
    options: dict[str, Any] = {"master_name": cfg.ha.master_name}
    password = _password(cfg.url)
    if password:
        options["sentinel_kwargs"] = {"password": password}
    return urls, options


def _password(url: str) -> str | None:
    pw = urlsplit(url).password
    return unquote(pw) if pw else None


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _url_options(url: str) -> dict[str, Any]:
    """What `url` says besides where the server is (password, user, db, TLS), as redis-py keywords."""
    from redis.connection import SSLConnection, parse_url

    opts = parse_url(url)
    for key in ("host", "port", "path"):
        opts.pop(key, None)
    if opts.pop("connection_class", None) is SSLConnection:
        opts["ssl"] = True
    return opts


def as_str(v: bytes | str) -> str:
    """A Redis reply as text, whether the client decodes replies or not."""
    return v.decode() if isinstance(v, bytes) else v
