"""One batch line run to its end through the farm's Gateway, as an interactive request runs: submitted with the
batch owner's cache salt, its events collected, its result recorded (farm.batch.results); what happens next (a
retry, the next attempt, giving up) is the driver's call, from the line's `Outcome`."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from farm.batch.results import Results
from farm.batch.schedule import Plan
from farm.batch.store import BatchStore
from farm.batch.validate import PreparedLine
from farm.config import FarmConfig
from farm.gateway.reading import collect
from farm.protocol import DeltaEvent, GenerationRequest, SamplingParams
from farm.tenancy.api_keys import tenant_cache_salt
from farm.tenancy.quota import Refusal, Reservation

log = logging.getLogger(__name__)

QUOTA_RETRY_S = 30.0  # a line refused for its owner's quota asks again this often (or when the window ends)


@dataclass
class Outcome:
    kind: str  # recorded | retry | cancelled
    count: bool = False  # a retry that uses up one of the line's attempts
    delay: float = 0.0
    code: str = ""
    reason: str = ""


class LineRunner:
    """Runs lines for a driver: `gateway()` is the driver's Gateway (built on first use)."""

    def __init__(self, cfg: FarmConfig, store: BatchStore, results: Results, gateway: Callable[[], Any]):
        self.cfg = cfg
        self.store = store
        self.results = results
        self.gateway = gateway

    def run(self, bid: str, line: PreparedLine, plan: Plan, stop: threading.Event,
            wake: threading.Event) -> Outcome:
        """Run one line to its end; the result is recorded here, retries are decided by the caller. Its tokens are
        reserved first from the owner's quota, as an interactive request's are: with the quota spent the line waits
        for the next window (the batch's completion window bounds the wait)."""
        rid = ("chatcmpl-" if line.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        sampling = SamplingParams.from_dict(line.sampling)
        n_prompt = len(line.prompt_ids)
        try:
            held = self.results.reserve(bid, n_prompt, sampling.max_tokens)
        except redis.RedisError as e:
            return Outcome("retry", delay=1.0, code="redis_error", reason=str(e))
        if isinstance(held, Refusal):  # the owner's quota is spent: the line waits for the next window
            return Outcome("retry", delay=min(float(held.retry_after_s), QUOTA_RETRY_S), code="insufficient_quota",
                           reason=f"the batch owner's token quota ({held.limit}) is spent")
        if held.tokens < n_prompt + sampling.max_tokens:  # what is left of the quota caps the answer
            sampling = dataclasses.replace(sampling, max_tokens=held.tokens - n_prompt)
        # the batch owner's cache salt, as the API gives its interactive requests
        # (farm.tenancy.api_keys.tenant_cache_salt)
        req = GenerationRequest(rid, line.model, line.prompt_ids, sampling, created=time.time(),
                                cache_salt=tenant_cache_salt(self.results.owner(bid), line.cache_salt))
        try:
            return self._run(bid, line, req, plan, stop, wake, held)
        finally:
            held.settle(0)  # not recorded (a retry, a failure, cancelled): its reservation goes back

    def _run(self, bid: str, line: PreparedLine, req: GenerationRequest, plan: Plan, stop: threading.Event,
             wake: threading.Event, held: Reservation) -> Outcome:
        from farm.gateway import BusyError, ClientGone, GatewayTimeout, NoWorkersError, WorkerError

        cfg, rid = self.cfg, req.request_id

        def first_delta(_ev: DeltaEvent) -> None:
            plan.prefilled(line)
            wake.set()

        try:
            self.store.inflight_add(rid, time.time() + cfg.celery.max_request_s)
            try:
                sub = self.gateway().submit(req)
            except NoWorkersError as e:
                return Outcome("retry", delay=2.0, code="no_workers", reason=str(e))
            except BusyError as e:
                return Outcome("retry", delay=float(e.retry_after_s), code="overloaded", reason=str(e))
            try:
                # stop (cancelled, expired, handed over) is asked like a client that left
                answer = collect(sub.events(client_gone=stop.is_set), on_first_delta=first_delta)
            except ClientGone:
                return Outcome("cancelled")
            except GatewayTimeout as e:
                return Outcome("retry", count=True, code="timeout", reason=str(e))
            except WorkerError as e:
                if e.retryable:  # no worker could take it over: run it again later
                    log.warning("batch %s line %d (%s): %s; running it again", bid, line.line, line.custom_id, e)
                    return Outcome("retry", count=True, code=e.code, reason=str(e))
                self.results.record_failure(bid, line, e.code, f"generation failed: {e}", rid=rid, status=e.status)
                return Outcome("recorded")
            finally:
                sub.cancel()  # a no-op once it finished; stops the workers when the line gives up
                sub.close()
            if answer.finish_reason == "abort":
                if stop.is_set():
                    return Outcome("cancelled")
                return Outcome("retry", count=True, code="aborted", reason="the request was aborted")
            self.results.record_success(bid, line, rid, answer, held)
            return Outcome("recorded")
        except redis.RedisError as e:
            return Outcome("retry", delay=1.0, code="redis_error", reason=str(e))
        finally:
            try:
                self.store.inflight_remove(rid)
            except redis.RedisError:
                pass
