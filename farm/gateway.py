"""The API's door into the farm: place a request on worker queues and read its token stream.

Layout per model, from the live worker registry:
- prefill and decode workers present -> disaggregated: the prefill task computes the prompt's KV,
  emits a signed KV handle and hands the decode task (with the handle) to the decode queue;
- otherwise aggregated workers (`both`) -> one generate task does prefill and decode locally;
- decode workers alone -> the decode task prefills locally.
Events come back on the request's Redis Stream (see farm.protocol) and are read here with XREAD.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import redis

from farm import registry
from farm.config import FarmConfig
from farm.protocol import (
    CANCEL_TTL_S,
    EVENT_FIELD,
    TASK_DECODE,
    TASK_GENERATE,
    TASK_PREFILL,
    GenerationRequest,
    cancel_key,
    queue_name,
    stream_key,
)


class NoWorkersError(RuntimeError):
    """No live worker serves the model: the API answers 503."""


class GatewayTimeout(TimeoutError):
    """No progress from the workers within the configured time: the API answers 504."""


class Submission:
    """One request in flight: iterate its events, or cancel it."""

    def __init__(self, gw: Gateway, request_id: str, layout: str):
        self.gw = gw
        self.request_id = request_id
        self.layout = layout
        self._last_id = "0-0"
        self.finished = False

    def events(self, first_timeout_s: float | None = None, idle_timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield stream events in order until `done` or `error`; raise GatewayTimeout on silence."""
        cfg = self.gw.cfg
        first = first_timeout_s if first_timeout_s is not None else cfg.api.first_event_timeout_s
        idle = idle_timeout_s if idle_timeout_s is not None else cfg.api.request_timeout_s
        key = stream_key(self.request_id)
        got_any = False
        deadline = time.monotonic() + first
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GatewayTimeout(
                    f"no {'progress' if got_any else 'response'} from workers within "
                    f"{idle if got_any else first:.0f}s"
                )
            block_ms = int(min(remaining, 1.0) * 1000) or 1
            resp = self.gw.r.xread({key: self._last_id}, count=256, block=block_ms)
            if not resp:
                continue
            for _key, entries in resp:
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    raw = fields.get(EVENT_FIELD.encode()) or fields.get(EVENT_FIELD)
                    ev = json.loads(raw)
                    got_any = True
                    deadline = time.monotonic() + idle
                    yield ev
                    if ev.get("type") in ("done", "error"):
                        self.finished = True
                        self.gw.r.delete(key)
                        return

    def cancel(self) -> None:
        """Tell the workers to stop generating (client gone); idempotent."""
        if not self.finished:
            self.gw.r.set(cancel_key(self.request_id), "1", ex=CANCEL_TTL_S)


class Gateway:
    def __init__(self, cfg: FarmConfig, r: redis.Redis, celery_app=None):
        self.cfg = cfg
        self.r = r
        if celery_app is None:
            from tasks.celery_app import make_celery

            celery_app = make_celery(cfg)
        self.celery = celery_app

    def layout(self, model: str) -> str:
        """Which layout would serve `model` now; raises NoWorkersError when nothing can."""
        workers = registry.live_workers(self.r, model=model)
        roles = {w.role for w in workers}
        if "prefill" in roles and ("decode" in roles or "both" in roles):
            return "disaggregated"
        if "both" in roles:
            return "aggregated"
        if "decode" in roles:
            return "decode-only"
        raise NoWorkersError(f"no live worker serves model {model!r}")

    def submit(self, req: GenerationRequest) -> Submission:
        layout = self.layout(req.model)
        req.created = req.created or time.time()
        if layout == "disaggregated":
            req.decode_queue = queue_name(req.model, "decode")
            self.celery.send_task(TASK_PREFILL, args=[req.to_dict()], queue=queue_name(req.model, "prefill"))
        elif layout == "aggregated":
            self.celery.send_task(TASK_GENERATE, args=[req.to_dict()], queue=queue_name(req.model, "generate"))
        else:
            self.celery.send_task(TASK_DECODE, args=[req.to_dict(), None], queue=queue_name(req.model, "decode"))
        return Submission(self, req.request_id, layout)
