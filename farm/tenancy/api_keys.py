"""API keys: where they come from, how they are held, and who a key is.

Keys come from `api.api_keys` (config) and `FARM_API_KEYS` (comma-separated: what the Helm chart
passes). Only their SHA-256 digests are kept in memory, and a config entry may itself be a digest
(`sha256:<hex>`), so a config file never needs to hold a usable key. A key's *owner id* is derived
from its digest, so it is the same in every API replica and across restarts: files and batches are
recorded under it, and rate-limit counters in Redis are keyed by it. A config entry may also be a
mapping `{key, requests_per_minute, token_quota}`: that key's own limits (farm.tenancy.quota).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping

from farm.config import ApiKeyEntry, FarmConfig
from farm.config.api import LOOPBACK_HOSTS

ENV_KEYS = "FARM_API_KEYS"
ENV_METRICS_TOKEN = "FARM_METRICS_TOKEN"
HASH_PREFIX = "sha256:"
OWNER_ANONYMOUS = "anonymous"  # the owner of files, batches and cache entries of callers without a key
OWNER_PREFIX = "key-"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def owner_of(key_digest: str) -> str:
    """The stable owner id of a key (a prefix of its digest: not the key, not enough to forge it)."""
    return OWNER_PREFIX + key_digest[:24]


def _entries(cfg: FarmConfig, environ: Mapping[str, str]) -> list[str | ApiKeyEntry]:
    raw = [*cfg.api.api_keys, *environ.get(ENV_KEYS, "").replace("\n", ",").split(",")]
    return [k if isinstance(k, ApiKeyEntry) else k.strip() for k in raw
            if isinstance(k, ApiKeyEntry) or (k and k.strip())]


class KeyRing:
    """The configured keys as digests; `owner(key)` answers who a presented key is, or None."""

    def __init__(self, entries: Iterable[str | ApiKeyEntry], metrics_token: str = ""):
        self._digests: dict[str, str] = {}
        self.overrides: dict[str, ApiKeyEntry] = {}  # owner id -> the key's own limits
        for entry in entries:
            e = entry.key if isinstance(entry, ApiKeyEntry) else entry
            d = e[len(HASH_PREFIX):].lower() if e.startswith(HASH_PREFIX) else digest(e)
            if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
                raise ValueError(f"an api key entry starting {e[:12]!r}... is sha256: but not 64 hex digits")
            self._digests[d] = owner_of(d)
            if isinstance(entry, ApiKeyEntry):
                self.overrides[owner_of(d)] = entry
        self._metrics = digest(metrics_token) if metrics_token else None

    @classmethod
    def from_config(cls, cfg: FarmConfig, environ: Mapping[str, str] | None = None) -> KeyRing:
        env = os.environ if environ is None else environ
        return cls(_entries(cfg, env), env.get(ENV_METRICS_TOKEN, ""))

    def __len__(self) -> int:
        return len(self._digests)

    def owner(self, key: str) -> str | None:
        """Owner id of `key` if it is configured. The lookup is by digest, so timing reveals nothing
        about the keys (an attacker cannot choose the digest's bytes)."""
        if not key:
            return None
        return self._digests.get(digest(key))

    def is_metrics_token(self, token: str) -> bool:
        return bool(self._metrics and token and hmac.compare_digest(digest(token), self._metrics))


def keys_configured(cfg: FarmConfig, environ: Mapping[str, str] | None = None) -> bool:
    """Whether at least one API key is configured (config or FARM_API_KEYS)."""
    return bool(_entries(cfg, os.environ if environ is None else environ))


def open_api_refusal(cfg: FarmConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """Why an API on `api.host` must not start, or None: reachable from other machines with no key and no
    authenticating proxy declared (`api.allow_unauthenticated`). Without keys the API serves loopback peers only,
    and in a container or pod any local proxy (a mesh sidecar, port-forward) is such a peer for every client.
    `farm up` and the API's gunicorn config both refuse it."""
    host = cfg.api.host
    if host in LOOPBACK_HOSTS or cfg.api.allow_unauthenticated or keys_configured(cfg, environ):
        return None
    return (f"api.host is {host!r} (reachable from other machines) and no API key is set: set "
            "FARM_API_KEYS=key1,key2 (or api.api_keys), or api.allow_unauthenticated: true behind your own "
            "authenticating proxy")


def tenant_cache_salt(owner: str, client_salt: str | None = None) -> str:
    """The cache salt (GenerationRequest.cache_salt) of a generation by `owner`: prefix-cache blocks are
    shared only among requests with the same salt, so one tenant's prompts are never found (cached_tokens,
    the router's overlap, time to first token) by another's. A client's own `cache_salt` (vLLM's request field)
    narrows its tenant's scope and never leaves it: both are hashed together. No salt ("", caches shared as
    before) for the anonymous owner of a farm without API keys that sends none."""
    if owner == OWNER_ANONYMOUS and not client_salt:
        return ""
    scope = hashlib.sha256(f"farm-cache-salt\0{owner}\0{client_salt or ''}".encode())
    return "t-" + scope.hexdigest()[:32]
