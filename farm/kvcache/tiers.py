"""KV cache tiers under the device cache: offload instead of dropping, onboard instead of recomputing.

- A cached block the device pool evicts is copied to the host tier (tier 2) before it is overwritten.
- A block the host tier evicts goes to the disk tier (tier 3) only if it was worth keeping: reused at
  least `disk_min_reuse` times (Dynamo's rule for disk), else it is dropped.
- At admission, the prompt's hash chain continues past the device hit into the host tier, then disk;
  the blocks found are copied into fresh device blocks instead of recomputed. A disk read is only done
  when it is estimated faster than recomputing those tokens (measured rates, both sides: the disk's
  starts from a cold read of the arena's device at start, then follows the reads onboarding does), so
  a disk hit is never slower than recompute. On CPU the copies are synchronous; with CUDA the host tier
  is pinned so copies can overlap (non_blocking).
Every change is a KV event with its tier, so routers can tell a device hit from a host or disk hit.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from farm.kvcache.arena import DiskArena
from farm.kvcache.block_store import BlockStore, RamSlots
from farm.protocol.kv_events import KVEventHook, KVEventKind


class TieredKV:
    def __init__(self, kv: torch.Tensor, host_mb: float, disk_mb: float, disk_dir: Path | None,
                 disk_min_reuse: int = 1, on_event: KVEventHook | None = None):
        self.kv = kv  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        layers, two, _, bs, heads, dim = kv.shape
        self.block_shape = (layers, two, bs, heads, dim)
        block_bytes = layers * two * bs * heads * dim * kv.element_size()
        self.block_bytes = block_bytes
        self.block_size = bs
        self.on_event = on_event
        self.disk_min_reuse = disk_min_reuse
        pin = kv.device.type == "cuda"
        host_blocks, disk_blocks = int(host_mb * 2**20 // block_bytes), int(disk_mb * 2**20 // block_bytes)
        self.host = BlockStore("host", host_blocks, RamSlots(host_blocks, self.block_shape, kv.dtype, pin)) \
            if host_blocks else None
        self.disk = None
        # rates for the onboard-or-recompute decision, refined as the engine runs
        self.recompute_s_per_token = 1e-3
        self.disk_bytes_per_s = 1e9
        if disk_blocks and disk_dir is not None:
            arena = DiskArena(disk_dir, disk_blocks, self.block_shape, kv.dtype)
            self.disk = BlockStore("disk", disk_blocks, arena)
            self.disk_bytes_per_s = arena.read_rate()  # the device, cold: never read on a guess
        self.offloads = 0
        self.onboards = 0

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    def _emit(self, kind: KVEventKind, h: int, parent: int | None, tier: str) -> None:
        if self.on_event:
            self.on_event(kind, [h], parent, tier=tier)

    # -- offload path -------------------------------------------------------------------------------
    def offload(self, block_id: int, h: int, parent: int | None, reuse: int) -> None:
        """BlockPool.on_evict: the device is about to reuse this block; keep its contents below."""
        data = self.kv[:, :, block_id]
        if self.host is not None:
            if h not in self.host:
                self.host.put(h, parent, data, reuse, on_evict=self._demote)
                self._emit(KVEventKind.STORED, h, parent, "host")
                self.offloads += 1
        elif self.disk is not None and reuse >= self.disk_min_reuse:
            self._to_disk(h, parent, reuse, data)

    def _demote(self, h: int, parent: int | None, reuse: int, data: torch.Tensor) -> None:
        self._emit(KVEventKind.REMOVED, h, parent, "host")
        if self.disk is not None and reuse >= self.disk_min_reuse:
            self._to_disk(h, parent, reuse, data)

    def _to_disk(self, h: int, parent: int | None, reuse: int, data: torch.Tensor) -> None:
        if h in self.disk:
            return
        self.disk.put(h, parent, data, reuse,
                      on_evict=lambda old, p, _r, _d: self._emit(KVEventKind.REMOVED, old, p, "disk"))
        self._emit(KVEventKind.STORED, h, parent, "disk")
        self.offloads += 1

    # -- onboard path -------------------------------------------------------------------------------
    def lookup(self, hashes: list[int]) -> list[str]:
        """Tiers holding the leading run of `hashes` (stops at the first block held nowhere)."""
        out = []
        for h in hashes:
            if self.host is not None and h in self.host:
                self.host.slots.move_to_end(h)  # most recent: survives offloads made by this admission
                out.append("host")
            elif self.disk is not None and h in self.disk:
                self.disk.slots.move_to_end(h)
                out.append("disk")
            else:
                break
        # a disk read must beat recomputing the same tokens, else stop before the first disk block
        disk_blocks = out.count("disk")
        if disk_blocks:
            read_s = disk_blocks * self.block_bytes / self.disk_bytes_per_s
            recompute_s = disk_blocks * self.block_size * self.recompute_s_per_token
            if read_s >= recompute_s:
                out = out[: out.index("disk")]
        return out

    def onboard(self, hashes: list[int], tiers: list[str], block_ids: list[int]) -> int:
        """Copy the blocks found by lookup into device blocks `block_ids`; returns how many were
        copied (fewer if one was evicted meanwhile: the rest is recomputed)."""
        done = 0
        for h, tier, bid in zip(hashes, tiers, block_ids, strict=True):
            store = self.host if tier == "host" else self.disk
            if h not in store:
                break
            t0 = time.perf_counter()
            self.kv[:, :, bid].copy_(store.get(h), non_blocking=self.kv.device.type == "cuda")
            dt = time.perf_counter() - t0
            store.stats.read_s += dt
            if tier == "disk" and dt > 0:  # exponential moving average of the disk read rate
                self.disk_bytes_per_s = 0.8 * self.disk_bytes_per_s + 0.2 * (self.block_bytes / dt)
            self.onboards += 1
            done += 1
        return done

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.recompute_s_per_token = 0.8 * self.recompute_s_per_token + 0.2 * (seconds / tokens)

    def close(self) -> None:
        """Remove the disk arena (the engine stops)."""
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict:
        out = {}
        for store in (self.host, self.disk):
            if store is not None:
                s = store.stats
                out[store.tier] = {"capacity_blocks": store.capacity, "used": store.used, "hits": s.hits,
                                   "offloads": s.stores, "evictions": s.evictions, "bytes_in": s.bytes_in,
                                   "bytes_out": s.bytes_out}
        return out
