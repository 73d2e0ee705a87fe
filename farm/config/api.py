"""The `api` section (HTTP server, keys, limits, Host/CORS policy) and `flower`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from farm.config.base import Section

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})  # a listener on these is reached from this machine only


class ApiLimitsConfig(Section):
    """Per API key (each key on its own), held in Redis so every API replica enforces the same count."""

    requests_per_minute: int = Field(0, ge=0)  # fixed 60 s windows; 0 = unlimited
    token_quota: int = Field(0, ge=0)  # prompt + completion tokens per key per window; 0 = unlimited
    token_quota_window_s: int = Field(86400, ge=1)
    # Requests in progress per key in one API process (counted in memory, not in Redis), checked after the key
    # and before the body is read; over it: 429 at once. "auto" = half of api.worker_connections, so one key
    # never holds every connection; 0 = unlimited. Applies only with API keys (without, there is one tenant).
    max_concurrent_requests: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"


class ApiKeyEntry(Section):
    """One API key with its own limits (replacing `api.limits`' for this key; unset ones are inherited)."""

    key: str = Field(min_length=1)  # the key itself, or "sha256:<hex>" of it (keeps the file free of secrets)
    requests_per_minute: int | None = Field(None, ge=0)
    token_quota: int | None = Field(None, ge=0)


class ApiConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    # gunicorn's gevent worker: the most connections one API process holds at once (an open stream is a
    # greenlet and, while it waits for tokens, one Redis connection: keep the sum over API processes under
    # Redis's maxclients, 10000 by default). Further clients wait in the listen backlog.
    worker_connections: int = Field(4096, ge=1, le=100_000)
    # Seconds a client has to send a complete request head (and a keep-alive connection may sit idle);
    # then the connection is closed: slow-header (slowloris) clients cannot hold connections for long.
    header_timeout_s: int = Field(10, ge=1, le=3600)
    # Seconds a client has to send a request body after its head, plus one second per `body_min_rate` bytes
    # it sent (a large upload at a fair rate is not cut), and the longest wait for its next bytes; then 408
    # and the connection is closed: slow-body clients cannot hold connections for long (api/admission.py).
    body_timeout_s: int = Field(30, ge=1, le=3600)
    body_min_rate: int = Field(16384, ge=0)  # bytes per second; 0 = the body must arrive within body_timeout_s
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    request_timeout_s: float = Field(600, gt=0)
    first_event_timeout_s: float = Field(300, gt=0)
    # API keys (Bearer): plain keys or "sha256:<hex>", or {key, requests_per_minute, token_quota} for a key
    # with its own limits; FARM_API_KEYS (comma-separated) adds more, with `limits` (api/auth.py).
    api_keys: list[str | ApiKeyEntry] = Field(default_factory=list)
    # Without keys only loopback clients are served (and `farm up` refuses a non-local api.host);
    # true serves everyone without a key (only behind your own authenticating proxy).
    allow_unauthenticated: bool = False
    metrics_public: bool = False  # /metrics without a key or FARM_METRICS_TOKEN from other hosts
    limits: ApiLimitsConfig = ApiLimitsConfig()
    # Host header names served besides loopback and api.host ("*": any); anything else is 400 (DNS rebinding).
    allowed_hosts: list[str] = Field(default_factory=list)
    # Browser origins allowed to call the API (CORS), e.g. "https://app.example.com"; none by default.
    cors_allowed_origins: list[str] = Field(default_factory=list)
    # A prompt longer than max_model_len x this many characters is refused before it is tokenized;
    # 0 = the tokenizer's longest vocabulary entry (an exact bound: no prompt that fits is refused).
    max_chars_per_token: int = Field(0, ge=0)
    # How long /v1/responses keeps a response created with `store` (default true) in Redis: readable by its
    # owner, and continued by `previous_response_id`, for this long (7 days; each one holds its conversation).
    responses_ttl_s: int = Field(7 * 86400, ge=60)
    # what one API key's stored responses may hold (until they expire or it deletes them): past either, a
    # /v1/responses request that would store one is a 400 (store: false still answers)
    responses_owner_max_mb: int = Field(64, ge=1)
    responses_owner_max: int = Field(10_000, ge=1)

    def max_concurrent_per_key(self) -> int:
        """`limits.max_concurrent_requests` resolved: "auto" is half of `worker_connections`; 0 = unlimited."""
        cap = self.limits.max_concurrent_requests
        return max(1, self.worker_connections // 2) if cap == "auto" else cap

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "threads" in data:
            raise ValueError("api.threads was removed: the API runs on gunicorn's gevent worker, where an open "
                             "stream costs memory, not a thread; set api.worker_connections (the most connections "
                             "one API process holds) instead")
        return data

    @field_validator("allowed_hosts", "cors_allowed_origins", mode="before")
    @classmethod
    def _comma_list(cls, v: Any) -> Any:
        """FARM_API__ALLOWED_HOSTS=a.example,b.example works as well as a YAML list."""
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v


class FlowerConfig(Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(5555, ge=1, le=65535)
