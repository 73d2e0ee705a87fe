"""The farm's Celery application as every process builds it, configured for long, GPU-style generation tasks.

Lower layer: the API and the batch driver publish through it without importing the task modules (which bring the
engine and torch); `tasks/celery_app.py`, the workers' entry point, adds its task modules and the worker-side patches.

- JSON only (never pickle): messages carry token ids and signed handles, never tensors.
- acks_late + reject_on_worker_lost: a task is acknowledged when it returned (a generation task once its request is
  in the engine), so a message whose worker died before that is not dropped. A worker's own queue, where the router
  places requests, is consumed without acknowledgements (tasks/worker.py `own_queue` says why: the request's reader
  re-places a request whose worker died).
- prefetch multiplier 1: from the model's shared queues a worker reserves only as many requests as it has task
  threads (its own queue's requests were placed on it: it takes them as they come); the engine inside batches
  whatever the task threads hand it (continuous batching).
- visibility_timeout: Redis redelivers unacked messages after this long, so it is set above the
  longest request a worker will run (config.celery.max_request_s, checked at load).
- socket timeouts and TCP keepalive on the broker's connections (`redis.socket`), as on every redis-py client:
  across a network partition a publish or a consumer's BRPOP fails and reconnects instead of waiting forever.
- The broker is the farm's Redis as farm.infra.redis_client says: `redis.url`, or with `redis.ha` kombu's
  `sentinel://` URLs and the `master_name` to ask the sentinels for.
- Generation tasks, one or more per request, are published by `TaskPublisher`: the very message Celery's
  `send_task` puts on the queue's Redis list (Celery's task protocol 2 in kombu's Redis envelope), written with one
  LPUSH on the process's own Redis client (119 us of CPU per send against Celery's 379, measured alone; end to end
  on bench/engine_speed no gain could be told from the noise, bench/RESULTS.md); the workers consume it as any
  Celery message (tests/test_broker.py holds the two shapes equal).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid
from collections.abc import Sequence
from typing import Any

import redis
from celery import Celery

from farm.config import FarmConfig, get_config
from farm.infra import tracing
from farm.infra.redis_client import celery_broker, socket_options

# kombu's Redis transport: a priority above 0 goes to its own list, `<queue>` + SEP + the priority step (kombu's
# Channel.sep and priority_steps), which consumers poll after the plain one (queue_order_strategy "priority")
PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = (0, 3, 6, 9)


def priority_queue_key(queue: str, priority: int) -> str:
    """The Redis list kombu keeps `queue`'s messages of `priority` in (0 first, 9 last)."""
    step = max(s for s in PRIORITY_STEPS if s <= max(0, priority))
    return f"{queue}{PRIORITY_SEP}{step}" if step else queue


def _request_id(args: list[Any]) -> str:
    """The request id of a generation task's arguments (its first is the request message)."""
    return args[0].get("request_id", "?") if args and isinstance(args[0], dict) else "?"


class TaskPublisher:
    """Publishes generation tasks as Celery would, without its per-call machinery: one JSON envelope and one LPUSH.

    The message is Celery's task protocol 2 (headers, `[args, kwargs, embed]` body) inside kombu's Redis envelope
    (base64 body, delivery info and tag), with the request's id as the task id and the prompt left out of the
    argument text that Celery copies into logs and task events. `priority` (0-9, kombu's steps) is the batch
    driver's low priority for its lines."""

    def __init__(self, r: redis.Redis, priority: int = 0):
        self.r = r
        self.priority = priority
        self.origin = f"gen{os.getpid()}@{socket.gethostname()}"  # Celery's anonymous node name of a publisher
        self.reply_to = str(uuid.uuid4())

    def message(self, task: str, args: list[Any], queue: str, headers: dict[str, Any] | None = None) -> str:
        """The Redis list entry of one task (what kombu's Redis transport LPUSHes for Celery's send_task)."""
        rid = _request_id(args)
        task_id = f"{rid}.{task.rsplit('.', 1)[-1]}"
        argsrepr = f"(<request {rid}: prompt not shown>)"
        body = json.dumps([args, {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
        return json.dumps({
            "body": base64.b64encode(body.encode()).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {
                "lang": "py", "task": task, "id": task_id, "shadow": None, "eta": None, "expires": None,
                "group": None, "group_index": None, "retries": 0, "timelimit": [None, None], "root_id": task_id,
                "parent_id": None, "argsrepr": argsrepr, "kwargsrepr": "{}", "origin": self.origin,
                "ignore_result": None, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {},
                **(headers or {}),
            },
            "properties": {
                "correlation_id": task_id, "reply_to": self.reply_to, "argsrepr": argsrepr, "kwargsrepr": "{}",
                "delivery_mode": 2, "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": self.priority, "body_encoding": "base64", "delivery_tag": str(uuid.uuid4()),
            },
        })

    def send(self, task: str, args: list[Any], queue: str, headers: dict[str, Any] | None = None) -> None:
        self.r.lpush(priority_queue_key(queue, self.priority), self.message(task, args, queue, headers))


def send_generation(publisher: TaskPublisher, task: str, args: list[Any], queue: str) -> None:
    """Send a generation task (its first argument is the request message); with tracing on, inside a producer span
    whose W3C context travels in the message's headers."""
    if not tracing.ENABLED:
        publisher.send(task, args, queue)
        return
    rid = _request_id(args)
    with tracing.span(f"{task} publish", tracing.PRODUCER, {
            "messaging.system": "celery", "messaging.destination.name": queue, "farm.request_id": rid}):
        publisher.send(task, args, queue, tracing.inject() or None)


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
    """A Celery app for `cfg` (the process configuration by default); `include` names task modules (only the
    workers' entry point passes any). Generation tasks are not sent through it but through `TaskPublisher`."""
    cfg = cfg or get_config()
    broker_url, _ = celery_broker(cfg.redis)
    app = Celery("farm", broker=broker_url, backend=None, include=list(include))
    app.conf.update(celery_settings(cfg))
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


def ack_only_copied_messages() -> None:
    """kombu acknowledges a message on Redis by removing its copy from the `unacked` index (ZREM and HDEL, one
    round trip on the task's thread) even when it was consumed without acks and never copied there: a worker's own
    queue (tasks/worker.py `own_queue`), where every generation task arrives. Such an acknowledgement is skipped:
    a message is copied exactly when kombu's QoS records it as delivered (`QoS.append`), so one it does not know
    has nothing to remove. It was about a tenth of a vLLM worker's samples on one-token requests (py-spy,
    bench/RESULTS.md). Workers call it once; it patches kombu's class, idempotently."""
    from kombu.transport import redis as kombu_redis

    original = kombu_redis.QoS.ack
    if getattr(original, "_farm_copied_only", False):
        return

    def ack(self, delivery_tag):  # noqa: ANN001, ANN202 - kombu's signature
        if delivery_tag not in self._delivered:
            return None  # consumed without acks: nothing in kombu's index
        return original(self, delivery_tag)

    ack._farm_copied_only = True  # type: ignore[attr-defined]
    kombu_redis.QoS.ack = ack
