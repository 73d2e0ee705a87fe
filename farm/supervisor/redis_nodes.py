"""The managed Redis of a farm: one server, or with `redis.ha` a primary, a replica and three sentinels
(Farm's part that starts them and brings a dead node back as a replica)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from farm.config import (
    redact_url,
    redis_url_with_password,
)
from farm.config.redis import is_local, url_password
from farm.infra import redis_client, redis_server
from farm.infra.filemodes import private_dir
from farm.supervisor.procs import (
    FarmError,
    FarmStartError,
    Proc,
)


class ManagedRedis:
    """Farm's managed Redis (a part of Farm, which holds the state it uses)."""

    def _protect_managed_redis(self) -> None:
        """A Redis this farm is about to start never runs without a password: when the URL has none (nor
        FARM_REDIS_PASSWORD), one is generated once into `<state_dir>/redis.password` (0600) and put into
        this farm's URL, so every child (through config.resolved.yaml) and every later `farm` command
        (load_config reads the file) authenticates. A Redis of this user's already answering without one is used as
        it is; another user's is refused (`_start_redis`)."""
        url = self.cfg.redis.url
        if not self.cfg.redis.managed or not is_local(url) or url_password(url):
            return
        if redis_server.ping(url):
            return  # someone else's Redis: not ours to protect (redis.managed: false says so explicitly)
        url = redis_url_with_password(url, redis_server.ensure_password(self.state_dir))
        self.cfg = self.cfg.model_copy(update={"redis": self.cfg.redis.model_copy(update={"url": url})})

    def _start_redis(self) -> None:
        url = self.cfg.redis.url
        if redis_server.ping(self.cfg.redis):
            self._refuse_another_users_redis(url)
            return  # a Redis of this user's (another farm's, or a shared one): use it, never stop it
        if not self.cfg.redis.managed:
            raise FarmError(f"Redis at {redact_url(url)} does not answer and redis.managed is false")
        if not is_local(url):
            raise FarmError(f"Redis at {redact_url(url)} does not answer, and it is not on this machine, so the "
                            "farm cannot start one; check FARM_REDIS__URL")
        if self.cfg.redis.ha.enabled:
            self._start_redis_ha()
            return
        _host, port, _db = redis_server.parse_url(url)
        self._start_redis_node("redis", port)

    def _refuse_another_users_redis(self, url: str) -> None:
        """A managed farm does not use a Redis another local user runs on its port: whoever started it first (after a
        reboot, say) would read every prompt and answer and could queue work for the workers. A Redis of this user's
        is used as before; `redis.managed: false` says that a Redis is meant to be used whoever runs it."""
        if not self.cfg.redis.managed or not is_local(url):
            return
        port = redis_server.parse_url(url)[1]
        others = redis_server.listener_uids(port) - {os.geteuid()}
        if others:
            raise FarmError(f"the Redis listening on port {port} is run by another user (uid {min(others)}), not by "
                            "this farm's: it would see every prompt and answer. Stop it, give the farm another port "
                            "(FARM_REDIS__URL), or set redis.managed: false to use that Redis on purpose")

    def _redis_node_dir(self, port: int) -> Path:
        """The data dir of the managed data node on `port`: the primary's (redis.url) or the replica's."""
        _host, url_port, _db = redis_server.parse_url(self.cfg.redis.url)
        return self.state_dir / ("redis" if port == url_port else "redis-replica")

    def _redis_node_command(self, port: int, replica_of: int | None = None) -> list[str]:
        try:
            ha = self.cfg.redis.ha
            return redis_server.command(port, self._redis_node_dir(port), self.cfg.redis.appendonly,
                                        password=url_password(self.cfg.redis.url), replica_of=replica_of,
                                        min_replicas_max_lag_s=ha.min_replicas_max_lag_s if ha.enabled else 0)
        except redis_server.RedisServerError as e:
            raise FarmError(str(e)) from None

    def _start_redis_node(self, name: str, port: int, replica_of: int | None = None) -> None:
        cmd = self._redis_node_command(port, replica_of)
        private_dir(self._redis_node_dir(port))  # its AOF and RDB: cached answers, queued prompts
        proc = self._spawn(Proc(name, "redis", cmd, str(self.log_path(name))))
        self.redis_managed = True
        try:
            redis_server.wait_ready(redis_server.node_url(self.cfg.redis.url, port), proc.popen, timeout=15)
        except redis_server.RedisServerError as e:
            raise FarmStartError(f"{e} (log: {proc.log})", proc.name, proc.tail()) from None

    def _start_redis_ha(self) -> None:
        """redis.ha on this machine: the primary, its replica, then the sentinels watching them. The node
        the sentinels last knew as the primary (after a failover: the promoted replica) starts as the primary
        again, so the other resyncs from it and no acknowledged write is overwritten."""
        rcfg, ha = self.cfg.redis, self.cfg.redis.ha
        sentinels = ha.sentinel_addresses()
        if not all(is_local(f"redis://{h}:{p}/0") for h, p in sentinels):
            raise FarmError(f"redis.ha.sentinels {ha.sentinels} do not answer and are not all on this machine, "
                            "so the farm cannot start them")
        _host, url_port, _db = redis_server.parse_url(rcfg.url)
        ports = [url_port, ha.replica_port, *(p for _h, p in sentinels)]
        if len(set(ports)) != len(ports):
            raise FarmError(f"redis.url's port, redis.ha.replica_port and the sentinels' ports must differ: {ports}")
        primary = redis_server.last_primary_port(self.state_dir, ha.master_name)
        primary = primary if primary in (url_port, ha.replica_port) else url_port
        replica = ha.replica_port if primary == url_port else url_port
        names = {url_port: "redis", ha.replica_port: "redis-replica"}
        self._start_redis_node(names[primary], primary)
        self._start_redis_node(names[replica], replica, replica_of=primary)
        password = url_password(rcfg.url)
        for i, (_h, port) in enumerate(sentinels, 1):
            try:
                cmd = redis_server.sentinel_command(i, port, self.state_dir, ha, primary, password)
            except redis_server.RedisServerError as e:
                raise FarmError(str(e)) from None
            self._spawn(Proc(f"sentinel-{i}", "sentinel", cmd, str(self.log_path(f"sentinel-{i}"))))
        deadline = time.monotonic() + 15
        while not redis_server.ping(rcfg):  # clients find the primary through the sentinels
            self.check_alive("while starting Redis Sentinel")
            if time.monotonic() > deadline:
                first = next(p for p in self.procs if p.role == "sentinel")
                raise FarmStartError("the sentinels did not report a primary within 15s", first.name, first.tail())
            time.sleep(0.1)

    def _rejoin_command(self, proc: Proc) -> list[str] | None:
        """redis.ha: the command that brings a dead data node back, as a replica of the primary the sentinels
        name now; None while they still name the dead node (the failover is not done: wait)."""
        if proc.role != "redis":
            return proc.command  # a sentinel: the config it rewrote holds what it knew
        port = int(proc.command[proc.command.index("--port") + 1])
        now = redis_client.primary_address(self.cfg.redis)
        if now is None or now[1] == port:
            return None
        return self._redis_node_command(port, replica_of=now[1])
