"""Start one farm worker process: `python -m tasks.worker --role prefill --model NAME --name ID`.

It is a Celery worker with a thread pool: task threads hand requests to one in-process engine that
batches them all (continuous batching); the model is loaded once, before the worker consumes anything,
and the worker registers itself (role, model, KV transfer endpoint) only once it is ready. SIGTERM is
Celery's warm shutdown: the worker leaves routing at once (no new placements, its heartbeat stays so
its requests are not migrated), stops taking tasks and waits for the running requests to finish.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from celery import signals
from kombu import Exchange, Queue

from farm.config import ConfigError, get_config
from farm.infra import logcontext, tracing
from farm.infra.gc_heap import freeze_startup_heap
from farm.infra.logfiles import configure_logging
from farm.protocol import ROLES, queues_for_role
from farm.protocol.queues import direct_queue

log = logging.getLogger("farm.worker")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="farm worker", description=__doc__)
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--model", default=None, help="model name from config (default: default_model)")
    p.add_argument("--name", default=None, help="worker id (default: <role>@<hostname>)")
    p.add_argument("--concurrency", type=int, default=None, help="task threads (default: config)")
    p.add_argument("--loglevel", default="INFO")
    args = p.parse_args(argv)
    try:
        cfg = get_config()
        model = args.model or cfg.default_model
        cfg.model(model)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except KeyError:
        print(f"unknown model {args.model!r}; configured: {[m.name for m in cfg.models]}", file=sys.stderr)
        return 2
    name = args.name or f"{args.role}@{socket.gethostname()}"
    if "@" not in name:
        name = f"{name}@{socket.gethostname()}"

    configure_logging(args.loglevel, cfg.logs.format == "json")  # text, or JSON lines (logs.format)
    quiet_per_task_logs(args.loglevel)  # the runtime writes one line per request instead
    logcontext.set_process_fields(worker=name, model=model)  # in every log line of this process
    tracing.setup("farm-worker", worker=name, role=args.role, model=model)  # on when OTEL_EXPORTER_OTLP_* is set
    from farm.worker import task_context
    from farm.worker.runtime import WorkerRuntime, set_runtime
    from tasks.celery_app import app

    task_context.install()  # each task's request id (and trace span) on its thread while it runs

    # Load the model and run the start-up checks (block size, model files) before Celery starts, so a
    # worker that cannot serve exits with a clear error instead of consuming tasks it would fail.
    try:
        runtime = WorkerRuntime(cfg, args.role, model, name, celery_app=app)
    except Exception as e:  # noqa: BLE001 - any start-up failure ends the process, loudly
        log.critical("worker %s cannot start: %s", name, e)
        print(f"farm worker {name}: cannot start: {e}", file=sys.stderr)
        return 3
    set_runtime(runtime)
    runtime.concurrency = args.concurrency or cfg.celery.worker_threads

    @signals.worker_shutting_down.connect(weak=False)
    def _drain(**_kw) -> None:
        runtime.drain()  # leave routing at once; stay alive until the requests in flight finish

    @signals.worker_ready.connect(weak=False)
    def _start_runtime(**_kw) -> None:
        freeze_startup_heap()  # the engine and Celery are loaded: full collections skip them from now on
        runtime.start()  # registers the worker: routers may place work on it from now on

    @signals.worker_shutdown.connect(weak=False)
    def _stop_runtime(**_kw) -> None:
        from farm.worker.runtime import _runtime

        if _runtime is not None:
            _runtime.stop()
            set_runtime(None)

    shared, own = queues_for_role(model, args.role), direct_queue(name)
    app.conf.task_queues = [*(Queue(q, Exchange(q), routing_key=q) for q in shared), own_queue(own)]
    app.worker_main([
        "worker", "--pool", "threads", "--concurrency", str(args.concurrency or cfg.celery.worker_threads),
        "--queues", ",".join([*shared, own]), "--hostname", name,
        "--without-gossip", "--without-mingle", *(["--task-events"] if cfg.celery.task_events else []),
        "--loglevel", args.loglevel,
    ])
    return 0


# Celery's INFO lines for every task: "received", and "succeeded in 0.003s" once the request is in the engine, which
# says nothing of how the request went. Two formatted writes per request on the worker's hot path; shown at DEBUG.
# The runtime's own line when the engine is done with a request (farm.worker.runtime) carries the same context.
PER_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace")


def quiet_per_task_logs(loglevel: str) -> None:
    """Celery's per-task lines only when the worker logs at DEBUG (a failed task is still logged: an error)."""
    level = logging.getLevelName(loglevel.upper())
    if not isinstance(level, int) or level > logging.DEBUG:
        for name in PER_TASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def own_queue(name: str) -> Queue:
    """The worker's own queue, where the router places its requests, consumed without kombu's acknowledgements.

    On Redis kombu emulates them: every message is copied into an `unacked` hash when taken and removed when
    acknowledged, two transactions per request on the consumer's thread, so that a message whose consumer died
    comes back after the visibility timeout (an hour). A generation task is acknowledged once its request is in
    the engine, milliseconds later, and the request's reader re-places a request whose worker died long before
    that hour (farm.gateway.submission: migration, `router.placement_timeout_s`), while the stage's claim keeps a
    redelivery from running twice. So the copy bought nothing here. The model's shared queues keep it, and with it
    the prefetch limit that keeps one worker from taking a whole shared queue."""
    return Queue(name, Exchange(name), routing_key=name, no_ack=True)


if __name__ == "__main__":
    sys.exit(main())
