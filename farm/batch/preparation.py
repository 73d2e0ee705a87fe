"""The validating stage of a batch: its input file read and every line checked, tokenized and run through the
semantic layer (farm.batch.validate), then written as prepared lines beside the file bodies (`validating` ->
`in_progress`, or `failed` with line-numbered errors). A driver that resumes a batch prepared on another host (or
whose prepared lines are gone) derives them again from the input file, with the semantic layer's answers at
validation (a guard's refusals, kept in Redis) put back, so a refused line is never run by a later driver."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from farm.batch.file_store import FileStore
from farm.batch.store import BatchStore
from farm.batch.validate import PreparedLine, validate_input
from farm.cluster import registry
from farm.config import FarmConfig
from farm.tenancy.api_keys import tenant_cache_salt

log = logging.getLogger(__name__)


class Preparation:
    """One per driver: the tokenizers and the semantic layer its batches' lines are validated with (each built on
    first use); `end` moves a batch to a final status (farm.batch.results.Results.end)."""

    def __init__(self, cfg: FarmConfig, r: redis.Redis, store: BatchStore, files: FileStore,
                 end: Callable[..., str]):
        self.cfg = cfg
        self.bcfg = cfg.batch
        self.r = r
        self.store = store
        self.files = files
        self.end = end
        self._semantic = None  # farm.semantic.layer.SemanticLayer, built by the first batch that needs it
        self._sem_lock = threading.Lock()

    def tokenizer(self, model: str):
        from farm.models.tokenization import get_tokenizer

        if model in self.cfg.semantic.aliases:  # only decoding a token-id prompt for the guards asks this
            model = self.cfg.default_model
        return get_tokenizer(self.cfg, model)

    def semantic_layer(self):
        """The semantic layer of this driver process (built on first use): guards and MoM for batch lines."""
        with self._sem_lock:
            if self._semantic is None:
                from farm.semantic.layer import SemanticLayer

                self._semantic = SemanticLayer.from_config(self.cfg, redis_client=self.r, served=self._served_models)
            return self._semantic

    def _served_models(self) -> set[str]:
        return {w.model for w in registry.live_workers(self.r)}

    def _decide(self, owner: str) -> Callable[[str, list[dict]], Any]:
        """A batch line's semantic verdict: as the API's, but never answered from (or stored in) the cache; in its
        owner's scope of the layer's memo, as the API's requests are (no tenant's line shares another's)."""
        scope = tenant_cache_salt(owner)
        return lambda model, messages: self.semantic_layer().before(model, messages, no_cache=True, scope=scope)

    def prepare(self, b: dict[str, Any]) -> tuple[list[PreparedLine], list[dict[str, Any]]]:
        meta = self.files.get(b["input_file_id"])
        try:
            data = self.files.read(b["input_file_id"]) if meta else None
        except FileNotFoundError:
            data = None
        if data is None:
            return [], [{"code": "input_file_missing", "message": f"The input file {b['input_file_id']} "
                         "no longer exists.", "param": "input_file_id", "line": None}]
        try:
            semantic = self.cfg.semantic.enabled
            return validate_input(data, b["endpoint"], [m.name for m in self.cfg.models], self.tokenizer,
                                  lambda m: self.cfg.model(m).max_model_len, self.bcfg.max_lines,
                                  self.bcfg.max_reported_errors, lambda m: self.cfg.model(m).defaults,
                                  self._decide(str(b.get("owner") or "")) if semantic else None,
                                  self.cfg.semantic.aliases,
                                  lambda m: self.cfg.model(m).tool_call_parser,
                                  self.cfg.semantic.reveal_injected_prompt)
        except redis.RedisError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the model's tokenizer is missing on this host
            log.exception("batch validation")
            return [], [{"code": "validation_error", "message": f"the input could not be validated: {e}",
                         "param": None, "line": None}]

    def prepared_file(self, bid: str) -> Path:
        return self.cfg.batch_prepared_path / f"{bid}.jsonl"

    def validate(self, bid: str, b: dict[str, Any]) -> str:
        lines, errors = self.prepare(b)
        now = int(time.time())
        if errors:
            log.info("batch %s failed validation: %d error(s), first: %s", bid, len(errors), errors[0])
            return self.end(bid, ("validating",), "failed", failed_at=now,
                             errors={"object": "list", "data": errors})
        path = self.prepared_file(bid)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            for ln in lines:
                f.write(ln.to_json() + "\n")
        os.replace(tmp, path)
        self.store.keep_answered(bid, {ln.custom_id: (ln.answer, ln.finish_reason) for ln in lines
                                       if ln.answer is not None})
        ok, st = self.store.transition(bid, ("validating",), "in_progress", in_progress_at=now, total=len(lines),
                                       model=lines[0].model)
        if ok:
            log.info("batch %s: %d requests validated, running", bid, len(lines))
        return st or "missing"

    def load_prepared(self, bid: str, b: dict[str, Any]) -> list[PreparedLine] | None:
        try:
            with open(self.prepared_file(bid), "rb") as f:
                return [PreparedLine.from_json(raw) for raw in f if raw.strip()]
        except FileNotFoundError:
            pass
        lines, errors = self.prepare(b)  # prepared on another host, or lost: derive again from the input
        if errors:
            now, recorded = int(time.time()), len(self.store.recorded_ids(bid))
            if recorded:  # lines answered before the input went: they go out in the output file, not away
                errors = [{**e, "message": f"{e['message']} {recorded} lines had been answered (in the output "
                           f"file); the other {int(b.get('total') or 0) - recorded} were not run."} for e in errors]
                self.store.transition(bid, ("in_progress",), "finalizing", finalizing_at=now, final_status="failed",
                                      errors={"object": "list", "data": errors})
            else:
                self.end(bid, ("in_progress",), "failed", failed_at=now, errors={"object": "list", "data": errors})
            return None
        return self._with_kept_answers(bid, lines)

    def _with_kept_answers(self, bid: str, lines: list[PreparedLine]) -> list[PreparedLine]:
        """Lines derived again, with the answers the semantic layer gave at validation put back: a line refused
        then stays refused, even if the guards would let it through now (a remote guard down under `on_error:
        allow`, another configuration on this host). A line refused only now stays refused too."""
        kept = self.store.answered(bid)
        return [dataclasses.replace(ln, answer=kept[ln.custom_id][0], finish_reason=kept[ln.custom_id][1])
                if ln.custom_id in kept else ln for ln in lines]
