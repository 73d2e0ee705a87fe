"""The batch-driver process: `python -m tasks.batch [--name batch-1] [--concurrency 8]`.

A Celery worker (thread pool) that consumes only the `farm.batch` queue: each `farm.batch.drive` task
drives one batch through the farm's Gateway (farm.batch.driver explains the scheduling and why batch
work stays below interactive traffic). It loads no model, only tokenizers to validate input files, so it
is cheap to run beside the API; run one or more (they share the work through leases in Redis). Each
process also runs a reaper that re-sends active batches whose driver died, so a batch survives the
loss of its driver: the task is acked late and every (re)delivery resumes from Redis. SIGTERM is a warm
shutdown: drivers stop dispatching, give in-flight lines `batch.shutdown_grace_s`, and hand their
batches back to the queue.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from farm.infra.broker import make_celery, survive_broker_reconnects
from farm.protocol import BATCH_QUEUE, TASK_BATCH_DRIVE

# Its own app: the batch driver consumes only farm.batch and must not import the generation tasks (the engine, torch).
app = make_celery(include=["tasks.batch"])
survive_broker_reconnects()

log = logging.getLogger("farm.batch")

def get_driver():
    """This process's BatchDriver, kept in farm.batch.driver (so `python -m tasks.batch`, whose module is
    __main__, and the `tasks.batch` Celery imports share one), created on first use."""
    from farm.batch.driver import get_driver as _get

    return _get(app)


@app.task(name=TASK_BATCH_DRIVE, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def drive(batch_id: str) -> str:
    return get_driver().drive(batch_id)


def main(argv: list[str] | None = None) -> int:
    from farm.config import ConfigError, get_config
    from farm.infra.logfiles import configure_logging

    p = argparse.ArgumentParser(prog="python -m tasks.batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default=None, help="Celery hostname (default: batch@<hostname>)")
    p.add_argument("--concurrency", type=int, default=None, help="batches driven at once (default: config)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve farm_batch_* metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics port listens on (0.0.0.0 in a pod, for Prometheus)")
    p.add_argument("--loglevel", default="INFO")
    args = p.parse_args(argv)
    try:
        cfg = get_config()
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    name = args.name or f"batch@{socket.gethostname()}"
    if "@" not in name:
        name = f"{name}@{socket.gethostname()}"
    configure_logging(args.loglevel, cfg.logs.format == "json")  # text, or JSON lines (logs.format)
    from farm.infra import tracing

    tracing.setup("farm-batch", worker=name)  # on when OTEL_EXPORTER_OTLP_* is set: each line's request a trace
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)
    from celery import signals

    driver = get_driver()

    @signals.worker_ready.connect(weak=False)
    def _ready(**_kw) -> None:
        driver.reap()  # batches left by a driver that died are picked up at once
        driver.start_reaper()

    @signals.worker_shutting_down.connect(weak=False)
    def _stopping(**_kw) -> None:
        driver.stop()

    app.worker_main([
        "worker", "--pool", "threads", "--concurrency", str(args.concurrency or cfg.batch.driver_concurrency),
        "--queues", BATCH_QUEUE, "--hostname", name, "--without-gossip", "--without-mingle",
        *(["--task-events"] if cfg.celery.task_events else []),
        "--loglevel", args.loglevel,
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
