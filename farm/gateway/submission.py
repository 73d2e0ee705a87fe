"""One request in flight: the load it holds, its mailbox on the process's reply reader, and reading its typed
events, with migration to another worker when the one holding it dies (the tokens streamed so far go with it)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from farm.cluster import registry
from farm.cluster.liveness import Process, process_of
from farm.config import FarmConfig
from farm.gateway.failures import ClientGone, GatewayTimeout, NoWorkersError
from farm.gateway.placement import Placed, Placer, was_lost
from farm.gateway.replies import Mailbox, ReplyReader
from farm.infra.redis_batch import Job
from farm.models.tokenization import IncrementalDetokenizer, get_tokenizer
from farm.protocol import (
    CANCEL_TTL_S,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    GenerationRequest,
    SamplingParams,
    StartEvent,
    Usage,
    cancel_key,
    migration_id,
)
from farm.protocol.keys import OBS_KEEP_S, OBS_MAXLEN, OBS_STREAM, stream_min_id
from farm.router.load import LoadTracker
from farm.router.router import BusyError, Placement
from farm.telemetry import prometheus

log = logging.getLogger("farm.gateway")


def add_observation(pipe: redis.client.Pipeline, obs: dict[str, Any]) -> int:
    """Queue one finished request's observation on the planner's stream, which keeps its last OBS_KEEP_S seconds
    (and at most OBS_MAXLEN entries); returns the commands added."""
    pipe.xadd(OBS_STREAM, {"o": json.dumps(obs)}, maxlen=OBS_MAXLEN, approximate=True)
    pipe.xtrim(OBS_STREAM, minid=stream_min_id(OBS_KEEP_S), approximate=True)
    return 2


@dataclass
class Services:
    """What every submission of one gateway shares: configuration, Redis, the load tracker, the reply reader and
    the placer (migration places the request again)."""

    cfg: FarmConfig
    r: redis.Redis
    loads: LoadTracker
    replies: ReplyReader
    placer: Placer


class Submission:
    """One request in flight: iterate its typed events, or cancel it.

    While it is read, it checks every `reliability.check_interval_s` that the workers serving it are alive (the
    reply reader's liveness check). When one died mid-request, the request migrates (`_migrate`): a new attempt
    `<id>.m<n>` with the prompt plus the tokens already streamed and `max_tokens` reduced, placed on another
    worker; its events continue the same stream, with usage counted as if nothing happened.
    """

    def __init__(self, svc: Services, req: GenerationRequest, placed: Placed, box: Mailbox, falls_back: bool = False):
        self.svc = svc
        self.req = req
        self.request_id = req.request_id
        self.layout = placed.layout
        self.placements = placed.placements
        self.dispatch = placed.dispatch
        self.attempt_id = req.request_id  # the request id the workers see now (changes on migration)
        self.migrations = 0
        self.finished = False  # its done or error event was read
        self._cancelled = False  # cancel() was called: an "abort" end is the one asked for
        self._closed = False
        self.done: DoneEvent | None = None
        self._box = box
        self._started = False
        self._prefill_open = True  # the prefill load is still held
        self._loads: list[tuple[str, str, str]] = []  # (kind, worker, request id) not yet ended
        self._watching: list[Process] = []  # worker processes this request asked the reader to watch
        self._open_attempt(placed, req.request_id)
        self._t0 = time.monotonic()
        self.ttft_s: float | None = None
        self._last_delta: float | None = None
        self._itl_sum, self._itl_n = 0.0, 0
        self._ids: list[int] = []  # token ids streamed to the reader, across attempts
        self._text = ""  # their text, as streamed
        self._carried = 0  # tokens of _ids that are part of the current attempt's prompt
        self._boundary: IncrementalDetokenizer | None = None  # renders the first text after a migration
        self._stage: dict[str, str] = {}  # stage -> worker that serves it now (from start events)
        self._lost: dict[str, float] = {}  # workers this request lost: id -> start time of the lost process
        self._falls_back = falls_back  # another model may take it while nothing of it has reached the client

    def reached_client(self) -> None:
        """Something of this request has reached its client: from now on a lost worker is replaced by another of
        the same model, waited for up to `reliability.migration_wait_s`, never by another model."""
        self._falls_back = False

    @property
    def predicted_overlap_tokens(self) -> int:
        p = self.placements.get("prefill") or self.placements.get("both")
        return p.overlap_blocks * self.svc.cfg.block_size(self.req.model) if p else 0

    @property
    def router_mode(self) -> str:
        return self.svc.cfg.router.mode

    @property
    def completion_tokens(self) -> int:
        """Completion tokens so far: the done event's count once finished, else the tokens handed to the reader
        (what a client that left has received)."""
        return self.done.usage.completion_tokens if self.done is not None else len(self._ids)

    # -- book-keeping of one attempt -----------------------------------------------------------------------
    def _open_attempt(self, placed: Placed, rid: str) -> None:
        self._placed_at = time.monotonic()
        p = placed.placements.get("prefill") or placed.placements.get("both")
        d = placed.placements.get("decode") or placed.placements.get("both")
        if p is not None:
            self._loads.append(("p", p.worker.worker_id, rid))
        if d is not None:
            self._loads.append(("d", d.worker.worker_id, rid))
        self._prefill_open = True
        for pl in placed.placements.values():
            self._watch(pl.worker.worker_id, pl.worker)

    def _watch(self, worker_id: str, info: registry.WorkerInfo | None = None) -> None:
        info = info or self._placed_info(worker_id)
        if process_of(worker_id, info) not in self._watching:
            self._watching.append(self.svc.replies.watch(worker_id, info))

    def _placed_info(self, worker_id: str) -> registry.WorkerInfo | None:
        """The record of the process this attempt was placed on under `worker_id` (None: not one of its placements)."""
        return next((pl.worker for pl in self.placements.values() if pl.worker.worker_id == worker_id), None)

    def _close_attempt(self) -> None:
        """The current attempt is over (finished, cancelled or migrated away): no more events, load, watching."""
        self.svc.replies.close(self.attempt_id)
        for proc in self._watching:
            self.svc.replies.unwatch(proc)
        self._watching = []
        self._end_load("p")
        self._end_load("d")

    def _end_load(self, kind: str) -> None:
        if kind == "p":
            self._prefill_open = False
        for load in [x for x in self._loads if x[0] == kind]:
            self._loads.remove(load)
            try:
                self.svc.loads.end_soon(kind, load[1], load[2])
            except redis.RedisError:
                pass  # the deadline reaper ends it later

    def _watched(self) -> list[str]:
        """Workers whose death loses this request now: before any event the one whose queue holds it."""
        if not self._started:
            waited = time.monotonic() - self._placed_at >= self.svc.cfg.router.placement_timeout_s
            return [self.dispatch.worker_id] if self.dispatch.worker_id and waited else []
        if "decode" in self._stage:
            return [self._stage["decode"]]
        out = [self._stage["prefill"]] if "prefill" in self._stage else []
        d = self.placements.get("decode")
        if d is not None:
            out.append(d.worker.worker_id)
        return out

    def _lost_worker(self) -> str | None:
        for wid in self._watched():
            proc = process_of(wid, self._placed_info(wid))  # a restart under a lost id is not lost
            if was_lost(proc, self._lost) or self.svc.replies.gone(proc):
                return wid
        return None

    # -- migration -------------------------------------------------------------------------------------------
    def _clean_prefix(self) -> int:
        """How many streamed tokens to carry over: all whose text the reader already has (a multi-byte
        character still held back by the dead worker's detokenizer is generated again)."""
        n = len(self._ids)
        try:
            tok = get_tokenizer(self.svc.cfg, self.req.model)
        except Exception:  # noqa: BLE001 - no tokenizer here: carry everything
            return n
        skip = self.req.sampling.skip_special_tokens
        for k in range(n, max(-1, n - 8), -1):
            if tok.decode(self._ids[:k], skip_special_tokens=skip) == self._text:
                self._boundary = IncrementalDetokenizer(tok, skip_special_tokens=skip)
                self._boundary.resume(self._ids[:k], self._text)
                return k
        return n

    def _migrate(self, lost: str | None) -> Event | None:
        """Move the request off `lost` (None: no worker was lost, but the attempt ended before decode, as a failed
        hand-over does: place it again, any worker welcome); returns the event that ends the stream instead, if
        any."""
        rcfg = self.svc.cfg.reliability
        if lost is not None:
            info = self._placed_info(lost)  # the lost process; one restarted under its id later may take the request
            self._lost[lost] = max(self._lost.get(lost, 0.0), info.started_at if info is not None else time.time())
        why = f"worker {lost} was lost" if lost is not None else "the prefill could not hand the request to decode"
        try:  # if it was only slow, it stops now
            self.svc.r.set(cancel_key(self.attempt_id), "1", ex=CANCEL_TTL_S)
        except redis.RedisError:
            pass
        self._close_attempt()
        if self.migrations >= rcfg.max_migrations:
            prometheus.MIGRATIONS.labels(outcome="limit").inc()
            return ErrorEvent(f"{why} and the request already moved {self.migrations} times "
                              "(reliability.max_migrations)", "worker_lost")
        self.migrations += 1
        k = self._clean_prefix()
        del self._ids[k:]
        self._carried = k
        orig = self.req
        left = orig.sampling.max_tokens - k
        if left <= 0:  # everything was generated, only the done event was lost
            prometheus.MIGRATIONS.labels(outcome="finished").inc()
            return DoneEvent("length", Usage(len(orig.prompt_token_ids), k, 0), migrations=self.migrations)
        # the prompt's log-probabilities come with the first token: computed again only if none reached the reader
        sampling = SamplingParams.from_dict({**orig.sampling.to_dict(), "max_tokens": left,
                                             "prompt_logprobs": orig.sampling.prompt_logprobs if k == 0 else None})
        req = GenerationRequest(migration_id(orig.request_id, self.migrations), orig.model,
                                orig.prompt_token_ids + self._ids, sampling, reply_to=orig.reply_to,
                                created=orig.created, lease_s=orig.lease_s, origin=orig.request_id,
                                cache_salt=orig.cache_salt, generated=k)
        log.warning("request %s: %s after %d tokens; migrating as %s", orig.request_id,
                    f"worker {lost} lost" if lost is not None else why, k, req.request_id)
        # with another model to go to (MoM) and nothing sent yet, a worker of this model is not waited for
        deadline = time.monotonic() + (0.0 if self._falls_back else rcfg.migration_wait_s)
        while True:
            self.attempt_id = req.request_id
            self._box = self.svc.replies.open(req.request_id)
            try:
                placed = self.svc.placer.place(req, exclude=self._lost)
                break
            except (NoWorkersError, BusyError, redis.RedisError) as e:
                self.svc.replies.close(req.request_id)
                if time.monotonic() >= deadline:
                    prometheus.MIGRATIONS.labels(outcome="no_worker").inc()
                    return ErrorEvent(f"{why} and no other worker took the request: {e}", "worker_lost")
                time.sleep(rcfg.check_interval_s)
        prometheus.MIGRATIONS.labels(outcome="migrated").inc()
        self.placements, self.dispatch = placed.placements, placed.dispatch
        self._open_attempt(placed, req.request_id)
        self._started, self._stage = False, {}
        return None

    def _on_event(self, ev: Event) -> Event:
        """Book-keeping of one event of the current attempt, before the reader sees it."""
        if isinstance(ev, DeltaEvent):
            if self._boundary is not None:  # first text after a migration: render it after the carried text
                ev = dataclasses.replace(ev, text=self._boundary.add(list(ev.ids)))
                if ev.text:
                    self._boundary = None
            self._ids.extend(ev.ids)
            self._text += ev.text
        elif isinstance(ev, StartEvent):
            self._stage["decode" if ev.decodes else "prefill"] = ev.worker
            self._watch(ev.worker)
        elif isinstance(ev, DoneEvent) and ev.finish_reason == "abort" and not self._cancelled:
            # nobody here asked to stop it: the worker found this reader's lease lapsed (this process could not
            # reach Redis for longer than reliability.lease_ttl_s, e.g. a partition). A truncated answer must not
            # pass for a whole one ("abort" reaches OpenAI clients as "stop"): an error, worth retrying.
            return ErrorEvent(f"the workers stopped this request after {len(self._ids)} tokens: this API process "
                              "lost Redis for longer than its lease (reliability.lease_ttl_s); retry it",
                              "orphaned")
        elif isinstance(ev, DoneEvent) and self.migrations:
            n_prompt = len(self.req.prompt_token_ids)
            u = ev.usage
            ev = dataclasses.replace(ev, migrations=self.migrations, usage=Usage(
                n_prompt, u.completion_tokens + self._carried, min(u.cached_tokens, n_prompt)))
        return ev

    # -- reading -----------------------------------------------------------------------------------------------
    def events(self, first_timeout_s: float | None = None, idle_timeout_s: float | None = None,
               client_gone: Callable[[], bool] | None = None) -> Iterator[Event]:
        """Yield the request's typed events in order until `done` or `error` (yielded last); raise GatewayTimeout
        on silence (`first_timeout_s` for the first event, then `idle_timeout_s` between events).

        A Redis restart while reading is waited out (the deadline still applies): workers keep their events
        until Redis is back, and the reader resumes where it was. `client_gone` is asked every
        `reliability.check_interval_s`, also while nothing arrives (queued, or a non-streaming answer being
        collected); when it says so, ClientGone is raised."""
        cfg = self.svc.cfg
        first = first_timeout_s if first_timeout_s is not None else cfg.api.first_event_timeout_s
        idle = idle_timeout_s if idle_timeout_s is not None else cfg.api.request_timeout_s
        interval = cfg.reliability.check_interval_s
        got_any = False
        deadline = time.monotonic() + first
        next_check = time.monotonic() + min(interval, 0.1)
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise GatewayTimeout(f"no {'progress' if got_any else 'response'} from workers within "
                                     f"{idle if got_any else first:.0f}s")
            if now >= next_check:
                next_check = now + interval
                if client_gone is not None and client_gone():
                    raise ClientGone(f"request {self.request_id}: the client closed its connection")
                lost = self._lost_worker()
                if lost is not None:
                    end = self._migrate(lost)
                    if end is not None:
                        yield self._finish(end)
                        return
                    deadline = time.monotonic() + first
                    continue
            for ev in self._box.take(min(deadline, next_check) - now):
                got_any = self._started = True
                deadline = time.monotonic() + idle
                ev = self._on_event(ev)
                if isinstance(ev, DeltaEvent):
                    if self._prefill_open:
                        self._end_load("p")
                    if ev.n:
                        self._observe_delta(ev.n)
                elif isinstance(ev, ErrorEvent) and ev.code == ErrorEvent.HANDOVER_FAILED:
                    if "decode" in self._stage:  # the task went through after all (a send that timed out)
                        continue
                    end = self._migrate(None)  # this attempt's later events, if any, went with its mailbox
                    if end is not None:
                        yield self._finish(end)
                        return
                    deadline = time.monotonic() + first
                    break
                elif isinstance(ev, (DoneEvent, ErrorEvent)):
                    yield self._finish(ev)
                    return
                elif self._prefill_open and ev.role == "decode":
                    self._end_load("p")
                yield ev

    def _finish(self, ev: Event) -> Event:
        self.finished = True
        self.close()
        if isinstance(ev, DoneEvent):
            self.done = ev
            prometheus.record_usage(self.req.model, ev.usage.to_dict(), ev.prefill)
            self._record_observation(ev)
        return ev

    def _observe_delta(self, n: int) -> None:
        """Timed by when the tokens arrived, not when their turn to be read came (a later choice is read in one
        burst after the earlier ones). Events taken together share the latest arrival: the gaps still add up to
        the span from the first tokens to the last, so the mean is exact."""
        now = time.monotonic()
        arrived = self._box.last_delta_at or now
        if self.ttft_s is None:  # the first tokens: the span is timed from them, not from what came with them
            self._last_delta = self._box.first_delta_at or now
            self.ttft_s = self._last_delta - self._t0
            return
        if self._last_delta is not None:
            self._itl_sum += max(0.0, arrived - self._last_delta)
            self._itl_n += n
        self._last_delta = arrived

    @property
    def itl_s(self) -> float | None:
        return self._itl_sum / self._itl_n if self._itl_n else None

    def _record_observation(self, done: DoneEvent) -> None:
        """What the planner plans from: observed latency and request sizes, in a capped stream."""
        obs = {"model": self.req.model, "ts": time.time(), "ttft": self.ttft_s or 0.0, "itl": self.itl_s or 0.0,
               "isl": done.usage.prompt_tokens, "osl": done.usage.completion_tokens, "prefill": done.prefill or ""}
        prometheus.observe_latency(self.req.model, self.ttft_s, self.itl_s, time.monotonic() - self._t0)

        def add(pipe: redis.client.Pipeline) -> int:
            return add_observation(pipe, obs)

        batcher = self.svc.loads.batcher
        try:
            if batcher is not None:  # with the load writes of the next few milliseconds, in one round trip
                batcher.submit(Job(add))
            else:
                add_observation(pipe := self.svc.r.pipeline(transaction=False), obs)
                pipe.execute()
        except redis.RedisError:
            pass

    def cancel(self) -> None:
        """Ask the workers to stop generating (the client went away); the stream then ends with a `done` event
        whose finish_reason is "abort", for whoever still reads it. A no-op once finished."""
        if self.finished:
            return
        self._cancelled = True
        pipe = self.svc.r.pipeline(transaction=False)
        for rid in {self.request_id, self.attempt_id}:
            pipe.set(cancel_key(rid), "1", ex=CANCEL_TTL_S)
        pipe.execute()

    def close(self) -> None:
        """The caller reads no more: drop the request's mailbox, liveness watch and load; a request given up
        before its first token counts in farm_ttft_seconds with the time it waited. Idempotent."""
        if not self._closed:
            self._closed = True
            if self.ttft_s is None and not self.finished and self._box.first_delta_at is None:
                # given up before its first token arrived (timed out, its client gone): it waited at least this
                # long, and the TTFT objective must see it (only completed requests were observed: an overload
                # looked better). A choice whose tokens arrived but were never read is no such sample.
                prometheus.TTFT_SECONDS.labels(model=self.req.model).observe(time.monotonic() - self._t0)
            self._close_attempt()

__all__ = ["Placement", "Services", "Submission"]
