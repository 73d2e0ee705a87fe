"""Sequences and the continuous-batching scheduler.

Each engine step is either a prefill step (prompt chunks of waiting or partly prefilled sequences, up
to a token budget) or a decode step (one token for every running sequence). Admission looks up the
prompt's block hashes in the prefix cache and only computes what is not cached (a request's hashes are
chained from its cache salt's root, so it only finds blocks cached under the same salt). When the cache runs
out of blocks mid-decode, the newest sequence is preempted (its blocks freed, recomputed later).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from farm.engine.block_pool import BlockPool
from farm.engine.model_runner import PrefillChunk
from farm.protocol import SamplingParams
from farm.protocol.hashing import block_hashes


@dataclass
class KVImport:
    """Prompt KV computed elsewhere (a prefill worker): blocks' data, token count, first token."""

    data: torch.Tensor  # [layers, 2, n_blocks, block_size, kv_heads, head_dim]
    num_tokens: int
    first_token: int
    release: Callable[[torch.Tensor], None] | None = None  # gives the receive buffer back once copied
    first_logprobs: Any = None  # the first token's TokenLogprobs, when the request asks for them


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[Any], None]
    prefill_only: bool = False
    kv_import: KVImport | None = None
    max_len: int = 4096
    deadline: float = math.inf
    generator: torch.Generator | None = None
    root: int | None = None  # hashing.salt_root of the request's cache salt: the parent of its first block

    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of registered full blocks
    planned: tuple[int, list[int]] = (-1, [])  # (token count, hashes of all full blocks of all_ids then)
    num_computed: int = 0
    num_cached_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finish_reason: str | None = None
    # engine-side text state (stop strings work on text)
    detok: Any = None
    text: str = ""
    sent: int = 0  # characters of `text` sent: the tail that may begin a stop string is held back until it cannot
    last_logprobs: Any = None  # TokenLogprobs of the newest token, when the request asks for them
    # the prompt's TokenLogprobs by position (None at 0), filled as its chunks are computed, when it asks for them
    prompt_logprobs: list[Any] | None = None
    grammar: Any = None  # structured output: the sequence's grammar matcher (farm.engine.structured)
    bad_words: list[list[int]] = field(default_factory=list)  # vLLM's bad_words as token sequences
    carried: list[int] = field(default_factory=list)  # a migrated request's generated tokens before it came here

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are still to be computed: every prompt token, none from the cache."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class PrefillBatch:
    seqs: list[Sequence]
    chunks: list[PrefillChunk]
    completes: list[bool]  # chunk finishes the sequence's prefill -> sample from its logits


