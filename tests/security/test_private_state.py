"""Issue 26 item 4: other local users could read every tenant's data. The state dir, `files/` and Redis's
`appendonlydir` were 0755, batch files and the AOF 0644: as `nobody`, `head .farm/files/file-...` printed
another tenant's batch prompts and `grep -a` on the AOF printed a cached answer.

Now (farm/infra/filemodes.py) every farm process runs with umask 077, the farm gives 0700/0600 where it creates
directories and files itself, and `farm up` tightens a state dir made before. Checked on a real farm (managed
redis-server with its AOF, the API under gunicorn writing an upload), then as `nobody`."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from farm.batch.file_store import DiskBodies
from farm.infra import filemodes, logfiles, redis_server
from tests.conftest import free_port
from tests.security.farms import base_url, real_farm

SECRET_PROMPT = b'{"custom_id": "tenant-a-1", "body": {"messages": [{"content": "my secret prompt"}]}}\n'


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def modes_under(root: Path) -> dict[str, int]:
    """Every directory and regular file under `root` (itself included) with its permission bits."""
    out = {".": mode(root)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            p = Path(dirpath, name)
            if p.is_symlink() or not (p.is_dir() or p.is_file()):
                continue
            out[str(p.relative_to(root))] = mode(p)
    return out


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory other users may enter (pytest's own tmp is 0700, which would hide everything anyway)."""
    d = Path(tempfile.mkdtemp(prefix="farm-private-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(*cmd: str) -> subprocess.CompletedProcess:
    """`cmd` as the user nobody (the tests run as root): setgid/setuid between fork and exec."""
    who = pwd.getpwnam("nobody")

    def drop() -> None:
        os.setgroups([])
        os.setgid(who.pw_gid)
        os.setuid(who.pw_uid)

    return subprocess.run(cmd, preexec_fn=drop, capture_output=True, timeout=30)


def test_a_farms_state_is_private_to_its_user(shared_tmp, real_model_dir, capfd):
    """A state dir made the old way (0755, a 0644 batch file and AOF) is tightened by `farm up`; what the
    farm's processes write meanwhile (the managed Redis's AOF, the API's upload, logs, farm.json) is 0600 in
    0700 directories; `nobody` can neither list the state dir nor read a batch file or the AOF."""
    state = shared_tmp / "state"
    for d in ("files", "logs", "redis/appendonlydir"):
        (state / d).mkdir(parents=True)
    for d in (state, *state.rglob("*")):
        d.chmod(0o755)
    old_file = state / "files" / ("file-" + "a" * 24)
    old_file.write_bytes(SECRET_PROMPT)
    old_aof = state / "redis" / "appendonlydir" / "old.aof"
    old_aof.write_bytes(b"SET farm:sem:cached the cached answer\n")
    for f in (old_file, old_aof):
        f.chmod(0o644)
    # the old way, readable by anyone: the control for the checks as nobody below
    assert as_nobody("cat", str(old_file)).stdout == SECRET_PROMPT

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing answers there: `farm up` starts a managed Redis
    with real_farm(url, shared_tmp, real_model_dir, config={"semantic": {"enabled": False}}) as farm:
        assert farm.redis_managed and farm.state_dir == state
        resp = requests.post(base_url(farm) + "/v1/files", files={"file": ("a.jsonl", SECRET_PROMPT)},
                             data={"purpose": "batch"}, timeout=60)
        assert resp.status_code == 200, resp.text
        upload = state / "files" / resp.json()["id"]
        r = redis.Redis.from_url(farm.cfg.redis.url)
        r.set("farm:test:cached-answer", "the cached answer")
        r.close()
        aofs = redis_server.aof_files(state / "redis")
        assert any(b"the cached answer" in p.read_bytes() for p in aofs), aofs  # in the AOF, as in the issue
        modes = modes_under(state)
        control = shared_tmp / "control.txt"
        control.write_text("readable\n")
        control.chmod(0o644)
        nobody = {"id": as_nobody("id", "-u"), "control": as_nobody("cat", str(control)),
                  "ls": as_nobody("ls", str(state)), "file": as_nobody("cat", str(upload)),
                  "old file": as_nobody("cat", str(old_file)), "aof": as_nobody("cat", *map(str, aofs)),
                  "grep": as_nobody("grep", "-ra", "cached answer", str(state))}
    assert "took group and other permissions off" in capfd.readouterr().err

    assert upload.read_bytes() == SECRET_PROMPT
    for name in ("files", "logs", "redis", "redis/appendonlydir", "files/" + upload.name, "logs/api.log",
                 "logs/redis.log", "redis/appendonlydir/old.aof", "redis.password", "config.resolved.yaml", "farm.json"):
        assert name in modes, (name, sorted(modes))
    wrong = {p: oct(m) for p, m in modes.items()
             if m != (filemodes.DIR_MODE if (state / p).is_dir() else filemodes.FILE_MODE)}
    assert not wrong, f"not private: {wrong}"
    assert any(p.startswith("redis/appendonlydir/") and p.endswith(".aof") and p != "redis/appendonlydir/old.aof"
               for p in modes), sorted(modes)  # redis-server's own AOF, made under the farm's umask

    assert nobody["id"].stdout.strip() == str(pwd.getpwnam("nobody").pw_uid).encode()
    assert nobody["control"].returncode == 0  # nobody reads what is meant to be readable
    for what in ("ls", "file", "old file", "aof"):
        assert nobody[what].returncode != 0 and b"Permission denied" in nobody[what].stderr, (what, nobody[what])
        assert b"secret prompt" not in nobody[what].stdout and b"cached answer" not in nobody[what].stdout
    assert b"cached answer" not in nobody["grep"].stdout


def test_the_farms_writers_make_private_files_whatever_the_umask(tmp_path):
    """The functions that write tenant data give the modes themselves (a library caller's umask is 022)."""
    old = os.umask(0o022)
    try:
        bodies = DiskBodies(tmp_path / "files")
        bodies.write("file-" + "b" * 24, [SECRET_PROMPT], capped=False)
        assert mode(tmp_path / "files") == 0o700 and mode(bodies.path("file-" + "b" * 24)) == 0o600
        log = tmp_path / "logs" / "api.log"
        filemodes.private_dir(log.parent)
        os.close(filemodes.open_private(log))
        log.write_bytes(b"x" * 2000)
        assert logfiles.rotate(log, 1000, 2)
        assert mode(log) == 0o600 and mode(log.with_name("api.log.1")) == 0o600
        proc = redis_server.start(free_port(), tmp_path / "redis", tmp_path / "logs" / "redis.log")
        try:
            redis_server.wait_ready(f"redis://127.0.0.1:{proc.args[proc.args.index('--port') + 1]}/0", proc)
        finally:
            redis_server.stop(proc)
        aofs = redis_server.aof_files(tmp_path / "redis")
        assert aofs and all(mode(p) == 0o600 for p in aofs) and mode(tmp_path / "redis" / "appendonlydir") == 0o700
    finally:
        os.umask(old)


def test_tightening_leaves_links_and_their_targets_alone(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not the farm's")
    outside.chmod(0o644)
    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    (state / "models" / "w.bin").write_text("weights")
    (state / "models" / "w.bin").chmod(0o644)
    (state / "link").symlink_to(outside)
    state.chmod(0o755)
    (state / "models").chmod(0o755)
    assert filemodes.tighten(state) == (3, 0)
    assert mode(state) == 0o700 and mode(state / "models") == 0o700 and mode(state / "models" / "w.bin") == 0o600
    assert mode(outside) == 0o644  # a link is not followed
    assert filemodes.tighten(state) == (0, 0)
    assert filemodes.private_dir(state / "new" / "deeper") == state / "new" / "deeper"
    assert mode(state / "new" / "deeper") == 0o700


def test_a_state_dir_another_user_made_is_refused_and_links_are_not_followed(tmp_path, monkeypatch):
    """The listeners audit: a state_dir under /tmp, made beforehand by another user (here `nobody`), was used as
    it was: the farm read that user's planted `secret` as its HMAC key (every KV handle forgeable), and a log
    path linked elsewhere had the farm append to the file it named. Another user's directory is now refused
    (root's, a volume's mount point, is not another user's), so is another user's secret file, and a link in
    a private file's place is not followed."""
    from farm.config import ConfigError, load_config
    from farm.infra.secret import farm_secret

    nobody = pwd.getpwnam("nobody").pw_uid
    theirs = tmp_path / "planted"
    theirs.mkdir()
    (theirs / "secret").write_text("a" * 64)  # the key they chose
    os.chown(theirs / "secret", nobody, -1)
    os.chown(theirs, nobody, -1)
    with pytest.raises(filemodes.NotOurs, match="another user"):
        filemodes.private_dir(theirs)
    (tmp_path / "link-to-planted").symlink_to(theirs)
    with pytest.raises(filemodes.NotOurs):  # a link to it: judged by what it names
        filemodes.private_dir(tmp_path / "link-to-planted")
    monkeypatch.delenv("FARM_SECRET", raising=False)
    cfg = load_config(environ={"FARM_STATE_DIR": str(theirs)})
    with pytest.raises(ConfigError, match="another user"):
        farm_secret(cfg)
    ours = tmp_path / "ours"
    filemodes.private_dir(ours)
    (ours / "secret").write_text("b" * 64)
    os.chown(ours / "secret", nobody, -1)  # a file of theirs in a directory of ours
    with pytest.raises(ConfigError, match="another user"):
        farm_secret(load_config(environ={"FARM_STATE_DIR": str(ours)}))
    (ours / "secret").unlink()
    assert len(farm_secret(load_config(environ={"FARM_STATE_DIR": str(ours)}))) >= 32  # made afresh, ours
    target = tmp_path / "root-only.log"
    target.write_text("")
    (ours / "api.log").symlink_to(target)
    with pytest.raises(OSError):
        filemodes.open_private(ours / "api.log")
    assert target.read_text() == ""
