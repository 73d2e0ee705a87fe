"""Celery task names and queues: per model and role, one per worker (the router's placement), and the batch
drivers' queue."""

from __future__ import annotations

import re
from typing import Literal

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")

TASK_PREFILL = "farm.prefill"
TASK_DECODE = "farm.decode"
TASK_GENERATE = "farm.generate"
TASK_PING = "farm.ping"  # the consumer watchdog's probe through a worker's own queue (farm.worker.watchdog)
TASK_RELEASE_KV = "farm.release_kv"  # a decode that will not pull a handle frees its blocks on the prefill worker
TASK_BATCH_DRIVE = "farm.batch.drive"  # drives one batch (farm.batch.driver)
BATCH_QUEUE = "farm.batch"  # consumed only by batch-driver processes (`python -m tasks.batch`)


# kombu's Redis transport keeps priority N (1-9) of queue Q in the list `Q\x06\x16N`, priority 0 in Q itself.
PRIORITY_SEP = "\x06\x16"


def queue_depths(r, queues: list[str]) -> list[int]:
    """Messages waiting in each Celery queue on Redis, summed over its priority lists (one round trip)."""
    pipe = r.pipeline(transaction=False)
    for q in queues:
        pipe.llen(q)
        for pri in range(1, 10):
            pipe.llen(f"{q}{PRIORITY_SEP}{pri}")
    res = pipe.execute()
    return [int(sum(res[i * 10:(i + 1) * 10])) for i in range(len(queues))]


def model_slug(model: str) -> str:
    """A queue-safe form of a model name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", model)


def queue_name(model: str, kind: Literal["prefill", "decode", "generate"]) -> str:
    """Per-model queues: every worker serving `model` in a role consumes the matching queue."""
    return f"farm.{model_slug(model)}.{kind}"


def queues_for_role(model: str, role: Role) -> list[str]:
    if role == "prefill":
        return [queue_name(model, "prefill")]
    if role == "decode":
        return [queue_name(model, "decode")]
    return [queue_name(model, "generate"), queue_name(model, "prefill"), queue_name(model, "decode")]


def direct_queue(worker_id: str) -> str:
    """Each worker also consumes a queue of its own, so a router can place work on it."""
    return "farm.w." + re.sub(r"[^A-Za-z0-9_.@-]+", "_", worker_id)
