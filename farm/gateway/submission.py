"""One request in flight: its dispatched tasks, the load it holds, its lease, and reading its stream, with
migration to another worker when the one holding it dies (the tokens streamed so far go with it)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from farm import metrics, registry, reliability
from farm.gateway.errors import ClientGone, GatewayTimeout, NoWorkersError
from farm.protocol import (
    CANCEL_TTL_S,
    EVENT_FIELD,
    GenerationRequest,
    SamplingParams,
    cancel_key,
    lease_key,
    migration_id,
    stream_key,
)
from farm.protocol.keys import OBS_STREAM
from farm.router.router import BusyError, Placement
from farm.tokenization import IncrementalDetokenizer, get_tokenizer

if TYPE_CHECKING:
    from farm.gateway.gateway import Gateway

log = logging.getLogger("farm.gateway")

OBS_MAXLEN = 20_000


@dataclass
class Dispatch:
    """A task sent to one worker's queue, and where to re-send it if that worker vanishes."""

    task: str
    args: list[Any]
    worker_id: str
    fallback_queue: str


class Submission:
    """One request in flight: iterate its events, or cancel it.

    While it reads, it holds the request's lease (workers abort a leased request nobody reads) and checks
    every `reliability.check_interval_s` that the workers serving the request are alive. When one died
    mid-request, the request migrates (`_migrate`): a new attempt `<id>.m<n>` with the prompt plus the
    tokens already streamed and `max_tokens` reduced, placed on another worker; its events continue the
    same client stream, with usage counted as if nothing happened.
    """

    def __init__(self, gw: Gateway, req: GenerationRequest, layout: str, placements: dict[str, Placement],
                 dispatch: Dispatch):
        self.gw = gw
        self.req = req
        self.request_id = req.request_id
        self.layout = layout
        self.placements = placements
        self.dispatch = dispatch
        self.attempt_id = req.request_id  # the request id the workers see now (changes on migration)
        self.migrations = 0
        self._last_id = "0-0"
        self._seen: dict[str, int] = {}  # stream writer -> last event sequence read
        self.finished = False
        self._started = False
        self._loads: list[tuple[str, str, str]] = []  # (kind, worker, request id) not yet ended
        self._open_loads(placements, req.request_id)
        self._t0 = time.monotonic()
        self.ttft_s: float | None = None
        self._last_delta: float | None = None
        self._itl_sum, self._itl_n = 0.0, 0
        self._ids: list[int] = []  # token ids streamed to the reader, across attempts
        self._text = ""  # their text, as streamed
        self._carried = 0  # tokens of _ids that are part of the current attempt's prompt
        self._boundary = None  # detokenizer that renders the first text after a migration
        self._stage: dict[str, str] = {}  # stage -> worker that serves it now (from start events)
        self._lost: set[str] = set()
        self._info: dict[str, registry.WorkerInfo] = {p.worker.worker_id: p.worker for p in placements.values()}
        self._lease_at = time.monotonic()
        self._placed_at = time.monotonic()

    @property
    def predicted_overlap_tokens(self) -> int:
        p = self.placements.get("prefill") or self.placements.get("both")
        return p.overlap_blocks * self.gw.cfg.block_size(self.req.model) if p else 0

    @property
    def router_mode(self) -> str:
        return self.gw.cfg.router.mode

    def _open_loads(self, placements: dict[str, Placement], rid: str) -> None:
        p = placements.get("prefill") or placements.get("both")
        d = placements.get("decode") or placements.get("both")
        if p is not None:
            self._loads.append(("p", p.worker.worker_id, rid))
        if d is not None:
            self._loads.append(("d", d.worker.worker_id, rid))

    def _end_load(self, kind: str) -> None:
        for load in [x for x in self._loads if x[0] == kind]:
            self._loads.remove(load)
            try:
                self.gw.router.loads.end(kind, load[1], load[2])
            except redis.RedisError:
                pass  # the deadline reaper ends it later

    def _refresh_lease(self, force: bool = False) -> None:
        ttl = self.gw.cfg.reliability.lease_ttl_s
        now = time.monotonic()
        if force or now - self._lease_at >= ttl / 4:
            self.gw.r.set(lease_key(self.attempt_id), "1", ex=max(1, math.ceil(ttl)))
            self._lease_at = now

    def _watched(self) -> list[str]:
        """Workers whose death loses this request now: before any event the one whose queue holds it."""
        if not self._started:
            waited = time.monotonic() - self._placed_at >= self.gw.cfg.router.placement_timeout_s
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
            if wid in self._lost or reliability.worker_gone(self.gw.r, wid, self._info.get(wid)):
                return wid
        return None

    def _clean_prefix(self) -> int:
        """How many streamed tokens to carry over: all whose text the reader already has (a multi-byte
        character still held back by the dead worker's detokenizer is generated again)."""
        n = len(self._ids)
        try:
            tok = get_tokenizer(self.gw.cfg, self.req.model)
        except Exception:  # noqa: BLE001 - no tokenizer here: carry everything
            return n
        for k in range(n, max(-1, n - 8), -1):
            if tok.decode(self._ids[:k], skip_special_tokens=True) == self._text:
                self._boundary = IncrementalDetokenizer(tok)
                self._boundary.ids, self._boundary.text = list(self._ids[:k]), self._text
                return k
        return n

    def _migrate(self, lost: str) -> dict[str, Any] | None:
        """Move the request off `lost`; returns the event that ends the stream instead, if any."""
        rcfg = self.gw.cfg.reliability
        self._lost.add(lost)
        old = self.attempt_id
        try:
            pipe = self.gw.r.pipeline(transaction=False)
            pipe.set(cancel_key(old), "1", ex=CANCEL_TTL_S)  # if it was only slow, it stops now
            pipe.delete(lease_key(old), stream_key(old))
            pipe.execute()
        except redis.RedisError:
            pass
        self._end_load("p")
        self._end_load("d")
        if self.migrations >= rcfg.max_migrations:
            metrics.MIGRATIONS.labels(outcome="limit").inc()
            return {"type": "error", "code": "worker_lost",
                    "message": f"worker {lost} was lost and the request already moved {self.migrations} "
                               f"times (reliability.max_migrations)"}
        self.migrations += 1
        k = self._clean_prefix()
        del self._ids[k:]
        self._carried = k
        orig = self.req
        left = orig.sampling.max_tokens - k
        if left <= 0:  # everything was generated, only the done event was lost
            metrics.MIGRATIONS.labels(outcome="finished").inc()
            return {"type": "done", "finish_reason": "length", "migrations": self.migrations,
                    "usage": {"prompt_tokens": len(orig.prompt_token_ids), "completion_tokens": k,
                              "cached_tokens": 0}}
        sampling = SamplingParams.from_dict({**orig.sampling.to_dict(), "max_tokens": left})
        req = GenerationRequest(migration_id(orig.request_id, self.migrations), orig.model,
                                orig.prompt_token_ids + self._ids, sampling, created=orig.created,
                                lease_s=orig.lease_s, origin=orig.request_id)
        log.warning("request %s: worker %s lost after %d tokens; migrating as %s", orig.request_id, lost, k,
                    req.request_id)
        deadline = time.monotonic() + rcfg.migration_wait_s
        while True:
            try:
                self.attempt_id = req.request_id
                self._refresh_lease(force=True)
                _layout, placements, dispatch = self.gw._place(req, exclude=self._lost)
                break
            except (NoWorkersError, BusyError, redis.RedisError) as e:
                if time.monotonic() >= deadline:
                    metrics.MIGRATIONS.labels(outcome="no_worker").inc()
                    return {"type": "error", "code": "worker_lost",
                            "message": f"worker {lost} was lost and no other worker took the request: {e}"}
                time.sleep(rcfg.check_interval_s)
        metrics.MIGRATIONS.labels(outcome="migrated").inc()
        self.placements, self.dispatch = placements, dispatch
        self._info.update({p.worker.worker_id: p.worker for p in placements.values()})
        self._open_loads(placements, req.request_id)
        self._started, self._stage, self._last_id = False, {}, "0-0"
        self._placed_at = time.monotonic()
        return None

    def _on_event(self, ev: dict[str, Any]) -> None:
        """Book-keeping of one event of the current attempt, before the reader sees it."""
        kind = ev.get("type")
        if kind == "start" and ev.get("worker"):
            self._stage["prefill" if ev.get("role") == "prefill" else "decode"] = ev["worker"]
        elif kind == "delta":
            if self._boundary is not None:  # first text after a migration: render it after the carried text
                ev["text"] = self._boundary.add(list(ev.get("ids") or []))
                if ev["text"]:
                    self._boundary = None
            self._ids.extend(ev.get("ids") or [])
            self._text += ev.get("text", "")
        elif kind == "done" and self.migrations:
            usage = dict(ev.get("usage") or {})
            n_prompt = len(self.req.prompt_token_ids)
            usage["prompt_tokens"] = n_prompt
            usage["completion_tokens"] = int(usage.get("completion_tokens", 0)) + self._carried
            usage["cached_tokens"] = min(int(usage.get("cached_tokens", 0)), n_prompt)
            ev["usage"] = usage
            ev["migrations"] = self.migrations

    def events(self, first_timeout_s: float | None = None, idle_timeout_s: float | None = None,
               client_gone: Callable[[], bool] | None = None) -> Iterator[dict[str, Any]]:
        """Yield stream events in order until `done` or `error`; raise GatewayTimeout on silence.

        A Redis restart while reading is waited out (the deadline still applies): workers keep their
        tokens until Redis is back, and XREAD resumes from the last id seen. `client_gone` is asked every
        `reliability.check_interval_s`, also while nothing arrives (queued, or a non-streaming answer
        being collected); when it says so, ClientGone is raised."""
        cfg = self.gw.cfg
        first = first_timeout_s if first_timeout_s is not None else cfg.api.first_event_timeout_s
        idle = idle_timeout_s if idle_timeout_s is not None else cfg.api.request_timeout_s
        got_any = False
        deadline = time.monotonic() + first
        next_check = 0.0
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise GatewayTimeout(
                    f"no {'progress' if got_any else 'response'} from workers within "
                    f"{idle if got_any else first:.0f}s"
                )
            try:
                if now >= next_check:
                    next_check = now + cfg.reliability.check_interval_s
                    if client_gone is not None and client_gone():
                        raise ClientGone(f"request {self.request_id}: the client closed its connection")
                    self._refresh_lease()
                    lost = self._lost_worker()
                    if lost is not None:
                        end = self._migrate(lost)
                        if end is not None:
                            yield from self._finish(end)
                            return
                        deadline = time.monotonic() + first
                        continue
                block_ms = int(min(remaining, cfg.reliability.check_interval_s, 1.0) * 1000) or 1
                resp = self.gw.r.xread({stream_key(self.attempt_id): self._last_id}, count=256, block=block_ms)
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.25)  # Redis restarting: keep waiting until the deadline
                continue
            if not resp:
                continue
            for _key, entries in resp:
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    ev = json.loads(fields.get(EVENT_FIELD.encode()) or fields.get(EVENT_FIELD))
                    writer, seq = ev.pop("w", None), ev.pop("s", 0)
                    if writer is not None:  # a writer that retried after a Redis error may repeat events
                        if seq <= self._seen.get(writer, 0):
                            continue
                        self._seen[writer] = seq
                    got_any = self._started = True
                    deadline = time.monotonic() + idle
                    self._on_event(ev)
                    kind = ev.get("type")
                    if kind == "delta" or (kind == "start" and ev.get("role") == "decode"):
                        self._end_load("p")
                    if kind == "delta" and ev.get("n"):
                        self._observe_delta(ev["n"])
                    if kind in ("done", "error"):
                        yield from self._finish(ev)
                        return
                    yield ev

    def _finish(self, ev: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self.finished = True
        self._end_load("p")
        self._end_load("d")
        if ev.get("type") == "done":
            metrics.record_usage(self.req.model, ev.get("usage", {}), ev.get("prefill"))
            self._record_observation(ev)
        try:
            self.gw.r.delete(stream_key(self.attempt_id), lease_key(self.attempt_id))
        except redis.RedisError:
            pass  # both expire
        yield ev

    def _observe_delta(self, n: int) -> None:
        now = time.monotonic()
        if self.ttft_s is None:
            self.ttft_s = now - self._t0
        elif self._last_delta is not None:
            self._itl_sum += now - self._last_delta
            self._itl_n += n
        self._last_delta = now

    @property
    def itl_s(self) -> float | None:
        return self._itl_sum / self._itl_n if self._itl_n else None

    def _record_observation(self, done: dict[str, Any]) -> None:
        """What the planner plans from: observed latency and request sizes, in a capped stream."""
        usage = done.get("usage", {})
        obs = {"model": self.req.model, "ts": time.time(), "ttft": self.ttft_s or 0.0, "itl": self.itl_s or 0.0,
               "isl": usage.get("prompt_tokens", 0), "osl": usage.get("completion_tokens", 0),
               "prefill": done.get("prefill", "")}
        metrics.observe_latency(self.req.model, self.ttft_s, self.itl_s, time.monotonic() - self._t0)
        try:
            self.gw.r.xadd(OBS_STREAM, {"o": json.dumps(obs)}, maxlen=OBS_MAXLEN, approximate=True)
        except redis.RedisError:
            pass

    def cancel(self) -> None:
        """Tell the workers to stop generating (client gone); idempotent."""
        if not self.finished:
            pipe = self.gw.r.pipeline(transaction=False)
            for rid in {self.request_id, self.attempt_id}:
                pipe.set(cancel_key(rid), "1", ex=CANCEL_TTL_S)
            pipe.delete(lease_key(self.attempt_id))
            pipe.execute()
            self._end_load("p")
            self._end_load("d")
