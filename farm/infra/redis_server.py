"""The farm's own redis-server: when to manage one, how to start it, ping it and stop it; with
`redis.ha`, also its replica and the Redis Sentinels that watch them.

`farm up` starts a local redis-server only when `redis.managed` is true, the URL names this machine
and nothing answers there. It always has a password, given to `requirepass` through a 0600 config file:
the URL's own, else FARM_REDIS_PASSWORD, else one generated once into `<state_dir>/redis.password`
(0600), which every process reading that state dir's configuration puts into its URL. Its data (the
append-only file) lives in `<state_dir>/redis`, so queued requests and the worker registry survive a
restart of the farm.

With `redis.ha` the managed set is a primary, a replica (`redis.ha.replica_port`, data in
`<state_dir>/redis-replica`) and the sentinels (`<state_dir>/sentinel-<i>`), all on 127.0.0.1 and with the
same password (sentinels: `requirepass`, and `auth-pass`/`masterauth` towards the data nodes). Sentinel
rewrites its config file with what it learns, including which node is the primary after a failover; the
next `farm up` reads that (`last_primary_port`) and starts that node as the primary, so a promoted replica's
writes are never overwritten by a resync from the old primary.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from farm.config.redis import is_local, password_path, read_password, url_password
from farm.infra.filemodes import PRIVATE_UMASK, private_dir, private_umask, tighten
from farm.infra.orphans import die_with_parent
from farm.infra.redis_client import connect

if TYPE_CHECKING:
    from farm.config import RedisConfig, RedisHAConfig

class RedisServerError(RuntimeError):
    """redis-server is missing, did not start, or the configured Redis cannot be reached."""


def parse_url(url: str) -> tuple[str, int, int]:
    """(host, port, db) of a redis:// URL."""
    u = urlparse(url)
    if u.scheme not in ("redis", "rediss", "unix"):
        raise RedisServerError(f"not a Redis URL: {url!r}")
    db = 0
    path = (u.path or "/").lstrip("/")
    if path.isdigit():
        db = int(path)
    return (u.hostname or "127.0.0.1"), (u.port or 6379), db


