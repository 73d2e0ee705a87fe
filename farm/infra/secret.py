"""The HMAC secret every process of the farm shares (it keys the signed KV handles): FARM_SECRET, or one made
once in the state dir, which must be the farm's user's own."""

from __future__ import annotations

import os
import secrets

from farm.config import ConfigError, FarmConfig
from farm.config.weak_secrets import MAKE_ONE, is_placeholder
from farm.infra.filemodes import NotOurs, open_private, private_dir, require_ours

MIN_SECRET_CHARS = 16  # FARM_SECRET keys the KV handles' HMAC: a short one can be guessed, an empty one forged by all


def farm_secret(cfg: FarmConfig) -> bytes:
    """The HMAC secret shared by every process of the farm.

    FARM_SECRET wins; otherwise a random one is created once in the state dir (mode 0600) so all
    processes started from this checkout agree. Workers on other hosts must get FARM_SECRET.
    The file appears whole or not at all (written aside, then linked into place), so processes started
    together (a Procfile) all read the one that won; a secret that is short, empty or the example's
    placeholder is refused with the fix, and so is a state dir or secret file of another user's (they would
    hold the key: a state dir in /tmp).
    """
    env = os.environ.get("FARM_SECRET")
    if env:
        return _usable_secret(env, "FARM_SECRET")  # as given: every process must derive the same key
    path = cfg.state_path / "secret"
    try:
        private_dir(path.parent)
        if path.exists():
            require_ours(path)
    except NotOurs as e:
        raise ConfigError(f"{e}; or set FARM_SECRET") from None
    if not path.exists():
        aside = path.with_name(f".secret-{os.getpid()}-{secrets.token_hex(4)}")
        fd = open_private(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            try:
                os.link(aside, path)
            except FileExistsError:  # another process of the farm linked its own first: use that one
                pass
        finally:
            aside.unlink(missing_ok=True)
    return _usable_secret(path.read_text().strip(), f"the secret file {path} (delete it to have a new one made)")


def _usable_secret(value: str, source: str) -> bytes:
    shown = value.strip()  # judged without surrounding whitespace; used as given
    if is_placeholder(shown):
        raise ConfigError(f"{source} is the example's placeholder; set a random value ({MAKE_ONE})")
    if len(shown) < MIN_SECRET_CHARS:
        raise ConfigError(f"{source} has {len(shown)} characters; the KV handles' HMAC key needs at least "
                          f"{MIN_SECRET_CHARS} ({MAKE_ONE})")
    return value.encode()
