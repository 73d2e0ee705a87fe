"""Which names and browser origins may reach the API: the Host allow-list and CORS.

Checked before authentication, on every route:
- **Host** (DNS rebinding): a web page can make its own name resolve to 127.0.0.1 and then talk to a
  local farm as same-origin. Such a request still carries the page's name in `Host`, so a Host that is
  not loopback, `api.host` (with a wildcard bind: this machine's hostname and addresses) or listed in
  `api.allowed_hosts` gets 400 `invalid_host`. `"*"` in `api.allowed_hosts` turns the check off.
- **Origin** (cross-site requests): browsers send `Origin` on cross-origin requests. Only origins in
  `api.cors_allowed_origins` get CORS headers (none by default, so no page can read an answer), and a
  state-changing request (POST, DELETE, ...) from any other origin is refused with 403
  `origin_not_allowed`, since some (a form upload, a cancel) need no CORS preflight to be sent.
  Preflights (`OPTIONS` + `Access-Control-Request-Method`) from allowed origins are answered here,
  before the API-key check, as browsers send them without credentials.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from flask import Flask, Response, current_app, request

from farm.config import ApiConfig
from farm.openai.api_error import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
PREFLIGHT_MAX_AGE_S = 600


def host_name(host: str) -> str:
    """The name in a Host header: no port, no IPv6 brackets, lower case, no trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def this_machine_names() -> set[str]:
    """This machine's hostname and every address of its interfaces (what a wildcard bind is reached by)."""
    names = {socket.gethostname().lower()}
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            names.update(a.address.split("%", 1)[0].lower() for a in addrs
                         if a.family in (socket.AF_INET, socket.AF_INET6))
    except (ImportError, OSError):
        pass
    return names


def _origin_key(origin: str) -> str:
    """scheme://host[:port], lower case, the form browsers send in Origin."""
    return origin.strip().rstrip("/").lower()


class HttpPolicy:
    def __init__(self, cfg: ApiConfig):
        self.any_host = "*" in cfg.allowed_hosts
        self.hosts = set(LOOPBACK_NAMES) | {host_name(h) for h in cfg.allowed_hosts}
        if cfg.host in WILDCARD_BINDS:
            self.hosts |= this_machine_names()
        else:
            self.hosts.add(host_name(cfg.host))
        self.any_origin = "*" in cfg.cors_allowed_origins
        self.origins = {_origin_key(o) for o in cfg.cors_allowed_origins if o != "*"}

    def host_allowed(self, host: str) -> bool:
        name = host_name(host)
        return self.any_host or name in self.hosts or name.endswith(".localhost")

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or _origin_key(origin) in self.origins

    @staticmethod
    def same_origin(origin: str, host: str) -> bool:
        try:
            return urlsplit(origin).netloc.lower() == host.strip().lower()
        except ValueError:
            return False


def _policy() -> HttpPolicy:
    return current_app.extensions["farm_http_policy"]


def _check() -> Response | None:
    policy = _policy()
    if not policy.host_allowed(request.host):
        raise APIError(400, f"The Host header {request.host[:100]!r} names no host this farm serves (add it to "
                       "api.allowed_hosts).", param="Host", code="invalid_host")
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    allowed = policy.origin_allowed(origin)
    if allowed and request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        resp = Response(status=204)
        resp.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
        resp.headers["Access-Control-Allow-Headers"] = request.headers.get(
            "Access-Control-Request-Headers", "Authorization, Content-Type")
        resp.headers["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE_S)
        return resp
    if not allowed and request.method not in SAFE_METHODS and not policy.same_origin(origin, request.host):
        raise APIError(403, f"Requests from the origin {origin[:100]!r} are not allowed (api.cors_allowed_origins).",
                       param="Origin", code="origin_not_allowed")
    return None


def _cors_headers(resp: Response) -> Response:
    origin = request.headers.get("Origin")
    if origin is not None and _policy().origin_allowed(origin):
        resp.headers["Access-Control-Allow-Origin"] = "*" if _policy().any_origin else origin
        resp.headers["Access-Control-Expose-Headers"] = "*"
        resp.vary.add("Origin")
    return resp


def install(app: Flask) -> None:
    """Check every request of `app` (before authentication) and add CORS headers for allowed origins."""
    app.extensions["farm_http_policy"] = HttpPolicy(app.extensions["farm"].cfg.api)
    app.before_request(_check)
    app.after_request(_cors_headers)