def ping(target: RedisConfig | str, timeout: float = 1.0) -> bool:
    """True when the farm's Redis (through the sentinels with HA), or the server at a URL, answers PING."""
    import redis

    c = connect(target, timeout=timeout)
    try:
        return bool(c.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        c.close()


def listener_uids(port: int) -> set[int]:
    """The users owning the TCP sockets that listen on `port` on this machine (in this network namespace), from
    Linux's /proc/net/tcp and tcp6; empty where /proc does not tell."""
    uids: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()  # sl local_address rem_address st ... uid: state 0A is LISTEN
            if len(f) > 7 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                uids.add(int(f[7]))
    return uids


def executable() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisServerError(
            "redis-server is not installed (`make install` installs it: apt-get install -y redis-server)"
        )
    return exe


def node_url(url: str, port: int) -> str:
    """`url` (password, database) pointed at 127.0.0.1:`port`: one node of a managed Redis."""
    u = urlparse(url)
    auth = u.netloc.rpartition("@")[0]
    return u._replace(netloc=(auth + "@" if auth else "") + f"127.0.0.1:{port}").geturl()


AUTH_CONF = "redis-auth.conf"


def ensure_password(state_dir: Path | str) -> str:
    """The managed Redis's password, generated once (mode 0600, like the farm secret): every process that
    reads this state dir's configuration finds it (farm.config.load_config)."""
    path = password_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return read_password(path.parent) or ""


def _write_secret_conf(path: Path, lines: list[str]) -> Path:
    """A config file of mode 0600: passwords never go on a command line (which `ps` and farm.json show)."""
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    os.chmod(path, 0o600)
    return path


def _check_password(password: str) -> str:
    if any(c in password for c in '"\\\r\n'):
        raise RedisServerError("the Redis password must not contain quotes, backslashes or newlines")
    return password


def write_auth_conf(data_dir: Path | str, password: str) -> Path:
    """The data node's password: `requirepass` for its clients, `masterauth` for when it replicates (a
    replica, or a primary that comes back after a failover and is made a replica)."""
    pw = _check_password(password)
    return _write_secret_conf(Path(data_dir) / AUTH_CONF, [f'requirepass "{pw}"', f'masterauth "{pw}"'])


def command(port: int, data_dir: Path | str, appendonly: bool = True, exe: str | None = None,
            password: str | None = None, replica_of: int | None = None, *, bind: str = "127.0.0.1",
            replica_of_host: str = "127.0.0.1", min_replicas_max_lag_s: int = 0) -> list[str]:
    """The redis-server command line of a managed Redis (also what the Procfile runs); with a password,
    a 0600 config file under `data_dir` sets requirepass. `replica_of`: a replica of `replica_of_host`:<port>.
    `bind`: the address it listens on. `min_replicas_max_lag_s` (a node of a Sentinel set; 0 = off): as a
    primary it refuses writes (NOREPLICAS) while no replica has acknowledged for that many seconds, so a
    primary partitioned from its replicas stops acknowledging writes the failover would discard."""
    conf = [str(write_auth_conf(data_dir, password))] if password else []
    replica = ["--replicaof", replica_of_host, str(replica_of)] if replica_of else []
    if min_replicas_max_lag_s < 0:
        raise RedisServerError(f"min_replicas_max_lag_s must be 0 (off) or more, got {min_replicas_max_lag_s}")
    min_replicas = (["--min-replicas-to-write", "1", "--min-replicas-max-lag", str(min_replicas_max_lag_s)]
                    if min_replicas_max_lag_s else [])
    return [
        exe or executable(), *conf, "--port", str(port), "--bind", bind, "--dir", str(data_dir),
        "--appendonly", "yes" if appendonly else "no", "--daemonize", "no",
        "--repl-diskless-sync-delay", "0",  # a (re)joining replica syncs at once, not after 5 s of waiting for others
        *min_replicas, *replica,
    ]


# -- Redis Sentinel (redis.ha) ------------------------------------------------------------------------
SENTINEL_CONF = "sentinel.conf"


def sentinel_dir(state_dir: Path | str, i: int) -> Path:
    return Path(state_dir) / f"sentinel-{i}"


def sentinel_executable() -> list[str]:
    """Debian's redis-sentinel (`make install` puts it in), else redis-server in sentinel mode (the same
    program: redis-sentinel is a link to it)."""
    exe = shutil.which("redis-sentinel")
    return [exe] if exe else [executable(), "--sentinel"]


def sentinel_command(i: int, port: int, state_dir: Path | str, ha: RedisHAConfig, primary_port: int,
                     password: str | None, *, bind: str = "127.0.0.1", primary_host: str = "127.0.0.1") -> list[str]:
    """Sentinel number `i` on `bind`:`port` (it announces that address to the other sentinels), watching the
    primary on `primary_host`:`primary_port`. Its config file is written anew (mode 0600: it holds the
    password); Sentinel rewrites it as it learns."""
    d = sentinel_dir(state_dir, i)
    name = ha.master_name
    lines = [f"port {port}", f"bind {bind}", f'dir "{d}"',
             f"sentinel monitor {name} {primary_host} {primary_port} {ha.quorum}",
             f"sentinel down-after-milliseconds {name} {ha.down_after_ms}",
             f"sentinel failover-timeout {name} {ha.failover_timeout_ms}",
             f"sentinel parallel-syncs {name} 1"]
    if password:
        pw = _check_password(password)
        # auth-pass: towards the data nodes; requirepass: clients and the other sentinels (which use
        # their own requirepass towards their peers)
        lines += [f'sentinel auth-pass {name} "{pw}"', f'requirepass "{pw}"']
    conf = _write_secret_conf(d / SENTINEL_CONF, lines)
    return [*sentinel_executable(), str(conf)]


def last_primary_port(state_dir: Path | str, master_name: str) -> int | None:
    """The primary's port as the managed sentinels last knew it (after a failover: the promoted replica)."""
    for conf in sorted(Path(state_dir).glob(f"sentinel-*/{SENTINEL_CONF}")):
        try:
            for line in conf.read_text().splitlines():
                parts = line.split()
                if parts[:3] == ["sentinel", "monitor", master_name] and len(parts) >= 5 and parts[4].isdigit():
                    return int(parts[4])
        except OSError:
            continue
    return None


def start(port: int, data_dir: Path | str, log_path: Path | str, appendonly: bool = True,
          env: dict[str, str] | None = None, password: str | None = None) -> subprocess.Popen:
    """Start redis-server in its own session, logging to `log_path`; does not wait for it."""
    data_dir = private_dir(data_dir)
    private_dir(Path(log_path).parent)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            command(port, data_dir, appendonly, password=password), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            umask=PRIVATE_UMASK,  # its AOF and RDB (cached answers, queued prompts) are 0600, not 0644
            preexec_fn=die_with_parent(signal.SIGTERM),  # never outlives its starter (AOF flushed on the way)
        )


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 15.0) -> None:
    """Block until Redis answers at `url`; raise if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ping(url, timeout=0.5):
            return
        if proc is not None and proc.poll() is not None:
            raise RedisServerError(f"redis-server exited with status {proc.returncode} while starting")
        time.sleep(0.05)
    raise RedisServerError(f"redis-server did not answer at {url} within {timeout:.0f}s")


def start_managed(url: str, data_dir: Path | str, log_path: Path | str, appendonly: bool = True,
                  timeout: float = 15.0, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a redis-server for a local `url` and wait until it answers."""
    if not is_local(url):
        raise RedisServerError(f"cannot start a redis-server for {url}: it is not on this machine")
    _host, port, _db = parse_url(url)
    proc = start(port, data_dir, log_path, appendonly, env=env, password=url_password(url))
    try:
        wait_ready(url, proc, timeout)
    except RedisServerError:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    return proc


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """SIGTERM (Redis flushes its AOF and exits), then SIGKILL after `timeout`; returns the status."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def aof_files(data_dir: Path | str) -> list[Path]:
    """The append-only files under a data dir (Redis 7 keeps them in `appendonlydir/`)."""
    d = Path(data_dir)
    out = sorted(d.glob("appendonly*.aof*")) + sorted(d.glob("appendonlydir/*"))
    return [p for p in out if p.is_file()]


def main() -> None:
    """`python -m farm.infra.redis_server`: this configuration's managed Redis in the foreground (the Procfile's
    `redis`), with the same password `farm up` gives it, so the Procfile's other processes find it too."""
    from farm.config import get_config

    cfg = get_config()
    if cfg.redis.ha.enabled:  # one process cannot be a Sentinel set; `farm up` starts and restarts all five
        raise SystemExit("farm.infra.redis_server: redis.ha is enabled; `farm up` starts the primary, replica and sentinels")
    _host, port, _db = parse_url(cfg.redis.url)
    data_dir = cfg.state_path / "redis"
    private_umask()  # redis-server creates its AOF and RDB with this process's umask: 0600, not 0644
    private_dir(data_dir)
    tighten(data_dir)  # data written before
    password = url_password(cfg.redis.url) or ensure_password(cfg.state_path)
    cmd = command(port, data_dir, cfg.redis.appendonly, password=password)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
