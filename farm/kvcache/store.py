"""A fixed-capacity store of KV blocks keyed by block hash, with LRU eviction.

One class serves both lower tiers: the host tier keeps its slots in (pinned, on CUDA) RAM, the disk
tier in a memory-mapped file arena on local disk (the page cache absorbs writes; reads of cold slots
come from the file). A slot holds one block across all layers: [layers, 2, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class StoreStats:
    capacity_blocks: int = 0
    hits: int = 0  # blocks onboarded from this tier
    stores: int = 0  # blocks offloaded into this tier
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    read_s: float = 0.0  # time spent reading, for the onboard-or-recompute estimate
    extra: dict = field(default_factory=dict)


class BlockStore:
    def __init__(self, tier: str, capacity_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 path: Path | None = None, pin: bool = False):
        self.tier = tier
        self.capacity = capacity_blocks
        self.block_shape = block_shape
        shape = (capacity_blocks, *block_shape)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            nbytes = int(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())
            with open(path, "wb") as f:
                f.truncate(nbytes)
            self.data = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8).view(dtype).view(shape)
            os.unlink(path)  # the mapping lives on; nothing is left behind when the worker exits
        else:
            self.data = torch.empty(shape, dtype=dtype, pin_memory=pin)
        self.slots: OrderedDict[int, int] = OrderedDict()  # hash -> slot, LRU order (oldest first)
        self.parents: dict[int, int | None] = {}
        self.reuse: dict[int, int] = {}
        self.free = list(range(capacity_blocks - 1, -1, -1))
        self.stats = StoreStats(capacity_blocks=capacity_blocks)
        self.block_bytes = self.data[0].numel() * self.data.element_size()

    def __contains__(self, h: int) -> bool:
        return h in self.slots

    @property
    def used(self) -> int:
        return len(self.slots)

    def put(self, h: int, parent: int | None, block: torch.Tensor, reuse: int, on_evict=None) -> None:
        """Store a block (a [layers, 2, ...] view). When full, the least recently used block is evicted;
        `on_evict(hash, parent, reuse, data)` sees it (to demote it) before its slot is overwritten."""
        if h in self.slots:
            self.slots.move_to_end(h)
            self.reuse[h] = max(self.reuse[h], reuse)
            return
        if not self.free:
            old, slot = self.slots.popitem(last=False)
            parent_old, reuse_old = self.parents.pop(old), self.reuse.pop(old)
            self.stats.evictions += 1
            if on_evict is not None:
                on_evict(old, parent_old, reuse_old, self.data[slot])
            self.free.append(slot)
        slot = self.free.pop()
        self.data[slot].copy_(block)
        self.slots[h] = slot
        self.parents[h] = parent
        self.reuse[h] = reuse
        self.stats.stores += 1
        self.stats.bytes_in += self.block_bytes

    def get(self, h: int) -> torch.Tensor:
        self.slots.move_to_end(h)
        self.reuse[h] += 1
        self.stats.hits += 1
        self.stats.bytes_out += self.block_bytes
        return self.data[self.slots[h]]

    def pop(self, h: int) -> None:
        slot = self.slots.pop(h, None)
        if slot is not None:
            self.parents.pop(h, None)
            self.reuse.pop(h, None)
            self.free.append(slot)
