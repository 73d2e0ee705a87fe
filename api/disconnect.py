"""Whether the HTTP client of the current request is still connected, asked without reading its data.

A request that waits for its answer reads nothing more from its client, so a client that leaves is noticed
only when the answer is written: a non-streaming request (or a stream still queued) would run to the end on
a worker for nobody. The check peeks at the client's socket instead: readable with no byte to read means
the peer closed it (a reset is an error). gunicorn gives the app that socket as `gunicorn.socket`; under its
gevent worker `select.poll` is cooperative and a zero timeout never waits, so the check never blocks the hub.
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Callable

from flask import request


def client_gone_check() -> Callable[[], bool] | None:
    """A check for the current request's client, or None where the socket is not ours to peek at (the
    Flask test client, other servers, TLS, where a peek would see encrypted records)."""
    sock = request.environ.get("gunicorn.socket")
    if not isinstance(sock, socket.socket) or isinstance(sock, ssl.SSLSocket):
        return None

    def gone() -> bool:
        try:
            poller = select.poll()  # not select.select: it refuses descriptors above 1023
            poller.register(sock, select.POLLIN)
            # readable: EOF, or bytes a client sent ahead (a pipelined request): only EOF means gone
            return bool(poller.poll(0)) and sock.recv(1, socket.MSG_PEEK) == b""
        except ConnectionError:  # reset by the peer
            return True
        except (OSError, ValueError):  # closed on this side, or not pollable: cannot tell, keep serving
            return False

    return gone
