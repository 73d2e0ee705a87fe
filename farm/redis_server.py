"""The farm's own redis-server: when to manage one, how to start it, ping it and stop it.

`farm up` starts a local redis-server only when `redis.managed` is true, the URL names this machine
and nothing answers there. It always has a password, given to `requirepass` through a 0600 config file:
the URL's own, else FARM_REDIS_PASSWORD, else one generated once into `<state_dir>/redis.password`
(0600), which every process reading that state dir's configuration puts into its URL. Its data (the
append-only file) lives in `<state_dir>/redis`, so queued requests and the worker registry survive a
restart of the farm.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

if TYPE_CHECKING:
    import redis

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}


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


def is_local(url: str) -> bool:
    """Whether the URL points at this machine (so a redis-server can be started for it)."""
    if urlparse(url).scheme != "redis":
        return False
    host = parse_url(url)[0]
    return host in LOCAL_HOSTS or host.startswith("127.") or host == socket.gethostname()


def client(url: str, timeout: float = 2.0) -> redis.Redis:
    # redis is imported here, not at the top: loading the configuration (farm.config reads the managed
    # Redis's password through this module) must not import it in gunicorn's unpatched master process;
    # the API's gevent worker imports it after patching (api/gunicorn_conf.py)
    import redis

    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)


def ping(url: str, timeout: float = 1.0) -> bool:
    """True when a Redis server answers PING at `url`."""
    import redis

    c = client(url, timeout)
    try:
        return bool(c.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        c.close()


def executable() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisServerError(
            "redis-server is not installed (`make install` installs it: apt-get install -y redis-server)"
        )
    return exe


def url_password(url: str) -> str | None:
    """The password in a redis:// URL (percent-decoded), or None."""
    pw = urlparse(url).password
    return unquote(pw) if pw else None


AUTH_CONF = "redis-auth.conf"
PASSWORD_FILE = "redis.password"  # in the state dir: the managed Redis's generated password


def password_path(state_dir: Path | str) -> Path:
    return Path(state_dir) / PASSWORD_FILE


def read_password(state_dir: Path | str) -> str | None:
    """The generated password of this state dir's managed Redis, if one was made."""
    try:
        return password_path(state_dir).read_text().strip() or None
    except OSError:
        return None


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


def write_auth_conf(data_dir: Path | str, password: str) -> Path:
    """A config file (mode 0600) holding `requirepass`, so the password is never on a command line
    (which `ps` and farm.json would show)."""
    path = Path(data_dir) / AUTH_CONF
    path.parent.mkdir(parents=True, exist_ok=True)
    if any(c in password for c in '"\\\r\n'):
        raise RedisServerError("the Redis password must not contain quotes, backslashes or newlines")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'requirepass "{password}"\n')
    os.chmod(path, 0o600)
    return path


def command(port: int, data_dir: Path | str, appendonly: bool = True, exe: str | None = None,
            password: str | None = None) -> list[str]:
    """The redis-server command line of a managed Redis (also what the Procfile runs); with a password,
    a 0600 config file under `data_dir` sets requirepass."""
    conf = [str(write_auth_conf(data_dir, password))] if password else []
    return [
        exe or executable(), *conf, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
        "--appendonly", "yes" if appendonly else "no", "--daemonize", "no",
    ]


def start(port: int, data_dir: Path | str, log_path: Path | str, appendonly: bool = True,
          env: dict[str, str] | None = None, password: str | None = None) -> subprocess.Popen:
    """Start redis-server in its own session, logging to `log_path`; does not wait for it."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            command(port, data_dir, appendonly, password=password), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
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
    """`python -m farm.redis_server`: this configuration's managed Redis in the foreground (the Procfile's
    `redis`), with the same password `farm up` gives it, so the Procfile's other processes find it too."""
    from farm.config import get_config

    cfg = get_config()
    _host, port, _db = parse_url(cfg.redis.url)
    data_dir = cfg.state_path / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    password = url_password(cfg.redis.url) or ensure_password(cfg.state_path)
    cmd = command(port, data_dir, cfg.redis.appendonly, password=password)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
