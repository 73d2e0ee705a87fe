"""Secrets too weak to start on, refused when the configuration loads.

- Still an example's placeholder: `change-me...` in deploy/docker/.env.example and the chart's examples. A value
  anyone can read in this repository protects nothing, so every farm process refuses to start on one (the Redis
  password, the HMAC secret, the metrics token, Flower's password, an API key), naming each place it was found.
- Flower's `user:password` with an empty half, or with a comma: Flower reads `a:b,c` as two credentials, so the
  text after a comma became a login of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from farm.config.base import ConfigError

_PLACEHOLDER = re.compile(r"change-?me", re.IGNORECASE)
MAKE_ONE = "openssl rand -hex 24"
FLOWER_ENV = ("FARM_FLOWER_AUTH", "FLOWER_BASIC_AUTH")  # Flower's basic auth, user:password
# Environment variables that hold a secret.
SECRET_ENV = ("FARM_SECRET", "FARM_REDIS_PASSWORD", "FARM_METRICS_TOKEN", "FARM_API_KEYS", *FLOWER_ENV)


def is_placeholder(value: str) -> bool:
    """True for a value that still carries an example's `change-me` (any case, with or without the dash)."""
    return bool(_PLACEHOLDER.search(value))


def refuse_placeholders(environ: Mapping[str, str], configured: Iterable[tuple[str, str | None]]) -> None:
    """Raise ConfigError naming every secret that is a placeholder: the environment's (`SECRET_ENV`) and the
    configuration's own (`configured`: (where, value) pairs such as the Redis URL's password)."""
    found = [name for name in SECRET_ENV if is_placeholder(environ.get(name, ""))]
    found += [where for where, value in configured if value and is_placeholder(value)]
    if found:
        raise ConfigError(f"the example's change-me placeholder is still in {', '.join(found)}: set real secrets "
                          f"(e.g. {MAKE_ONE}) before starting the farm")


def flower_auth_problem(value: str) -> str | None:
    """What is wrong with a Flower credential (`user:password`), or None."""
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        return "must be user:password with neither empty"
    if "," in value:
        return "must not hold a comma (Flower reads user:password,more as two logins, the second being 'more')"
    return None


def refuse_weak_flower_auth(environ: Mapping[str, str]) -> None:
    """Raise ConfigError for a Flower credential in the environment that `flower_auth_problem` finds wrong."""
    for name in FLOWER_ENV:
        value = environ.get(name)
        if value and (why := flower_auth_problem(value)):
            raise ConfigError(f"{name} {why}")
