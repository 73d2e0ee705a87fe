"""The `redis` section (a single server, or Sentinel with `ha`), and the URL and password-file rules every
process applies to it before connecting."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlparse, urlsplit, urlunsplit

from pydantic import Field, field_validator, model_validator

from farm.config.base import Section


class RedisHAConfig(Section):
    """Redis Sentinel. Every farm process asks the sentinels where the primary is (and asks again after a
    failover); `farm up` with a managed Redis starts the primary (redis.url's port), a replica and the
    sentinels on this machine. redis.url still gives the password and the database."""

    enabled: bool = False
    master_name: str = Field("farm", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    sentinels: list[str] = Field(default_factory=lambda: ["127.0.0.1:26379", "127.0.0.1:26380", "127.0.0.1:26381"],
                                 min_length=1)  # host:port
    replica_port: int = Field(6380, ge=1, le=65535)  # managed: where the replica listens
    quorum: int = Field(2, ge=1)  # sentinels that must agree the primary is down
    down_after_ms: int = Field(2000, ge=100)  # silence after which a sentinel thinks the primary is down
    failover_timeout_ms: int = Field(10000, ge=1000)
    # Token stream writes wait up to this long for a replica to hold them (WAIT), so a failover loses none
    # that a reader may not have seen yet; 0 = do not wait (asynchronous replication only).
    replica_ack_timeout_ms: int = Field(200, ge=0)
    # > 0: managed data nodes refuse writes (NOREPLICAS) while no replica has acknowledged the replication stream
    # for this many seconds (min-replicas-to-write 1, min-replicas-max-lag), so a primary cut off from its replicas
    # on the minority side of a partition stops acknowledging writes the failover would throw away. 0 (default,
    # Redis's own): a primary alone keeps taking writes. Off by default because with a single replica (the managed
    # set, the chart's two data nodes) losing either node stops every write until it is back; turn it on (5) with
    # two replicas or more.
    min_replicas_max_lag_s: int = Field(0, ge=0, le=3600)

    @field_validator("sentinels", mode="before")
    @classmethod
    def _comma_list(cls, v: Any) -> Any:
        """FARM_REDIS__HA__SENTINELS=h1:26379,h2:26379 works as well as a YAML list."""
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @field_validator("sentinels")
    @classmethod
    def _host_ports(cls, v: list[str]) -> list[str]:
        for item in v:
            host, _, port = item.rpartition(":")
            if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
                raise ValueError(f"a sentinel is host:port, got {item!r}")
        return v

    @model_validator(mode="after")
    def _quorum_reachable(self) -> RedisHAConfig:
        if self.quorum > len(self.sentinels):
            raise ValueError(f"quorum {self.quorum} is more than the {len(self.sentinels)} sentinels")
        return self

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        out = []
        for item in self.sentinels:
            host, _, port = item.rpartition(":")
            out.append((host.strip("[]"), int(port)))
        return out


class RedisSocketConfig(Section):
    """Timeouts and TCP keepalive of every connection to Redis (redis-py clients and Celery's broker), so a
    network partition ends in an error and a reconnect within seconds instead of a process waiting forever on
    a connection whose peer is unreachable (no FIN or RST ever arrives through a partition)."""

    connect_timeout_s: float = Field(5.0, gt=0)
    # Each command's answer: above the longest blocking read (XREAD of the reply reader and the router's
    # follower block for at most 1 s) plus a slow network's round trips.
    timeout_s: float = Field(10.0, ge=2)
    # An idle connection is probed after keepalive_idle_s, every keepalive_interval_s, dropped after
    # keepalive_count unanswered probes (the kernel's default would wait two hours).
    keepalive_idle_s: int = Field(5, ge=1)
    keepalive_interval_s: int = Field(2, ge=1)
    keepalive_count: int = Field(3, ge=1)
    # A connection idle this long is checked (PING) before use; Celery's consumer also drops a BRPOP connection
    # whose answer is overdue by this much (kombu). 0 = never.
    health_check_interval_s: int = Field(10, ge=0)


class RedisConfig(Section):
    url: str = "redis://127.0.0.1:6379/0"
    managed: bool = True
    appendonly: bool = True
    # A Redis off this machine must have a password (in the URL or FARM_REDIS_PASSWORD); true waives it.
    allow_no_password: bool = False
    ha: RedisHAConfig = RedisHAConfig()
    socket: RedisSocketConfig = RedisSocketConfig()


LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}
PASSWORD_FILE = "redis.password"  # in the state dir: the managed Redis's generated password


def is_local(url: str) -> bool:
    """Whether the URL points at this machine (so a redis-server can be started for it)."""
    u = urlparse(url)
    if u.scheme != "redis":
        return False
    host = u.hostname or "127.0.0.1"
    return host in LOCAL_HOSTS or host.startswith("127.") or host == socket.gethostname()


def password_path(state_dir: Path | str) -> Path:
    return Path(state_dir) / PASSWORD_FILE


def read_password(state_dir: Path | str) -> str | None:
    """The generated password of this state dir's managed Redis, if one was made."""
    try:
        return password_path(state_dir).read_text().strip() or None
    except OSError:
        return None


def url_password(url: str) -> str | None:
    """The password in a redis:// URL (percent-decoded), or None."""
    pw = urlparse(url).password
    return unquote(pw) if pw else None


def has_password(url: str) -> bool:
    try:
        return bool(urlsplit(url).password)
    except ValueError:
        return False


def redis_url_with_password(url: str, password: str) -> str:
    """`url` with `password` in its userinfo, unless it already has one."""
    u = urlsplit(url)
    if u.password or u.scheme not in ("redis", "rediss") or not u.hostname:
        return url
    user = quote(u.username or "", safe="")
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    netloc = f"{user}:{quote(password, safe='')}@{host}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def redact_url(url: str) -> str:
    """A URL safe to print: its password replaced by ***."""
    u = urlsplit(url)
    if not u.password:
        return url
    return url.replace(f":{u.password}@", ":***@", 1)
