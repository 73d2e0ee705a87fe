"""The login of the Flower `farm up` starts when FARM_FLOWER_AUTH is not set: generated once into
`<state_dir>/flower.auth` (0600), as the managed Redis's password is. Without one, every local user could read the
farm's request ids, queues and workers from Flower's pages."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from farm.infra.filemodes import open_private, private_dir

FLOWER_LOGIN_FILE = "flower.auth"
USER = "admin"


def flower_login(state_dir: Path) -> str:
    """`user:password` for Flower's basic auth, made on first use and read from the file afterwards."""
    path = private_dir(state_dir) / FLOWER_LOGIN_FILE
    try:
        fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:  # url-safe: no ':' or ',' that Flower would split on
            f.write(f"{USER}:{secrets.token_urlsafe(24)}\n")
    return path.read_text().strip()
