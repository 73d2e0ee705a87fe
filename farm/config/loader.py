"""Loading: YAML defaults in config/, an optional override file, then environment.

One way to configure: `config/default.yaml` holds every key; `FARM_CONFIG=/path.yaml` overrides
any subset; `FARM_<SECTION>__<KEY>=value` overrides single keys (values parsed as YAML scalars).
Validation errors name the key and the source so a typo never starts a half-configured farm."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from farm.config.api import ApiKeyEntry
from farm.config.base import DEFAULT_CONFIG_PATH, PROJECT_ROOT, ConfigError
from farm.config.redis import is_local, read_password, redis_url_with_password, url_password
from farm.config.root import FarmConfig
from farm.config.vsr import looks_like_vsr, vsr_override
from farm.config.weak_secrets import refuse_placeholders, refuse_weak_flower_auth

ENV_PREFIX = "FARM_"


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """FARM_API__PORT=9000 -> {"api": {"port": 9000}}; only keys with `__` are config keys."""
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX):].split("__")]
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        try:
            node[path[-1]] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            node[path[-1]] = raw
    # FARM_STATE_DIR is the one top-level key people set often.
    if "FARM_STATE_DIR" in environ:
        out["state_dir"] = environ["FARM_STATE_DIR"]
    return out


def load_config(path: str | Path | None = None, environ: dict[str, str] | None = None) -> FarmConfig:
    """Load defaults, then the override file (argument or FARM_CONFIG), then the environment."""
    env = dict(os.environ if environ is None else environ)
    data = _read_yaml(DEFAULT_CONFIG_PATH)
    builtin = list(data["semantic"]["categories"])
    override_path = path or env.get("FARM_CONFIG")
    override = _read_yaml(Path(override_path)) if override_path else {}
    if looks_like_vsr(override):  # a vLLM Semantic Router config.yaml: its subset that maps (farm/config/vsr/)
        override = vsr_override(override, str(override_path))
    data = _deep_merge(data, override)
    data = _deep_merge(data, _env_overrides(env))
    _apply_redis_password(data, env.get("FARM_REDIS_PASSWORD", "") or _managed_redis_password(data))
    sem = override.get("semantic")
    written = sem.get("categories") if isinstance(sem, dict) else None
    if isinstance(written, list) and data["semantic"].get("builtin_categories", True) is not False:
        data["semantic"]["categories"] = _with_builtin(builtin, written)
    _prune_default_scores(data, _names(written) if isinstance(written, list) else set())
    try:
        cfg = FarmConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']}")
        src = f"{DEFAULT_CONFIG_PATH}" + (f" + {override_path}" if override_path else "") + " + FARM_* env"
        raise ConfigError(f"invalid farm configuration ({src}):\n" + "\n".join(lines)) from None
    keys = [k.key if isinstance(k, ApiKeyEntry) else k for k in cfg.api.api_keys]
    refuse_placeholders(env, [("redis.url's password", url_password(cfg.redis.url)),
                              *(("api.api_keys", k) for k in keys)])
    refuse_weak_flower_auth(env)
    return cfg


def _names(categories: list[Any]) -> set[str]:
    return {c["name"] for c in categories if isinstance(c, dict) and isinstance(c.get("name"), str)}


def _with_builtin(builtin: list[dict[str, Any]], written: list[Any]) -> list[Any]:
    """An override's categories merged by name with the embedded ones (`semantic.builtin_categories`): the first
    of a built-in name replaces that category where it stands, anything else is added after them (a second of
    a name too, so validation reports the duplicate)."""
    out, at = list(builtin), {c["name"]: i for i, c in enumerate(builtin)}
    for c in written:
        name = c.get("name") if isinstance(c, dict) else None
        if isinstance(name, str) and name in at:
            out[at.pop(name)] = c
        else:
            out.append(c)
    return out


def _prune_default_scores(data: dict[str, Any], written: set[str]) -> None:
    """The embedded categories score the embedded models; an override that serves other models keeps
    the categories (and their system prompts) but drops scores for models it no longer has. Categories
    written in an override file (`written`) are checked strictly instead (FarmConfig: unknown models are
    errors)."""
    models = data.get("models")
    cats = (data.get("semantic") or {}).get("categories")
    if not isinstance(models, list) or not isinstance(cats, list):
        return
    names = {m.get("name") for m in models if isinstance(m, dict)}
    for c in cats:
        if isinstance(c, dict) and c.get("name") not in written and isinstance(c.get("model_scores"), dict):
            c["model_scores"] = {k: v for k, v in c["model_scores"].items() if k in names}


def _apply_redis_password(data: dict[str, Any], password: str) -> None:
    """FARM_REDIS_PASSWORD (or the managed Redis's generated one) goes into redis.url (a password already
    in the URL wins), so every client of the farm (API, Celery, workers, CLI) authenticates without the
    secret living in a config file."""
    redis_cfg = data.get("redis")
    if not password or not isinstance(redis_cfg, dict) or not isinstance(redis_cfg.get("url"), str):
        return
    redis_cfg["url"] = redis_url_with_password(redis_cfg["url"], password)


def _managed_redis_password(data: dict[str, Any]) -> str:
    """The password `farm up` generated for its managed Redis (`<state_dir>/redis.password`), for a local
    URL of a managed Redis; "" when there is none (then the URL is used as it is)."""
    redis_cfg, state = data.get("redis"), data.get("state_dir")
    if not isinstance(redis_cfg, dict) or not isinstance(state, str) or redis_cfg.get("managed") is False:
        return ""
    url = redis_cfg.get("url")
    if not isinstance(url, str) or not is_local(url):
        return ""
    path = Path(state)
    return read_password(path if path.is_absolute() else PROJECT_ROOT / path) or ""




@lru_cache(maxsize=1)
def get_config() -> FarmConfig:
    """The process-wide configuration, loaded once."""
    return load_config()
