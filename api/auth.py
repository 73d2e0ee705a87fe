"""Who is asking, and may they: Bearer API keys, the no-key loopback rule, per-key limits.

Rules (checked before every request, in this order):
- `/health`, `/health/live`, `/health/ready`, `/openapi.json` and `/version` are public (probes, clients' code
  generators, vLLM clients checking the server).
- With API keys configured, every other route needs `Authorization: Bearer <key>` (or Anthropic's
  `x-api-key: <key>`, which its SDKs send); else 401 `invalid_api_key`. `/metrics` takes `FARM_METRICS_TOKEN`
  (a scrape token that is not an API key), or nothing when `api.metrics_public` is true, but not an API key (403):
  its series count every tenant's requests, which one tenant must not read.
- With no key configured the farm is a local tool: only loopback clients are served, anyone else
  gets 401, unless `api.allow_unauthenticated` is true (an authenticating proxy in front).
  `farm up` also refuses a non-local `api.host` without keys, so this is a second line.
- Per-key requests in progress in this process (api.admission, `api.limits.max_concurrent_requests`): a
  slot is taken right after the key is checked, before the body is read; over the cap: 429 at once.
- Per-key request-rate limit and token quota (farm.tenancy.quota; `api.limits`, or a key's own in its
  `api.api_keys` entry) on `/v1/*` and vLLM's `/tokenize` and `/detokenize`: 429 `rate_limit_exceeded` /
  `insufficient_quota` with `Retry-After`. The token quota is checked only by routes that spend tokens, and a
  generation reserves the most it can use (`reserve_tokens`) before it is queued; /v1/embeddings reserves its
  inputs' tokens before it embeds them.

The owner id (farm.tenancy.api_keys.owner_of) is what files and batches are recorded under.
"""

from __future__ import annotations

import ipaddress

from flask import Flask, current_app, g, has_app_context, request

from api.admission import admit
from farm.openai.api_error import APIError
from farm.tenancy.api_keys import OWNER_ANONYMOUS, KeyRing, tenant_cache_salt
from farm.tenancy.quota import Limiter, Refusal, Reservation

PUBLIC_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/openapi.json", "/version"})
# vLLM's routes outside /v1 that count against the request-rate limit as /v1 routes do (and the Semantic Router's
# classification API, under /api/v1)
LIMITED_PATHS = frozenset({"/tokenize", "/detokenize"})
METRICS_PATH = "/metrics"
# endpoints whose requests spend tokens: the token quota is checked before them
GENERATING_ENDPOINTS = frozenset({"openai.chat_completions", "openai.completions", "messages.create_message",
                                  "batches.create_batch", "embeddings.create_embeddings"})


class Auth:
    """The key ring and limiter of one API process."""

    def __init__(self, app: Flask):
        farm = app.extensions["farm"]
        self.cfg = farm.cfg
        self.keys = KeyRing.from_config(farm.cfg)
        self.limiter = Limiter(farm.redis, farm.cfg.api.limits, self.keys.overrides)


def _auth() -> Auth:
    return current_app.extensions["farm_auth"]


def current_owner() -> str:
    """The owner id of this request's key (anonymous when the farm has no keys)."""
    return g.get("farm_owner", OWNER_ANONYMOUS)


def request_scope(client_salt: object = None) -> str:
    """What this request may share with others: its KV cache salt, from its key's owner and the client's own
    `cache_salt` (a string; anything else is refused later by the request's parse). The prefix caches, the
    semantic layer's memo and cache and MoM's look at the KV index all keep to it, so neither another key nor
    another end user of the same key (by cache_salt) can learn what was sent."""
    return tenant_cache_salt(current_owner(), client_salt if isinstance(client_salt, str) else None)


def request_tenant() -> str:
    """The cache salt of this request's key's owner alone ("" for a keyless farm's one tenant, and outside a
    request): what the owner's shares of shared caches are counted by, whatever `cache_salt` its clients send."""
    return tenant_cache_salt(current_owner()) if has_app_context() else ""


def reserve_tokens(tokens: int, least: int) -> Reservation:
    """Hold up to `tokens` (a generation's prompt plus n x max_tokens) of the caller's token quota until the
    generation ends (`Reservation.settle`): all of them, or what is left when that is at least `least` (the prompt
    and one token per choice); 429 insufficient_quota when not even that is left."""
    auth = _auth()
    got = auth.limiter.reserve(current_owner(), tokens, least)
    if isinstance(got, Refusal):
        raise APIError(429, f"You exceeded your token quota: Limit {got.limit}, Used {got.used} (prompt + completion "
                       f"tokens per {auth.limiter.limits.token_quota_window_s}s); what is left does not cover this "
                       f"request's prompt. The quota renews in {got.retry_after_s}s.", type="insufficient_quota",
                       code="insufficient_quota", headers={"Retry-After": str(got.retry_after_s)})
    return got


