"""The farm's files belong to the farm's user alone (issue 26 item 4).

Under the state dir are other tenants' data: batch inputs and outputs (`files/`), Redis's append-only file
and snapshot (`redis/`: cached answers, queued prompts), logs, the KV disk tier. Made with the usual umask
022 they were 0644 in 0755 directories, and any local user could read them. So:

- every farm process runs with umask 077 (`private_umask`): the `farm` CLI, each child `farm up` starts
  (the managed redis-server too, which creates its AOF and RDB with the process's umask), the API's gunicorn
  config, `python -m farm.infra.redis_server`, and workers and batch drivers started another way (Procfile,
  containers) through `farm.infra.logfiles.configure_logging`;
- where the farm creates a directory or file itself it also gives the mode (`private_dir`, 0600 opens),
  so a library caller with another umask (the tests) gets the same;
- `farm up` tightens a state dir made before this (`tighten`: group and other bits off every directory and
  file, without following links) and says how many it changed.

Prepared models are private too: only the farm's own processes read them (one user, also in the images).
"""

from __future__ import annotations

import itertools
import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600
_OTHERS = 0o077  # group and other permission bits


def private_umask() -> int:
    """Files and directories this process creates from now on are its user's alone; returns the old umask."""
    return os.umask(PRIVATE_UMASK)


class NotOurs(PermissionError):
    """A directory the farm keeps private state in belongs to another user."""


def require_ours(path: Path | str) -> None:
    """NotOurs when `path` (links followed) belongs to a user other than this process's or root. A state dir in a
    place others may write (/tmp) could be made beforehand by another user, who would then read and replace what
    the farm keeps there (its HMAC secret, logs, Redis's files), whatever modes the farm sets. Root's is allowed:
    a volume's mount point (root's, with a group the pod runs as) is not another user's."""
    owner = Path(path).stat().st_uid
    if owner not in (os.geteuid(), 0):
        raise NotOurs(f"{path} belongs to another user (uid {owner}), not to the farm's user (uid {os.geteuid()}): "
                      "the farm keeps private state there; use a directory of your own (state_dir, FARM_STATE_DIR)")


def private_dir(path: Path | str) -> Path:
    """`path` as a directory only its owner can enter (0700): created (with missing parents) or tightened;
    NotOurs when another user owns it (`require_ours`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    require_ours(path)
    try:
        if stat.S_IMODE(path.stat().st_mode) & _OTHERS:
            path.chmod(stat.S_IMODE(path.stat().st_mode) & ~_OTHERS)
    except PermissionError:  # not ours (a mount point): what is under it still is
        pass
    return path


def open_private(path: Path | str, flags: int = os.O_WRONLY | os.O_CREAT | os.O_APPEND) -> int:
    """os.open with mode 0600 for a file it creates, whatever the umask; a symbolic link in its place is not
    followed (OSError ELOOP): a link planted there would have had the farm append to the file it names."""
    return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)


def tighten(root: Path | str) -> tuple[int, int]:
    """Take the group and other permissions off `root` and every directory and file under it (symbolic links
    are neither followed nor changed); returns (changed, failed): a path another user owns is left as it is."""
    changed = failed = 0
    root = Path(root)
    if not root.is_dir() or root.is_symlink():
        return 0, 0
    paths = (os.path.join(d, n) for d, dirs, files in os.walk(root) for n in (*dirs, *files))
    for path in itertools.chain([str(root)], paths):
        try:
            st = os.lstat(path)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode) or not mode & _OTHERS:
                continue
            os.chmod(path, mode & ~_OTHERS)
            changed += 1
        except FileNotFoundError:
            continue
        except OSError:
            failed += 1
    return changed, failed
