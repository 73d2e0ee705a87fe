"""What a batch's lines end with: each line's result recorded once (a success with its OpenAI response body, or a
failure for the error file), its tokens charged to the batch owner's quota (reserved before it runs, settled when
recorded), and at the end the output and error
files written from the recorded results (`finalizing` -> `completed`, `expired` or `cancelled`)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from farm.batch.file_store import FileStore
from farm.batch.store import TERMINAL, BatchStore
from farm.batch.validate import PreparedLine
from farm.config import FarmConfig
from farm.gateway.reading import Answer
from farm.openai.logprobs import for_answer, prompt_logprobs
from farm.openai.responses import Choice, full_response
from farm.openai.tools import ToolRequest
from farm.telemetry import prometheus
from farm.tenancy.api_keys import OWNER_ANONYMOUS, KeyRing
from farm.tenancy.quota import Limiter, Refusal, Reservation

log = logging.getLogger(__name__)


class Results:
    """One per driver: records the lines' results and ends batches. `tokenizer(model)` decodes a line's tokens
    for its log-probabilities (farm.batch.preparation.Preparation.tokenizer)."""

    def __init__(self, cfg: FarmConfig, r: redis.Redis, store: BatchStore, files: FileStore,
                 tokenizer: Callable[[str], Any]):
        self.cfg = cfg
        self.r = r
        self.store = store
        self.files = files
        self.tokenizer = tokenizer
        # batch lines spend their owner's token quota like interactive requests (the key ring's own
        # limits come from config entries only, so FARM_API_KEYS is not needed here)
        self.limiter = Limiter(r, cfg.api.limits, KeyRing.from_config(cfg, environ={}).overrides)
        self._owners: dict[str, str] = {}

    def end(self, bid: str, from_states: tuple[str, ...], to: str, **fields: Any) -> str:
        ok, st = self.store.transition(bid, from_states, to, **fields)
        if ok and to in TERMINAL:
            prometheus.count_farm(self.r, "farm_batches", to)
        return st or "missing"

    def record_success(self, bid: str, line: PreparedLine, rid: str, answer: Answer,
                       held: Reservation | None = None) -> None:
        """Record a line's answer once; its tokens are charged to the owner's quota then: settled against the
        reservation `held` for it (farm.batch.line), or charged (a line the semantic layer answered); a repeat of a
        recorded line gives its reservation back."""
        usage = answer.usage.to_dict()
        if line.prompt_only:
            answer = answer.prompt_only()
        logprobs = None
        tok = self.tokenizer(line.model)
        if line.sampling.get("logprobs") is not None:
            logprobs = for_answer(line.kind, tok, answer.token_ids, answer.logprobs, line.prompt_ids,
                                  answer.prompt_logprobs if line.echo_logprobs else None, line.sampling["logprobs"])
        prompt_lps = None if line.prompt_logprobs is None or answer.prompt_logprobs is None else \
            prompt_logprobs(tok, line.prompt_ids, answer.prompt_logprobs, line.prompt_logprobs)
        tools = ToolRequest.from_dict(line.tools) if line.tools is not None else None
        # a guard's refusal names the model asked (an alias, MoM): no engine wrote it, no reasoning to split
        parser = next((m.reasoning_parser for m in self.cfg.models if m.name == line.model), None) \
            if line.kind == "chat" else None
        ids = line.return_token_ids
        choice = Choice.of(answer.text, answer.finish_reason, logprobs, tools, parser, line.echo,
                           token_ids=answer.token_ids if ids else None,
                           prompt_token_ids=line.prompt_ids if ids else None, prompt_logprobs=prompt_lps)
        body = full_response(line.kind, rid, line.model, [choice], usage, role=line.role)
        out = {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id,
               "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}
        first = self.store.record(bid, line.custom_id, {"line": line.line, "ok": True, "out": out}, True, usage) == 1
        used = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0)) if first else 0
        if first:
            prometheus.count_farm(self.r, "farm_batch_lines", "completed")
        if held is not None:
            held.settle(used)
        elif used:
            self.charge(bid, used)

    def charge(self, bid: str, tokens: int) -> None:
        """Tokens a recorded line used without a reservation go to the batch owner's quota."""
        try:
            self.limiter.charge(self.owner(bid), tokens)
        except redis.RedisError:
            log.warning("batch %s: could not charge a line's tokens to its owner's quota", bid)

    def reserve(self, bid: str, prompt_tokens: int, max_tokens: int) -> Reservation | Refusal:
        """Hold the most a line can use (its prompt and `max_tokens`) of the owner's quota before it runs, as an
        interactive request does, or what is left when that still covers the prompt and one token."""
        return self.limiter.reserve(self.owner(bid), prompt_tokens + max_tokens, prompt_tokens + 1)

    def owner(self, bid: str) -> str:
        """The batch's owner id (its creator's key; anonymous on a farm without keys), remembered while it runs."""
        owner = self._owners.get(bid)
        if owner is None:
            owner = self._owners[bid] = (self.store.get(bid) or {}).get("owner") or OWNER_ANONYMOUS
        return owner

    def record_failure(self, bid: str, line: PreparedLine, code: str, message: str, rid: str | None = None,
                        status: int | None = None) -> None:
        """An error-file line: an HTTP-style error (status given) or a request that never got an answer."""
        if status is not None:
            resp = {"status_code": status, "request_id": rid,
                    "body": {"error": {"message": message, "type": "server_error", "param": None, "code": code}}}
            out = {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id, "response": resp,
                   "error": None}
        else:
            out = {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id, "response": None,
                   "error": {"code": code, "message": message}}
        if self.store.record(bid, line.custom_id, {"line": line.line, "ok": False, "out": out}, False) == 1:
            prometheus.count_farm(self.r, "farm_batch_lines", "failed")

    def finalize(self, bid: str, final: str) -> str:
        """Write the output and error files from the recorded results (in input order), then end."""
        frm = "cancelling" if final == "cancelled" else "finalizing"
        self.store.set_fields(bid, sealed=True)  # no result is recorded after the files are written
        self._owners.pop(bid, None)
        b = self.store.get(bid) or {}
        if b.get("status") != frm:
            return b.get("status") or "missing"
        results = sorted(self.store.results(bid), key=lambda x: x["line"])
        suffix = bid.split("_", 1)[-1][:24]
        owner = b.get("owner")
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for field, ok, fid, name in (("output_file_id", True, f"file-{suffix}out", "output"),
                                     ("error_file_id", False, f"file-{suffix}err", "error")):
            chosen = [r["out"] for r in results if r["ok"] is ok]
            if chosen:
                chunks = ((json.dumps(o, separators=(",", ":")) + "\n").encode() for o in chosen)
                self.files.create(chunks, f"{bid}_{name}.jsonl", "batch_output", owner, file_id=fid,
                                  expires_at=int(time.time()) + self.cfg.batch.retention_s)
                ids[field] = fid
        stamp = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at",
                 "failed": "failed_at"}[final]
        st = self.end(bid, (frm,), final, **ids, **{stamp: int(time.time())})
        log.info("batch %s %s: %d results", bid, st, len(results))
        return st