@dataclass
class DecodeBatch:
    seqs: list[Sequence]


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 import_fn: Callable[[list[int], torch.Tensor], None], tiers=None):
        self.pool = pool
        self.bs = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.import_fn = import_fn  # writes imported KV into blocks
        self.tiers = tiers  # farm.kvcache.tiers.TieredKV: host/disk blocks below the device cache
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0

    # -- bookkeeping -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def all_active(self) -> list[Sequence]:
        return list(self.waiting) + self.prefilling + self.running

    def release(self, seq: Sequence) -> None:
        """Drop a sequence from every queue and free its blocks (tail first)."""
        for q in (self.prefilling, self.running):
            if seq in q:
                q.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.pool.free(list(reversed(seq.block_table)))
            seq.block_table = []

    def register_full_blocks(self, seq: Sequence) -> None:
        """Enter newly completed blocks (tokens with KV computed) into the prefix cache."""
        full = seq.num_computed // self.bs
        have = len(seq.hashes)
        if full <= have:
            return
        ids = seq.all_ids
        parent = seq.hashes[-1] if seq.hashes else seq.root
        new = block_hashes(ids[have * self.bs: full * self.bs], self.bs, parent)
        self.pool.cache_blocks(seq.block_table[have:full], new, parent)
        seq.hashes.extend(new)

    # -- admission ---------------------------------------------------------------------------------
    def _planned(self, seq: Sequence) -> list[int]:
        """Hashes of every full block of the sequence's tokens (computed once per token count)."""
        n = seq.num_tokens
        if seq.planned[0] != n:
            seq.planned = (n, block_hashes(seq.all_ids, self.bs, seq.root))
        return seq.planned[1]

    def _waits_for_inflight(self, seq: Sequence, inflight: set[int]) -> bool:
        """Whether the first block this sequence would compute is being computed by a sequence in prefill
        now: then it waits a step and reuses that block instead of computing it a second time (requests
        that share a prefix and arrive together, e.g. a prefix-grouped batch). Not one that asks for its prompt's
        log-probabilities: it computes every block itself."""
        if seq.wants_prompt_logprobs:
            return False
        hashes = self._planned(seq)
        cached = self.pool.cached_prefix(hashes)
        return len(cached) < len(hashes) and hashes[len(cached)] in inflight

    def _admit(self, seq: Sequence) -> bool:
        ids = seq.all_ids
        # imported KV covers the prompt only: never match a block that includes the first token
        hashes = self._planned(seq) if seq.kv_import is None else \
            block_hashes(ids[:seq.kv_import.num_tokens], self.bs, seq.root)
        cached = self.pool.cached_prefix(hashes) if not seq.wants_prompt_logprobs else []
        if seq.kv_import is None and len(cached) * self.bs >= len(ids):
            cached = cached[:-1]  # always compute at least one token to get logits
        lower: list[str] = []
        if seq.kv_import is None and self.tiers is not None and self.tiers.enabled and not seq.wants_prompt_logprobs:
            limit = (len(ids) - 1) // self.bs  # full blocks that leave at least one token to compute
            lower = self.tiers.lookup(hashes[len(cached):limit])
        total_blocks = math.ceil(len(ids) / self.bs) if seq.kv_import is None else \
            math.ceil(seq.kv_import.num_tokens / self.bs)
        idle_cached = sum(1 for b in cached if self.pool.blocks[b].ref_cnt == 0)
        need = total_blocks - len(cached)
        # keep one block per running sequence spare so admissions don't immediately force preemption
        if need > self.pool.num_free - idle_cached - len(self.running):
            return False
        self.pool.touch(cached)
        fresh = self.pool.allocate(need)
        if lower:  # onboard from host/disk instead of recomputing, and cache them on the device again
            start = len(cached)
            n = self.tiers.onboard(hashes[start:start + len(lower)], lower, fresh[:len(lower)])
            self.pool.cache_blocks(fresh[:n], hashes[start:start + n], hashes[start - 1] if start else seq.root)
            cached_count = start + n
        else:
            cached_count = len(cached)
        seq.block_table = cached + fresh
        seq.num_computed = cached_count * self.bs
        seq.num_cached_tokens = seq.num_computed
        self.pool.queries += len(seq.prompt_ids)
        self.pool.hits += seq.num_cached_tokens
        if seq.kv_import is not None:
            imp = seq.kv_import
            if fresh:
                self.import_fn(fresh, imp.data[:, :, len(cached):total_blocks])
            seq.num_computed = imp.num_tokens
            seq.kv_import = None  # release the host copy
            if imp.release is not None:
                imp.release(imp.data)
            seq.hashes = hashes[:len(cached)]
            self.register_full_blocks(seq)
        else:
            seq.hashes = hashes[:cached_count]
        return True

    # -- one step ------------------------------------------------------------------------------------
    def schedule(self) -> PrefillBatch | DecodeBatch | None:
        budget = self.max_tokens
        seqs, chunks, completes = [], [], []

        def add_chunk(seq: Sequence) -> None:
            nonlocal budget
            ids = seq.all_ids
            n = min(len(ids) - seq.num_computed, budget)
            start = seq.num_computed
            chunks.append(PrefillChunk(ids[start:start + n], start, seq.block_table, seq.wants_prompt_logprobs))
            seqs.append(seq)
            completes.append(start + n == len(ids))
            budget -= n

        for seq in list(self.prefilling):
            if budget <= 0:
                break
            add_chunk(seq)
        # blocks that sequences in prefill are computing: a waiting sequence that needs one of them next waits
        inflight = {h for s in self.prefilling for h in self._planned(s)[len(s.hashes):]}
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.prefilling) + len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.kv_import is None and inflight and self._waits_for_inflight(seq, inflight):
                deferred.append(self.waiting.popleft())
                continue
            if not self._admit(seq):
                break
            self.waiting.popleft()
            if seq.num_computed == seq.num_tokens - 1 and seq.output_ids:
                self.running.append(seq)  # imported KV: straight to decode
                continue
            self.prefilling.append(seq)
            add_chunk(seq)
            inflight.update(self._planned(seq)[len(seq.hashes):])
        self.waiting.extendleft(reversed(deferred))  # first in line again, in their order
        if chunks:
            return PrefillBatch(seqs, chunks, completes)
        if not self.running:
            return None
        # make room for each running sequence's next token, preempting the newest if needed
        for seq in list(self.running):
            if seq not in self.running:
                continue
            while seq.num_tokens > len(seq.block_table) * self.bs:
                if self.pool.num_free > 0:
                    seq.block_table.extend(self.pool.allocate(1))
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
        return DecodeBatch(list(self.running)) if self.running else None

    def _preempt(self, seq: Sequence) -> None:
        self.release(seq)
        seq.num_computed = 0
        seq.hashes = []
        self.waiting.appendleft(seq)
        self.preemptions += 1
