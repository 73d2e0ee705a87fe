"""The engine: one background thread runs the continuous batch; other threads submit and abort.

(Over 400 lines: the engine loop, nano-vllm style, reads best as one file: scheduling, the forward, sampling
and outputs of one step.)

Task threads (Celery) call `submit` and wait; the engine thread owns the block pool and the model, so
no locks are needed around them. Commands reach it through an inbox queue. Outputs leave through each
sequence's `on_output` callback (called on the engine thread; it must not block).

A prefill-only sequence stops after its first sampled token and keeps its blocks "held" for a remote
decode worker to pull; held blocks are released when pulled or when they expire.

One bad request never fails the others: a sequence is checked when it is admitted (token ids within
the model's vocabulary, length, sampling values) and finished with an error if it fails; a batch whose
forward or sampling still fails is run again sequence by sequence, and only the sequences that fail on
their own are finished with an error.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any

import torch

from farm.config import EngineConfig
from farm.engine.block_pool import BlockPool
from farm.engine.contract import RequestOutput
from farm.engine.model_runner import ModelRunner
from farm.engine.sampling import History, TokenLogprobs, logprobs_of, make_generator, sample
from farm.engine.scheduler import DecodeBatch, KVImport, PrefillBatch, Scheduler, Sequence
from farm.engine.step_costs import StepCosts
from farm.engine.structured import Grammars, InvalidFormat, mask_logits
from farm.engine.timings import RequestTimings, RequestTokens
from farm.kvcache.tiers import TieredKV
from farm.models.tokenization import IncrementalDetokenizer, bad_words_token_ids, eos_token_ids, partial_stop
from farm.protocol import SamplingParams
from farm.protocol.hashing import salt_root
from farm.protocol.kv_events import KVEventHook

PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are computed at once (256 x a 49k vocabulary: 50 MB)

log = logging.getLogger(__name__)


@dataclass
class HeldBlocks:
    seq: Sequence
    expires_at: float


class Engine:
    def __init__(self, model_dir: Path, cfg: EngineConfig, max_model_len: int,
                 on_kv_event: KVEventHook | None = None, max_num_blocks: int | None = None,
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
        self.vocab_size = self.runner.model.get_input_embeddings().num_embeddings
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_ids = eos_token_ids(self.tokenizer, model_dir)
        t = cfg.kv_tiers
        self.tiers = TieredKV(self.runner.kv, t.host_mb, t.disk_mb,
                              kv_tier_dir,
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
        self._batch: PrefillBatch | DecodeBatch | None = None  # the step's batch while it runs
        self.steps = 0
        self.tokens_generated = 0
        self.costs = StepCosts(cfg.block_size)  # measured step costs: the router's weights (heartbeat stats)
        self.timings = RequestTimings()  # queue/prefill/decode times, TTFT, per-token ITL (heartbeat stats)
        self.tokens = RequestTokens(max_model_len)  # prompt tokens, finish reasons, tokens per request (heartbeat)
        self._grammars: Grammars | None = None  # made with the first structured-output request
        self._grammars_lock = threading.Lock()

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
        if not (self._thread and self._thread.is_alive()):  # the disk arena's file goes with its engine
            self.tiers.close()

    # -- thread-safe API -------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None], *, prefill_only: bool = False,
               kv_import: KVImport | None = None, max_request_s: float | None = None,
               cache_salt: str = "", generated: int = 0) -> None:
        """`cache_salt` scopes the prefix cache: blocks are only reused among requests with the same salt."""
        try:
            seq = Sequence(request_id, list(prompt_ids), params, on_output, prefill_only=prefill_only,
                           kv_import=kv_import, max_len=self.max_model_len,
                           deadline=time.monotonic() + max_request_s if max_request_s else math.inf,
                           generator=make_generator(params), root=salt_root(cache_salt))
        except (TypeError, ValueError, OverflowError, RuntimeError) as e:  # e.g. a seed torch refuses
            on_output(RequestOutput(request_id, finished=True, finish_reason=f"error:invalid request: {e}"))
            return
        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        if params.bad_words:
            try:
                seq.bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
            except ValueError as e:
                on_output(RequestOutput(request_id, finished=True, finish_reason=f"error:invalid request: {e}"))
                return
            longest = max(map(len, seq.bad_words))  # a word begun before a migration is not completed after it
            seq.carried = list(prompt_ids[len(prompt_ids) - generated:])[-(longest - 1):] if generated and longest > 1 \
                else []
        if params.response_format is not None:
            try:
                seq.grammar = self.grammars().matcher(params.response_format)
                if generated and not seq.grammar.consume_tokens(list(prompt_ids[len(prompt_ids) - generated:])):
                    raise InvalidFormat("the tokens generated before the migration do not follow the format")
            except InvalidFormat as e:
                on_output(RequestOutput(request_id, finished=True, finish_reason=f"error:invalid request: {e}"))
                return
        if kv_import is not None:
            seq.output_ids = [kv_import.first_token]
            seq.last_logprobs = kv_import.first_logprobs
            if seq.grammar is not None:  # sampled under the same grammar on the prefill worker
                seq.grammar.consume_token(kv_import.first_token)
        self._post(("add", seq))

    def grammars(self) -> Grammars:
        """The engine's grammar library over its vocabulary, made once (it reads every token: about 2 s)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size)
            return self._grammars

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
        tokens = self.tokens.snapshot()
        return {
            # as vLLM counts them: a sequence in (chunked) prefill runs; waiting ones have no KV blocks yet
            "running": len(self.scheduler.running) + len(self.scheduler.prefilling),
            "waiting": len(self.scheduler.waiting),
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
            "costs": self.costs.snapshot(),
            "kv_usage": 1.0 - self.pool.num_free / self.pool.num_blocks if self.pool.num_blocks else 0.0,
            "prompt_tokens": tokens["prompt_tokens"],
            "request_success": tokens["request_success"],
            "histograms": {**self.timings.snapshot(), **tokens["histograms"]},
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
            except Exception as e:  # never let one bad request kill the engine or fail the others
                log.exception("engine step failed")
                self._recover(e)
            finally:
                self._batch = None

    def _recover(self, err: Exception) -> None:
        """After a step failed outside forward and sampling: finish the sequences that are invalid; if none
        is, the sequences of the failed batch (their state may be half-updated), and only them."""
        active = self.scheduler.all_active()
        culprits = [s for s in active if self.problem(s)]
        if not culprits:
            culprits = list(self._batch.seqs) if self._batch is not None else active
        for seq in culprits:
            self._finish(seq, "error", error=self.problem(seq) or str(err))

    def problem(self, seq: Sequence) -> str | None:
        """Why this sequence must not run (None: it may): token ids outside the vocabulary, too long,
        sampling values out of range. Checked at admission; the engine relies on them everywhere."""
        ids = seq.all_ids
        if not ids or len(ids) > seq.max_len:
            return f"invalid request: {len(ids)} tokens (1 to {seq.max_len} allowed)"
        if not all(isinstance(t, Integral) and 0 <= t < self.vocab_size for t in ids):
            return f"invalid request: token ids must be integers in [0, {self.vocab_size})"
        p = seq.params
        if not (type(p.max_tokens) is int and p.max_tokens >= 1):
            return "invalid request: max_tokens must be a positive integer"
        if not (isinstance(p.temperature, (int, float)) and 0.0 <= p.temperature < math.inf):
            return "invalid request: temperature must be a finite number >= 0"
        if not (isinstance(p.top_p, (int, float)) and 0.0 < p.top_p <= 1.0):
            return "invalid request: top_p must be in (0, 1]"
        if not (isinstance(p.stop, list) and all(isinstance(x, str) for x in p.stop)):
            return "invalid request: stop must be a list of strings"
        if (imp := seq.kv_import) is not None and not self._import_fits(imp, len(seq.prompt_ids)):
            return "invalid request: the imported KV does not match the prompt or this engine's cache"
        return None

    def _import_fits(self, imp: KVImport, prompt_len: int) -> bool:
        """Imported KV covers exactly the prompt, in this cache's shape and dtype: the scheduler writes it into
        blocks as it is, so a mismatch would fail the step of every request in the batch, not this one."""
        kv = self.runner.kv
        need = -(-prompt_len // kv.shape[3])  # blocks of [layers, 2, blocks, block_size, heads, dim]
        return (imp.num_tokens == prompt_len and imp.data.dtype == kv.dtype and imp.data.dim() == kv.dim()
                and imp.data.shape[:2] == kv.shape[:2] and imp.data.shape[3:] == kv.shape[3:]
                and imp.data.shape[2] >= need)

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
                if (why := self.problem(seq)) is not None:
                    self._finish(seq, "error", error=why)
                    continue
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
        self._batch = batch
        for seq in batch.seqs:  # the first step of a request ends its time in the queue
            self.timings.scheduled(seq.request_id, seq.arrival, resumed=bool(seq.output_ids))
        if isinstance(batch, PrefillBatch):
            t0 = time.perf_counter()
            tokens = self._isolated(batch.seqs, lambda idx: self._prefill_tokens(batch, idx))
            computed, took = sum(len(c.token_ids) for c in batch.chunks), time.perf_counter() - t0
            self.tiers.observe_prefill(computed, took)
            self.costs.observe_prefill(computed, took)
            for i, (seq, chunk, complete) in enumerate(zip(batch.seqs, batch.chunks, batch.completes, strict=True)):
                if i not in tokens:
                    continue  # finished with an error
                seq.num_computed = chunk.start + len(chunk.token_ids)
                self.scheduler.register_full_blocks(seq)
                if complete:
                    self.scheduler.prefilling.remove(seq)
                    if not seq.output_ids:  # its prompt, computed here (not a resumed or imported sequence)
                        self.tokens.prefilled(len(seq.prompt_ids))
                    if seq.prefill_only:
                        self._hold(seq, tokens[i])
                    else:
                        self.scheduler.running.append(seq)
                        self._append_token(seq, tokens[i])
        else:
            assert isinstance(batch, DecodeBatch)
            seqs = batch.seqs
            t0 = time.perf_counter()
            tokens = self._isolated(seqs, lambda idx: self._decode_tokens(seqs, idx))
            self.costs.observe_decode(sum(len(s.block_table) for s in seqs), time.perf_counter() - t0)
            for i, seq in enumerate(seqs):
                if i not in tokens:
                    continue
                seq.num_computed = seq.num_tokens
                self.scheduler.register_full_blocks(seq)
                self._append_token(seq, tokens[i])

    def _prefill_tokens(self, batch: PrefillBatch, idx: list[int]) -> dict[int, int | None]:
        """Forward the chunks `idx` of a prefill batch; the sampled token of each that completes its prompt (and
        the log-probabilities of the prompt tokens a chunk predicts, for a sequence that asks for them)."""
        logits, kept = self.runner.prefill_positions([batch.chunks[i] for i in idx])
        for j, hidden in kept.items():
            self._prompt_logprobs(batch.seqs[idx[j]], batch.chunks[idx[j]].start, hidden)
        rows = [j for j, i in enumerate(idx) if batch.completes[i]]
        out: dict[int, int | None] = dict.fromkeys(idx)
        if rows:
            done = [batch.seqs[idx[j]] for j in rows]
            sampled = self._sample(logits[torch.tensor(rows, device=logits.device)], done)
            out.update({idx[j]: tok for j, tok in zip(rows, sampled, strict=True)})
        return out

    def _prompt_logprobs(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens that positions start.. predict (position p predicts token
        p + 1), a slice of positions at a time, into `seq.prompt_logprobs` by position (a chunk computed again
        after a preemption writes the same values)."""
        prompt = seq.prompt_ids
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * len(prompt)
        k = int(seq.params.prompt_logprobs or 0)
        end = min(start + hidden.shape[0], len(prompt) - 1)  # the last prompt position predicts the answer
        for lo in range(start, end, PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, end)
            rows = self.runner.logits(hidden[lo - start:hi - start])
            found = logprobs_of(rows, prompt[lo + 1:hi + 1], [k] * (hi - lo), ranks=True)
            seq.prompt_logprobs[lo + 1:hi + 1] = found

    def _decode_tokens(self, seqs: list[Sequence], idx: list[int]) -> dict[int, int | None]:
        """One decode forward for the sequences `idx`; their sampled tokens."""
        part = [seqs[i] for i in idx]
        logits = self.runner.decode([s.all_ids[-1] for s in part], [s.num_tokens - 1 for s in part],
                                    [s.block_table for s in part])
        return dict(zip(idx, self._sample(logits, part), strict=True))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row for `seqs` (their penalties, min_tokens and logprobs applied); a row that asks
        for log-probabilities gets them in `seq.last_logprobs`."""
        params = [s.params for s in seqs]
        histories = [History(s.prompt_ids, s.output_ids) if s.params.penalized else None for s in seqs]
        suppress = [self._suppressed(s) for s in seqs]
        grammars = [s.grammar for s in seqs]
        allowed = mask_logits(logits, grammars, self.vocab_size) if any(g is not None for g in grammars) else logits
        tokens = sample(allowed, params, [s.generator for s in seqs], histories, suppress)
        for g, tok in zip(grammars, tokens, strict=True):
            if g is not None and not g.is_stopped():
                g.consume_token(tok)
        asks = [i for i, p in enumerate(params) if p.logprobs is not None]
        if asks:
            rows = logits[torch.tensor(asks, device=logits.device)]
            found = logprobs_of(rows, [tokens[i] for i in asks],
                                [list(params[i].logprob_token_ids) or int(params[i].logprobs) for i in asks])
            for i, lp in zip(asks, found, strict=True):
                seqs[i].last_logprobs = lp
        return tokens

    def _suppressed(self, seq: Sequence) -> list[int]:
        """Tokens that may not come next: those that would end the sequence while it is shorter than its min_tokens,
        and the last token of a bad word whose other tokens the completion ends with (vLLM's bad_words, matched
        against the generated tokens only, as vLLM's)."""
        p, out = seq.params, seq.output_ids
        banned = set(self.eos_ids) | set(p.stop_token_ids) if len(out) < p.min_tokens else set()
        if len(out) < len(seq.carried):  # the tokens generated before a migration come before these
            out = seq.carried + out
        for word in seq.bad_words:
            if len(word) == 1 or (len(word) - 1 <= len(out) and out[len(out) - len(word) + 1:] == word[:-1]):
                banned.add(word[-1])
        return sorted(banned)

    def _isolated(self, seqs: list[Sequence], run: Callable[[list[int]], dict[int, int | None]]
                  ) -> dict[int, int | None]:
        """`run` over every sequence of a batch (forward + sampling: no sequence state changes there). If it
        fails, each sequence runs alone and one that fails alone is finished with an error: the batch goes on
        without it. Returns the results of the sequences that ran."""
        try:
            return run(list(range(len(seqs))))
        except Exception as e:  # noqa: BLE001 - find the culprit below
            if len(seqs) == 1:
                self._finish(seqs[0], "error", error=self.problem(seqs[0]) or str(e))
                return {}
            log.warning("engine: a batch of %d failed (%s: %s); running its sequences one by one", len(seqs),
                        type(e).__name__, e)
        out: dict[int, int | None] = {}
        for i, seq in enumerate(seqs):
            try:
                out.update(run([i]))
            except Exception as e:  # noqa: BLE001 - this sequence alone fails: it ends, the others go on
                log.warning("engine: request %s fails on its own (%s: %s)", seq.request_id, type(e).__name__, e)
                self._finish(seq, "error", error=self.problem(seq) or str(e))
        return out

    def _hold(self, seq: Sequence, first_token: int) -> None:
        """Prefill-only: keep the blocks for a remote decode worker and report them."""
        del self._by_id[seq.request_id]
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        self.timings.token(seq.request_id)
        self.timings.finished(seq.request_id)
        self.tokens_generated += 1  # sampled here, sent in the handle: the decode worker does not count it again
        self.held[seq.request_id] = HeldBlocks(seq, time.monotonic() + self.handle_ttl_s)
        seq.on_output(RequestOutput(
            seq.request_id, finished=True, finish_reason="prefilled", prompt_tokens=len(seq.prompt_ids),
            cached_tokens=seq.num_cached_tokens, held_blocks=list(seq.block_table),
            block_hashes=list(seq.hashes), first_token=first_token, first_logprobs=seq.last_logprobs,
        ))

    def _append_token(self, seq: Sequence, tok: int) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        seq.output_ids.append(tok)
        self.tokens_generated += 1
        self.timings.token(seq.request_id)
        self.emit_new_text(seq)

    def emit_new_text(self, seq: Sequence) -> None:
        """Detokenize the newest token, apply stop conditions, and send the delta (with the token's
        log-probabilities when the request asks for them)."""
        tok = seq.output_ids[-1]
        p = seq.params
        reason = None
        may_stop = len(seq.output_ids) > p.min_tokens or not p.min_tokens
        if may_stop and ((tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids):
            reason = "stop"
            if p.include_stop_str_in_output:  # vLLM: the stop token's text too (empty for a skipped special one)
                seq.text += seq.detok.add([tok])
        else:
            new = seq.detok.add([tok])
            seq.text += new
            if p.stop and new and may_stop:
                window = seq.text[max(0, len(seq.text) - len(new) - max(map(len, p.stop)) + 1):]
                base = len(seq.text) - len(window)
                hits = [(base + window.find(s), len(s)) for s in p.stop if s and s in window]
                if hits:
                    start, length = min(hits, key=lambda h: h[0] + h[1])  # the stop string that ends first
                    seq.text = seq.text[:start + length if p.include_stop_str_in_output else start]
                    reason = "stop"
        if reason is None and seq.grammar is not None and seq.grammar.is_stopped():
            if seq.grammar.is_error():  # the matcher failed (a parser limit of a schema the API let through): the
                # output so far is not the schema's, and must not end as a whole answer ("stop")
                self._finish(seq, "stop", error=f"structured output failed: {seq.grammar.get_error()[:300]}")
                return
            reason = "stop"  # the structured output is complete
        if reason is None and (len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= seq.max_len):
            reason = "length"
        end = len(seq.text)
        if reason is None and p.stop:  # hold back a tail that may begin a stop string (vLLM does the same)
            end -= partial_stop(seq.text, p.stop)
        delta, seq.sent = seq.text[seq.sent:end], max(seq.sent, end)
        lps = [seq.last_logprobs] if p.logprobs is not None and seq.last_logprobs is not None else None
        prompt_lps, seq.prompt_logprobs = seq.prompt_logprobs, None  # with the first token, once
        if reason is not None:
            self._finish(seq, reason, text=delta, token_ids=[tok], logprobs=lps, prompt_logprobs=prompt_lps)
        else:
            seq.on_output(RequestOutput(seq.request_id, text=delta, token_ids=[tok], logprobs=lps,
                                        prompt_logprobs=prompt_lps))

    def _finish(self, seq: Sequence, reason: str, text: str = "", token_ids: list[int] | None = None,
                error: str | None = None, logprobs: list[TokenLogprobs] | None = None,
                prompt_logprobs: list[TokenLogprobs | None] | None = None) -> None:
        self.scheduler.release(seq)
        self._by_id.pop(seq.request_id, None)
        self.timings.finished(seq.request_id)
        if not seq.prefill_only or reason == "abort":  # else the decode stage goes on (and ends the request)
            self.tokens.finished(reason, len(seq.prompt_ids), len(seq.output_ids))
        seq.finish_reason = reason
        out = RequestOutput(seq.request_id, text=text, token_ids=token_ids or [], finished=True,
                            finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
                            completion_tokens=len(seq.output_ids), cached_tokens=seq.num_cached_tokens,
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if error:
            out.text = ""
            out.finish_reason = "error:" + error
        seq.on_output(out)
