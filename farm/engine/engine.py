"""The engine: one background thread runs the continuous batch; other threads submit and abort.

Task threads (Celery) call `submit` and wait; the engine thread owns the block pool and the model, so
no locks are needed around them. Commands reach it through an inbox queue. Outputs leave through each
sequence's `on_output` callback (called on the engine thread; it must not block).

A prefill-only sequence stops after its first sampled token and keeps its blocks "held" for a remote
decode worker to pull; held blocks are released when pulled or when they expire.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from farm.config import EngineConfig
from farm.engine.block_pool import BlockPool, KVEventFn
from farm.engine.model_runner import ModelRunner
from farm.engine.sampling import make_generator, sample
from farm.engine.scheduler import DecodeBatch, KVImport, PrefillBatch, Scheduler, Sequence
from farm.kvcache.tiers import TieredKV
from farm.protocol import SamplingParams
from farm.tokenization import IncrementalDetokenizer, eos_token_ids

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # prefill-only results
    held_blocks: list[int] | None = None
    block_hashes: list[int] | None = None
    first_token: int | None = None


@dataclass
class HeldBlocks:
    seq: Sequence
    expires_at: float


class Engine:
    def __init__(self, model_dir: Path, cfg: EngineConfig, max_model_len: int,
                 on_kv_event: KVEventFn | None = None, max_num_blocks: int | None = None,
                 handle_ttl_s: float = 120.0, kv_tier_dir: Path | None = None):
        from transformers import AutoTokenizer

        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.runner = ModelRunner(model_dir, cfg.block_size, cfg.kv_cache_mb * 1024 * 1024, cfg.device,
                                  cfg.dtype, max_num_blocks=max_num_blocks, max_model_len=max_model_len,
                                  enforce_eager=cfg.enforce_eager, graph_batch_sizes=cfg.cuda_graph_batch_sizes,
                                  decode_attention=cfg.decode_attention)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_ids = eos_token_ids(self.tokenizer, model_dir)
        t = cfg.kv_tiers
        self.tiers = TieredKV(self.runner.kv, t.host_mb, t.disk_mb,
                              (kv_tier_dir / f"kv-{id(self):x}.arena") if kv_tier_dir else None,
                              t.disk_min_reuse, on_kv_event)
        self.pool = BlockPool(self.runner.num_blocks, cfg.block_size, on_kv_event,
                              on_evict=self.tiers.offload if self.tiers.enabled else None)
        self.scheduler = Scheduler(self.pool, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.runner.write_blocks, tiers=self.tiers)
        self.held: dict[str, HeldBlocks] = {}
        self.handle_ttl_s = handle_ttl_s
        self._by_id: dict[str, Sequence] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.tokens_generated = 0

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=10)

    # -- thread-safe API -------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None], *, prefill_only: bool = False,
               kv_import: KVImport | None = None, max_request_s: float | None = None) -> None:
        seq = Sequence(request_id, list(prompt_ids), params, on_output, prefill_only=prefill_only,
                       kv_import=kv_import, max_len=self.max_model_len,
                       deadline=time.monotonic() + max_request_s if max_request_s else math.inf,
                       generator=make_generator(params))
        seq.detok = IncrementalDetokenizer(self.tokenizer)
        if kv_import is not None:
            seq.output_ids = [kv_import.first_token]
        self._post(("add", seq))

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def release_held(self, request_id: str) -> None:
        self._post(("release", request_id))

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run `fn` on the engine thread (where pool state is consistent) and return its result."""
        box: queue.Queue = queue.Queue(maxsize=1)
        self._post(("call", fn, box))
        ok, val = box.get(timeout=timeout)
        if not ok:
            raise val
        return val

    def active_request_ids(self) -> list[str]:
        return list(self._by_id)

    def stats(self) -> dict[str, Any]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self.scheduler.prefilling),
            "held": len(self.held),
            "blocks_total": self.pool.num_blocks,
            "blocks_free": self.pool.num_free,
            "cached_blocks": len(self.pool.cached),
            "prefix_hit_tokens": self.pool.hits,
            "prefix_query_tokens": self.pool.queries,
            "steps": self.steps,
            "tokens_generated": self.tokens_generated,
            "preemptions": self.scheduler.preemptions,
            "tiers": self.tiers.stats(),
        }

    def _post(self, msg: tuple) -> None:
        self._inbox.put(msg)
        self._wake.set()

    # -- engine thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            self._expire()
            if not self.scheduler.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # never let one bad batch kill the engine: fail its requests
                log.exception("engine step failed")
                for seq in self.scheduler.all_active():
                    self._finish(seq, "error", error=str(e))

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = msg[0]
            if kind == "add":
                seq = msg[1]
                self._by_id[seq.request_id] = seq
                if seq.output_ids:  # imported KV: its first token was sampled remotely; send it now
                    self.emit_new_text(seq)
                    if seq.finish_reason is not None:
                        continue
                self.scheduler.add(seq)
            elif kind == "abort":
                seq = self._by_id.get(msg[1])
                if seq is not None:
                    self._finish(seq, "abort")
                held = self.held.pop(msg[1], None)
                if held:
                    self.pool.free(list(reversed(held.seq.block_table)))
            elif kind == "release":
                held = self.held.pop(msg[1], None)
                if held:
                    self.pool.free(list(reversed(held.seq.block_table)))
                    held.seq.block_table = []
            elif kind == "call":
                _, fn, box = msg
                try:
                    box.put((True, fn()))
                except Exception as e:  # returned to the caller
                    box.put((False, e))

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, h in self.held.items() if h.expires_at <= now]:
            held = self.held.pop(rid)
            self.pool.free(list(reversed(held.seq.block_table)))
            held.seq.block_table = []
        for seq in self.scheduler.all_active():
            if seq.deadline <= now:
                self._finish(seq, "length")

    def step(self) -> None:
        batch = self.scheduler.schedule()
        if batch is None:
            return
        self.steps += 1
        if isinstance(batch, PrefillBatch):
            t0 = time.perf_counter()
            logits = self.runner.prefill(batch.chunks)
            self.tiers.observe_prefill(sum(len(c.token_ids) for c in batch.chunks), time.perf_counter() - t0)
            done_seqs, done_rows = [], []
            for i, (seq, chunk, complete) in enumerate(zip(batch.seqs, batch.chunks, batch.completes, strict=True)):
                seq.num_computed = chunk.start + len(chunk.token_ids)
                self.scheduler.register_full_blocks(seq)
                if complete:
                    done_seqs.append(seq)
                    done_rows.append(i)
            if done_seqs:
                rows = logits[torch.tensor(done_rows, device=logits.device)]
                tokens = sample(rows, [s.params for s in done_seqs], [s.generator for s in done_seqs])
                for seq, tok in zip(done_seqs, tokens, strict=True):
                    self.scheduler.prefilling.remove(seq)
                    if seq.prefill_only:
                        self._hold(seq, tok)
                    else:
                        self.scheduler.running.append(seq)
                        self._append_token(seq, tok)
        else:
            assert isinstance(batch, DecodeBatch)
            seqs = batch.seqs
            logits = self.runner.decode([s.all_ids[-1] for s in seqs], [s.num_tokens - 1 for s in seqs],
                                        [s.block_table for s in seqs])
            tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
            for seq, tok in zip(seqs, tokens, strict=True):
                seq.num_computed = seq.num_tokens
                self.scheduler.register_full_blocks(seq)
                self._append_token(seq, tok)

    def _hold(self, seq: Sequence, first_token: int) -> None:
        """Prefill-only: keep the blocks for a remote decode worker and report them."""
        del self._by_id[seq.request_id]
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        self.held[seq.request_id] = HeldBlocks(seq, time.monotonic() + self.handle_ttl_s)
        seq.on_output(RequestOutput(
            seq.request_id, finished=True, finish_reason="prefilled", prompt_tokens=len(seq.prompt_ids),
            cached_tokens=seq.num_cached_tokens, held_blocks=list(seq.block_table),
            block_hashes=list(seq.hashes), first_token=first_token,
        ))

    def _append_token(self, seq: Sequence, tok: int) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        seq.output_ids.append(tok)
        self.tokens_generated += 1
        self.emit_new_text(seq)

    def emit_new_text(self, seq: Sequence) -> None:
        """Detokenize the newest token, apply stop conditions, and send the delta."""
        tok = seq.output_ids[-1]
        p = seq.params
        reason = None
        if tok in self.eos_ids and not p.ignore_eos:
            reason = "stop"
            delta = ""
        else:
            delta = seq.detok.add([tok])
            seq.text += delta
        if reason is None and p.stop and delta:
            window = seq.text[max(0, len(seq.text) - len(delta) - max(map(len, p.stop)) + 1):]
            base = len(seq.text) - len(window)
            hits = [base + window.find(s) for s in p.stop if s and s in window]
            if hits:
                cut = min(hits)
                delta = delta[: max(0, cut - (len(seq.text) - len(delta)))]
                seq.text = seq.text[:cut]
                reason = "stop"
        if reason is None and (len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= seq.max_len):
            reason = "length"
        if reason is not None:
            self._finish(seq, reason, text=delta, token_ids=[tok])
        else:
            seq.on_output(RequestOutput(seq.request_id, text=delta, token_ids=[tok]))

    def _finish(self, seq: Sequence, reason: str, text: str = "", token_ids: list[int] | None = None,
                error: str | None = None) -> None:
        self.scheduler.release(seq)
        self._by_id.pop(seq.request_id, None)
        seq.finish_reason = reason
        out = RequestOutput(seq.request_id, text=text, token_ids=token_ids or [], finished=True,
                            finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
                            completion_tokens=len(seq.output_ids), cached_tokens=seq.num_cached_tokens)
        if error:
            out.text = ""
            out.finish_reason = "error:" + error
        seq.on_output(out)
