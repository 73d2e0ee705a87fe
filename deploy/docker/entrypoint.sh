#!/bin/sh
# Entry point of the Inference Farm images: fills in what only the running container knows, then
# execs the command (so it is PID 1 and gets SIGTERM directly: Celery's warm shutdown, gunicorn's
# graceful stop).
#
# FARM_TRANSFER__ADVERTISE_HOST=auto (the worker image's default) becomes this container's own IP
# address, which the other workers use to pull KV blocks from it. Kubernetes sets the pod IP instead.
set -eu

if [ "${FARM_TRANSFER__ADVERTISE_HOST:-}" = "auto" ]; then
  FARM_TRANSFER__ADVERTISE_HOST="$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')"
  export FARM_TRANSFER__ADVERTISE_HOST
fi

exec "$@"