def _bearer() -> str:
    """The key of `Authorization: Bearer <key>`, else of `x-api-key: <key>` (Anthropic's header)."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return request.headers.get("x-api-key", "").strip()


def _is_loopback(addr: str | None) -> bool:
    try:
        ip = ipaddress.ip_address((addr or "").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def unauthorized(message: str) -> APIError:
    """401 as OpenAI sends it (type invalid_request_error, code invalid_api_key)."""
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="inference-farm"'})


def _check() -> None:
    path = request.path
    if path in PUBLIC_PATHS:
        return
    auth = _auth()
    token = _bearer()
    if path == METRICS_PATH and (auth.cfg.api.metrics_public or auth.keys.is_metrics_token(token)):
        return
    if len(auth.keys):
        owner = auth.keys.owner(token)
        if owner is None:
            if not token:
                raise unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                                 "(or 'x-api-key: <key>').")
            raise unauthorized("Incorrect API key provided.")
        if path == METRICS_PATH:
            raise APIError(403, "An API key does not open /metrics: its series count every tenant's requests "
                           "(categories, guard blocks, cache hits). Scrape it with FARM_METRICS_TOKEN.",
                           type="invalid_request_error", code="permission_denied")
        g.farm_owner = owner
        admit(owner)  # requests in progress per key: before the body is read (slow bodies, api/admission.py)
    elif path == METRICS_PATH and not _is_loopback(request.remote_addr):  # allow_unauthenticated or not
        raise unauthorized("/metrics serves only local clients here: scrape it with FARM_METRICS_TOKEN (or set "
                           "api.metrics_public).")
    elif not auth.cfg.api.allow_unauthenticated and not _is_loopback(request.remote_addr):
        raise unauthorized("This farm has no API keys configured and serves only local clients: set "
                           "FARM_API_KEYS on the server (or api.allow_unauthenticated behind a proxy).")
    if path.startswith(("/v1/", "/api/v1/")) or path in LIMITED_PATHS:
        _limit(auth, current_owner())


def count_requests(n: int, param: str) -> None:
    """Count `n` more requests of this request's owner against the request-rate limit, or raise its 429 and give
    back the one `_check` counted: what a batch of items (`param`) adds to its own request. A batch larger than
    the whole limit could never pass: a 400 says so."""
    if n <= 0:
        return
    auth, owner = _auth(), current_owner()
    rpm = auth.limiter.limits_of(owner)[0]
    try:
        if rpm and n + 1 > rpm:
            raise APIError(400, f"This batch of {n + 1} is more than this API key's limit of {rpm} requests per "
                                f"minute (each item counts as one request): send at most {rpm} at a time.",
                           param=param, code="batch_over_rate_limit")
        _limit(auth, owner, count=n, check_quota=False)
    except APIError:
        auth.limiter.uncount(owner, 1)
        raise


def _limit(auth: Auth, owner: str, count: int = 1, check_quota: bool | None = None) -> None:
    if check_quota is None:
        check_quota = request.endpoint in GENERATING_ENDPOINTS
    refusal = auth.limiter.admit(owner, check_quota=check_quota, count=count)
    if refusal is None:
        return
    headers = {"Retry-After": str(refusal.retry_after_s)}
    if refusal.kind == "rate":
        raise APIError(429, f"Rate limit reached for requests per minute (RPM): Limit {refusal.limit}, Used "
                       f"{refusal.used}. Please try again in {refusal.retry_after_s}s.", type="requests",
                       code="rate_limit_exceeded", headers=headers)
    raise APIError(429, f"You exceeded your token quota: Limit {refusal.limit}, Used {refusal.used} (prompt + "
                   f"completion tokens per {auth.limiter.limits.token_quota_window_s}s). The quota renews in "
                   f"{refusal.retry_after_s}s.", type="insufficient_quota", code="insufficient_quota",
                   headers=headers)


def install(app: Flask) -> None:
    """Check every request of `app` (keys are read once, at app creation)."""
    app.extensions["farm_auth"] = Auth(app)
    app.before_request(_check)
