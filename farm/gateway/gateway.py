"""The gateway of one process (an API process, a batch driver): place requests on workers and read them back.

It owns the process's router (farm.router), its placer (farm.gateway.placement) and its reply reader
(farm.gateway.replies), started on the first submission, so a process that never submits never follows a stream.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from farm.config import FarmConfig
from farm.gateway.placement import NOTHING_LOST, Lost, Placed, Placer
from farm.gateway.replies import ReplyReader
from farm.gateway.submission import Services, Submission
from farm.infra import logcontext
from farm.infra.broker import TaskPublisher
from farm.protocol import GenerationRequest
from farm.router.router import BusyError, Router
from farm.telemetry import prometheus

log = logging.getLogger("farm.gateway")
ADMISSION_POLL_S = 0.2  # how often a request waiting for room (Gateway.submit) asks the router again


class Gateway:
    def __init__(self, cfg: FarmConfig, r: redis.Redis, publisher: TaskPublisher | None = None,
                 router: Router | None = None, reader_kind: str = "api"):
        self.cfg = cfg
        self.r = r
        self.router = router or Router(cfg, r)
        self.placer = Placer(cfg, r, self.router, publisher or TaskPublisher(r))
        self.replies = ReplyReader(r, cfg.reliability, reader_kind)
        self._svc = Services(cfg, r, self.router.loads, self.replies, self.placer)
        self._start_lock = threading.Lock()

    def layout(self, model: str) -> str:
        """How `model` is served now (disaggregated | conditional | aggregated | decode-only); NoWorkersError."""
        return self.placer.layout(model)

    def place(self, req: GenerationRequest, exclude: Lost = NOTHING_LOST) -> Placed:
        return self.placer.place(req, exclude)

    def soonest(self, prompts: dict[str, list[int]], cache_salt: str = "") -> tuple[str, str] | None:
        """Of models that would answer equally well, each with the prompt's ids as its tokenizer makes them (in
        preference order), the one whose workers would send the first token soonest (Router.estimate: the
        cached prefix and the queue), and why: "kv-cache" (more of the prompt cached there than on the first
        model's) or "load" (a shorter wait, or no worker left for the first). None when the first model is as
        soon as any (or nothing is served)."""
        estimates = [(m, self.placer.estimate(m, ids, cache_salt)) for m, ids in prompts.items()]
        served = [(i, m, e) for i, (m, e) in enumerate(estimates) if e is not None]
        if not served:
            return None
        i, model, best = min(served, key=lambda x: (x[2].ttft_s, x[0]))
        if i == 0:
            return None
        first = estimates[0][1]
        return model, "kv-cache" if first is not None and best.overlap_blocks > first.overlap_blocks else "load"

    def submit(self, req: GenerationRequest, wait_for_room: bool = False, falls_back: bool = False) -> Submission:
        """Route and enqueue; raises NoWorkersError (no worker) or BusyError (every worker busy). The request's
        events will arrive on this process's reply stream, into a mailbox opened before its task is sent.
        `wait_for_room`: when every worker's KV cache is full, try again until `router.admission_wait_s` has
        passed (a bounded admission queue, where vLLM's engine would queue without bound); the API asks for it
        unless MoM has another model to try at once. `falls_back`: MoM has one; while nothing of the request has
        reached its client (Submission.reached_client), a migration does not wait for a worker of this model."""
        if not self.replies.running:
            with self._start_lock:
                self.replies.start()
        req.reply_to = self.replies.reader_id
        req.lease_s = self.cfg.reliability.lease_ttl_s
        box = self.replies.open(req.request_id)
        logcontext.bind(request_id=req.request_id, model=req.model)  # this request's lines from here on
        try:
            placed = self._place_when_room(req, self.cfg.router.admission_wait_s if wait_for_room else 0.0)
        except BaseException:
            self.replies.close(req.request_id)
            raise
        logcontext.bind(worker=",".join(dict.fromkeys(p.worker.worker_id for p in placed.placements.values())))
        return Submission(self._svc, req, placed, box, falls_back)

    def _place_when_room(self, req: GenerationRequest, wait_s: float) -> Placed:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.placer.place(req)
            except BusyError as e:
                if not e.full or time.monotonic() + ADMISSION_POLL_S > deadline:
                    prometheus.REQUESTS_SHED.labels(stage=e.stage).inc()
                    raise
            time.sleep(ADMISSION_POLL_S)  # the router's load view follows finished requests within about a second

    def stop(self) -> None:
        self.replies.stop()
        self.router.stop()
