"""A fixed-capacity store of KV blocks keyed by block hash, with LRU eviction.

One class serves both lower tiers; only where a slot's bytes live differs: the host tier keeps its slots in
(pinned, on CUDA) RAM, the disk tier in a file arena (farm.kvcache.arena) under the farm's state directory,
read and written with pread/pwrite. A slot holds one block across all layers:
[layers, 2, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

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


class Slots(Protocol):
    """Where the blocks of a store live: `capacity` slots of one block each."""

    block_bytes: int

    def write(self, slot: int, block: torch.Tensor) -> None: ...

    def read(self, slot: int) -> torch.Tensor:
        """The block in `slot`; valid until the next read (copy it before reading again)."""
        ...

    def close(self) -> None: ...


class RamSlots:
    def __init__(self, capacity: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False):
        self.data = torch.empty((capacity, *block_shape), dtype=dtype, pin_memory=pin)
        if not pin:
            self.data.zero_()  # every page taken now (pinned memory already is): RSS does not climb as it fills
        self.block_bytes = self.data[0].numel() * self.data.element_size() if capacity else 0

    def write(self, slot: int, block: torch.Tensor) -> None:
        self.data[slot].copy_(block)

    def read(self, slot: int) -> torch.Tensor:
        return self.data[slot]

    def close(self) -> None:
        pass


EvictFn = Callable[[int, "int | None", int, torch.Tensor], None]


class BlockStore:
    def __init__(self, tier: str, capacity_blocks: int, slots: Slots):
        self.tier = tier
        self.capacity = capacity_blocks
        self.storage = slots
        self.slots: OrderedDict[int, int] = OrderedDict()  # hash -> slot, LRU order (oldest first)
        self.parents: dict[int, int | None] = {}
        self.reuse: dict[int, int] = {}
        self.free = list(range(capacity_blocks - 1, -1, -1))
        self.stats = StoreStats(capacity_blocks=capacity_blocks)
        self.block_bytes = slots.block_bytes

    def __contains__(self, h: int) -> bool:
        return h in self.slots

    @property
    def used(self) -> int:
        return len(self.slots)

    def put(self, h: int, parent: int | None, block: torch.Tensor, reuse: int, on_evict: EvictFn | None = None) -> None:
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
                on_evict(old, parent_old, reuse_old, self.storage.read(slot))
            self.free.append(slot)
        slot = self.free.pop()
        self.storage.write(slot, block)
        self.slots[h] = slot
        self.parents[h] = parent
        self.reuse[h] = reuse
        self.stats.stores += 1
        self.stats.bytes_in += self.block_bytes

    def get(self, h: int) -> torch.Tensor:
        """The block of `h` (valid until the next get: copy it out first)."""
        self.slots.move_to_end(h)
        self.reuse[h] += 1
        self.stats.hits += 1
        self.stats.bytes_out += self.block_bytes
        return self.storage.read(self.slots[h])

    def pop(self, h: int) -> None:
        slot = self.slots.pop(h, None)
        if slot is not None:
            self.parents.pop(h, None)
            self.reuse.pop(h, None)
            self.free.append(slot)

    def close(self) -> None:
        self.storage.close()
