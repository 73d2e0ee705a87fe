"""gunicorn settings of the API, from the farm configuration: the one place every launcher takes them from.

    gunicorn -c python:api.gunicorn_conf 'api.app:create_app()'

`farm up`, the Procfile, the Docker image, docker-compose and the Helm chart all run exactly that, so the
server is the same everywhere and is configured through `api.*` (config/default.yaml, FARM_API__*).

Why gevent: an open stream spends most of its life waiting for tokens on Redis. gunicorn's gthread worker
gave each one a thread (64 streams per process, and 64 clients sending their headers slowly took the API
down); the gevent worker gives each connection a greenlet, so thousands of streams fit in one process and a
connection that dribbles its headers costs memory, not service. The worker monkey-patches the standard
library (sockets, select, threading, time.sleep) before it imports the app, which makes redis-py, kombu and
the Flask app cooperative. CPU-bound calls that would stall every stream meanwhile run on gevent's thread
pool (farm.infra.cooperative). `header_timeout_s` becomes gunicorn's keep-alive timeout, which its async workers
apply to reading every request head, the first one included: a client that has not sent its complete head
by then is disconnected (a slowloris client holds a connection for seconds, not forever). The body has a
deadline of its own (`api.body_timeout_s`), kept by the app (api/admission.py): gunicorn has none.

This module runs in gunicorn's master, which gevent does not patch: it must import nothing the request path
uses (redis-py, for one, binds `time.sleep` at import for its retry backoff; imported here, an unpatched
sleep would freeze every stream while Redis is down). The configuration modules it loads are checked for
that by tests/security/test_api_connections.py. Command-line flags still override what is set here (the
Helm chart passes --graceful-timeout).
"""

from __future__ import annotations

from api.server import json_parse_errors, raise_fd_limit, settings
from farm.config import ConfigError, get_config
from farm.infra.filemodes import private_umask
from farm.tenancy.api_keys import open_api_refusal

if why := open_api_refusal(get_config()):  # as `farm up` refuses it, for every launcher (the image, the chart)
    raise ConfigError(why)
private_umask()  # batch files the API writes, and anything else, are the farm user's alone (the worker inherits it)
globals().update(settings(get_config()))  # gunicorn reads its settings from this module's attributes
on_starting = raise_fd_limit
post_worker_init = json_parse_errors  # a request gunicorn cannot parse gets a JSON error, not an HTML page
