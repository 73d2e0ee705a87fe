"""Contracts that cross processes: queue names, Redis keys, the request message, stream events.

Everything here travels as JSON (Celery's only serializer in the farm) and is small: token ids and
sampling parameters go through the broker, KV tensors never do (only signed handles to them).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")

# --- Celery task names and queues -------------------------------------------------------------
TASK_PREFILL = "farm.prefill"
TASK_DECODE = "farm.decode"
TASK_GENERATE = "farm.generate"
TASK_PING = "farm.ping"  # the consumer watchdog's probe through a worker's own queue (farm.reliability)
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


# --- Redis keys ---------------------------------------------------------------------------------
def stream_key(request_id: str) -> str:
    """Redis Stream of events for one request (worker -> API)."""
    return f"farm:out:{request_id}"


def cancel_key(request_id: str) -> str:
    """Set by the API when the client went away; workers abort the request when they see it."""
    return f"farm:cancel:{request_id}"


def lease_key(request_id: str) -> str:
    """Kept alive by the API reading the request's stream; a worker aborts a leased request whose lease
    lapsed (the API died: nobody reads), and skips a redelivered one."""
    return f"farm:lease:{request_id}"


def migration_id(request_id: str, attempt: int) -> str:
    """The request id of the `attempt`-th migration of a request (own stream, claims, lease)."""
    return f"{request_id}.m{attempt}"


STREAM_TTL_S = 600
CANCEL_TTL_S = 600


# --- the request message --------------------------------------------------------------------------
@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class GenerationRequest:
    """What the API sends to workers (as a dict through Celery)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    decode_queue: str = ""  # where the prefill worker sends the decode task
    created: float = 0.0
    lease_s: float = 0.0  # > 0: the API holds lease_key(request_id) for it (0: no lease, never orphaned)
    origin: str = ""  # a migrated request: the original request id (its prompt ends with tokens generated)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sampling"] = self.sampling.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationRequest:
        return cls(
            request_id=str(d["request_id"]),
            model=str(d["model"]),
            prompt_token_ids=[int(t) for t in d["prompt_token_ids"]],
            sampling=SamplingParams.from_dict(d.get("sampling", {})),
            decode_queue=str(d.get("decode_queue", "")),
            created=float(d.get("created", 0.0)),
            lease_s=float(d.get("lease_s", 0.0)),
            origin=str(d.get("origin", "")),
        )


# --- stream events (worker -> API), one JSON object per Redis Stream entry field "e" ---------------
# {"type": "start",  "role": "prefill"|"decode"|"both", "worker": id}
# {"type": "delta",  "text": str, "n": int, "ids": [int]}          token text and ids, batched
# {"type": "done",   "finish_reason": "stop"|"length"|"abort", "usage": {...},
#                    "prefill_worker": id, "decode_worker": id, "prefill": "remote"|"local",
#                    "handle_used": bool}
# {"type": "error",  "message": str, "code": str}
EVENT_FIELD = "e"
