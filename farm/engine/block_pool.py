"""Paged KV-cache block pool with prefix caching (after vLLM v1's block_pool / kv_cache_manager).

Blocks are fixed-size pages of the KV cache. A full block gets its chained block hash
(farm.protocol.hashing) and is entered in `cached`: a later request whose prompt has the same hash chain
reuses the block instead of recomputing it. Freed blocks keep their contents and hash and go to the end
of an LRU free queue; allocation takes from the front and only then evicts the old hash. So the most
recently used prefixes survive longest, and a block is never overwritten while referenced.

Every change to what is cached is reported through `on_event` as a KV event (stored / removed), which
the worker publishes so routers can see which blocks it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from farm.protocol.kv_events import KVEventHook, KVEventKind

# (block id, hash, parent hash, reuse count): a cached block is about to be overwritten; its data is intact
EvictFn = Callable[[int, int, int | None, int], None]


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    reuse: int = 0  # prefix-cache hits on this block since it was cached


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, on_event: KVEventHook | None = None,
                 on_evict: EvictFn | None = None):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.on_event = on_event
        self.on_evict = on_evict  # the lower KV tiers offload what the device is about to drop
        self.hits = 0  # cached tokens served
        self.queries = 0  # prompt tokens looked up

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes` (not yet referenced)."""
        out: list[int] = []
        for h in hashes:
            bid = self.cached.get(h)
            if bid is None:
                break
            out.append(bid)
        return out

    # -- reference counting ------------------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (removing them from the free queue if idle)."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_cnt == 0:
                self.free_queue.pop(bid, None)
            b.ref_cnt += 1
            b.reuse += 1

    def allocate(self, n: int) -> list[int]:
        """Take `n` fresh blocks (evicting the least recently used cached contents)."""
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"need {n} KV blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            b = self.blocks[bid]
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) == bid:
                    del self.cached[b.block_hash]
                    if self.on_event:
                        self.on_event(KVEventKind.REMOVED, [b.block_hash], None)
                    if self.on_evict:
                        self.on_evict(bid, b.block_hash, b.parent_hash, b.reuse)
                b.block_hash = b.parent_hash = None
            b.ref_cnt = 1
            b.reuse = 0
            out.append(bid)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Pass a sequence's blocks tail-first so its tail is
        evicted before its (more shareable) head."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {bid}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue[bid] = None

    # -- prefix cache ------------------------------------------------------------------------------
    def cache_blocks(self, block_ids: Sequence[int], hashes: Sequence[int], parent: int | None) -> None:
        """Register full blocks under their chained hashes (first writer wins on duplicates)."""
        stored: list[int] = []
        for bid, h in zip(block_ids, hashes, strict=True):
            b = self.blocks[bid]
            if b.block_hash is None and h not in self.cached:
                b.block_hash, b.parent_hash = h, parent
                self.cached[h] = bid
                stored.append(h)
            parent = h
        if stored and self.on_event:
            first_parent = self.blocks[self.cached[stored[0]]].parent_hash
            self.on_event(KVEventKind.STORED, stored, first_parent)

    def reset(self) -> None:
        """Forget every cached block (only when nothing is referenced)."""
        if any(b.ref_cnt for b in self.blocks):
            raise RuntimeError("cannot reset the prefix cache while blocks are in use")
        for b in self.blocks:
            b.block_hash = b.parent_hash = None
        self.cached.clear()
        if self.on_event:
            self.on_event(KVEventKind.CLEARED, [], None)
