"""The API's HTTP server: gunicorn's settings, from the farm configuration.

api/gunicorn_conf.py hands them to gunicorn (every launcher runs `gunicorn -c python:api.gunicorn_conf`; why
gevent and what each setting is for is told there); tests and tools call `settings` for any configuration.
"""

from __future__ import annotations

import json
import logging
import resource
from typing import Any

from farm.config import FarmConfig
from farm.infra.logfiles import gunicorn_logconfig

# Descriptors one connection may need: its socket, and a Redis connection while its stream waits.
FDS_PER_CONNECTION = 2
FDS_SPARE = 512  # Redis pools, the KV-event follower, model files, logs


def settings(cfg: FarmConfig) -> dict[str, Any]:
    """gunicorn's settings (by their config-file names) for the API of `cfg`."""
    api = cfg.api
    return {
        "worker_class": "gevent",
        "workers": 1,  # one process per API replica: the router's KV index and load view live in it
        "worker_connections": api.worker_connections,
        "keepalive": api.header_timeout_s,  # async workers: the deadline for every request head
        "bind": [f"[{api.host}]:{api.port}" if ":" in api.host else f"{api.host}:{api.port}"],
        "timeout": 0,  # no heartbeat kill: a long CPU-bound call (model warm-up) is not a hang
        "graceful_timeout": 30,  # streams in flight get this long on SIGTERM
        "preload_app": False,  # the app is imported only after the worker monkey-patched the standard library
        "accesslog": "-",
        "control_socket_disable": True,  # newer gunicorn's per-user control socket; older ones ignore the name
        **({"logconfig_dict": gunicorn_logconfig(True)} if cfg.logs.format == "json" else {}),  # JSON lines
    }


# gunicorn's answers to a request it cannot parse, by status: the OpenAI error code the API would give
PARSE_ERROR_CODES = {414: "uri_too_long", 431: "headers_too_large", 403: "forbidden", 501: "unsupported_transfer_coding"}


def write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:  # noqa: ANN001 - a socket
    """gunicorn's reply to a request it could not parse (a request line over 4,094 bytes, too many or too large
    headers, a malformed line or chunk) as the OpenAI-style JSON error every other answer of the API is, in place of
    gunicorn's HTML page (`gunicorn.util.write_error`, which the worker calls by that name)."""
    from gunicorn import util

    from farm.openai.api_error import APIError

    code = PARSE_ERROR_CODES.get(status_int, "bad_request" if status_int < 500 else "internal_error")
    body = json.dumps(APIError(status_int, f"{reason}: {mesg}" if mesg else reason, code=code).body()).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    util.write_nonblock(sock, head.encode("latin-1") + body)


def json_parse_errors(worker) -> None:  # noqa: ANN001 - gunicorn's Worker (its post_worker_init hook)
    """In the worker: gunicorn's request-parsing errors answered as JSON (write_json_error)."""
    from gunicorn import util

    util.write_error = write_json_error


def raise_fd_limit(server) -> None:  # noqa: ANN001 - gunicorn's Arbiter (its on_starting hook)
    """Raise the open-files limit so `worker_connections` streams fit (the worker inherits it)."""
    connections = server.cfg.worker_connections
    want = connections * FDS_PER_CONNECTION + FDS_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < want:
        logging.getLogger("gunicorn.error").warning(
            "open-files limit %d (hard) is below the %d that api.worker_connections=%d needs: raise `ulimit -n` "
            "or lower api.worker_connections, or connections beyond ~%d fail", hard, want, connections,
            (new - FDS_SPARE) // FDS_PER_CONNECTION)
