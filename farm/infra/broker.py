"""The farm's Celery application as every process builds it, configured for long, GPU-style generation tasks.

Lower layer: the API and the batch driver publish through it without importing the task modules (which bring the
engine and torch); `tasks/celery_app.py`, the workers' entry point, adds its task modules and the worker-side patches.

- JSON only (never pickle): messages carry token ids and signed handles, never tensors.
- acks_late + reject_on_worker_lost: a request is acknowledged when it finished, so a worker that
  dies mid-request leaves it in the queue for another worker instead of dropping it.
- prefetch multiplier 1: a worker reserves only as many requests as it has task threads; the engine
  inside batches whatever those threads hand it (continuous batching).
- visibility_timeout: Redis redelivers unacked messages after this long, so it is set above the
  longest request a worker will run (config.celery.max_request_s, checked at load).
- socket timeouts and TCP keepalive on the broker's connections (`redis.socket`), as on every redis-py client:
  across a network partition a publish or a consumer's BRPOP fails and reconnects instead of waiting forever.
- The broker is the farm's Redis as farm.infra.redis_client says: `redis.url`, or with `redis.ha` kombu's
  `sentinel://` URLs and the `master_name` to ask the sentinels for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import Celery
from celery.signals import before_task_publish

from farm.config import FarmConfig, get_config
from farm.infra import tracing
from farm.infra.redis_client import celery_broker, socket_options
from farm.protocol import TASK_DECODE, TASK_GENERATE, TASK_PREFILL

_PROMPT_TASKS = frozenset({TASK_PREFILL, TASK_DECODE, TASK_GENERATE})


def _redact_prompt_args(sender: str | None = None, headers: dict[str, Any] | None = None, body: Any = None,
                        **_: Any) -> None:
    """Generation tasks carry the prompt's token ids; Celery copies `argsrepr` into worker logs
    ("received", failures) and task events (Flower). Only the request id goes there instead."""
    if sender not in _PROMPT_TASKS or headers is None:
        return
    try:
        rid = body[0][0]["request_id"]
    except (TypeError, KeyError, IndexError):
        rid = "?"
    headers["argsrepr"] = f"(<request {rid}: prompt not shown>)"
    headers["kwargsrepr"] = "{}"


def send_generation(app: Celery, task: str, args: list[Any], queue: str, **options: Any) -> None:
    """Send a generation task (its first argument is the request message) with the request's id as the task id
    and its redacted argument text given up front: Celery would otherwise repr the prompt's token ids for
    `argsrepr` on every send (about a millisecond for a few hundred ids, thrown away by the redaction above)
    and read the system's random source for a task id."""
    rid = args[0].get("request_id", "?") if args and isinstance(args[0], dict) else "?"
    options.update(task_id=f"{rid}.{task.rsplit('.', 1)[-1]}", argsrepr=f"(<request {rid}: prompt not shown>)",
                   kwargsrepr="{}")
    if not tracing.ENABLED:
        app.send_task(task, args=args, queue=queue, **options)
        return
    # tracing on: a producer span around the publish (one LPUSH on Redis), its W3C context in the message headers
    with tracing.span(f"{task} publish", tracing.PRODUCER, {
            "messaging.system": "celery", "messaging.destination.name": queue, "farm.request_id": rid}):
        options["headers"] = {**options.get("headers", {}), **(tracing.inject() or {})}
        app.send_task(task, args=args, queue=queue, **options)


def celery_settings(cfg: FarmConfig) -> dict[str, Any]:
    """The farm's Celery configuration (Celery's config-object style), for `cfg`."""
    _, transport_options = celery_broker(cfg.redis)
    return {
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "task_ignore_result": True,
        "task_track_started": False,
        "broker_transport_options": {
            "visibility_timeout": cfg.celery.visibility_timeout_s,
            "queue_order_strategy": "priority",
            **socket_options(cfg.redis),  # timeouts and keepalive: a partition from Redis never hangs a process
            **transport_options,
        },
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_default_queue": "farm.default",
        # per-task events cost the consumer a few Redis writes per request; Flower enables them when it runs
        "worker_send_task_events": cfg.celery.task_events,
        "task_send_sent_event": False,  # one PUBLISH per request less on the API's path; workers report the rest
        "worker_hijack_root_logger": False,
        "timezone": "UTC",
    }


def make_celery(cfg: FarmConfig | None = None, include: Sequence[str] = ()) -> Celery:
    """A Celery app for `cfg` (the process configuration by default) that publishes with prompts redacted from
    task headers; `include` names task modules (only the workers' entry point passes any)."""
    cfg = cfg or get_config()
    broker_url, _ = celery_broker(cfg.redis)
    app = Celery("farm", broker=broker_url, backend=None, include=list(include))
    app.conf.update(celery_settings(cfg))
    before_task_publish.connect(_redact_prompt_args, weak=False, dispatch_uid="farm.redact_prompt_args")
    return app


def survive_broker_reconnects() -> None:
    """Celery 5.7's consumer closes the broken connection after a Redis restart; kombu's Redis QoS then
    restores unacked messages (and acks late tasks finishing later) through a connection whose client is
    already gone and raises AttributeError ("'NoneType' object has no attribute 'hostname'"), which Celery
    treats as unrecoverable: the worker stops. Both are logged and dropped here instead: unacked messages
    stay in kombu's index and are restored after the visibility timeout (by any worker), and the claim a
    generation task took (farm:claim) makes that redelivery a no-op, so nothing runs twice. Consumers (the
    workers' and the batch driver's entry points) call it once; it patches kombu's class, idempotently."""
    import logging

    import redis as redis_lib
    from kombu.transport import redis as kombu_redis

    log = logging.getLogger("farm.celery")

    def guarded(name: str):
        original = getattr(kombu_redis.QoS, name)
        if getattr(original, "_farm_safe", False):
            return original

        def method(self, *args, **kwargs):  # noqa: ANN001, ANN202 - kombu's signatures
            try:
                return original(self, *args, **kwargs)
            except (AttributeError, redis_lib.RedisError) as e:
                log.warning("kombu QoS.%s after a broker reconnect failed (%s); left for redelivery", name, e)
                return None

        method._farm_safe = True  # type: ignore[attr-defined]
        return method

    for name in ("ack", "restore_unacked"):
        setattr(kombu_redis.QoS, name, guarded(name))
