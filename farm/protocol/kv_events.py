"""The KV event: what happened to a worker's KV blocks, as Dynamo types it (stored / removed / cleared).

Workers publish them in batches on `farm:kv:events` (farm.router.kv_publisher), every router follows them into
its index (farm.router.index). Wire form, a JSON object per event:
`{worker_id, epoch, event_id, kind: stored|removed|cleared, blocks: [hash], parent_hash, tier}`; `epoch` changes
when the worker process restarts (ids start again at 1), `tier` is where the blocks are (device, host, disk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


class KVEventKind(StrEnum):
    """Blocks `stored` (now cached), `removed` (evicted), or every block of the worker `cleared`."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(slots=True)
class KVEvent:
    worker_id: str
    epoch: int
    event_id: int
    kind: KVEventKind
    blocks: list[int] = field(default_factory=list)  # chained block hashes (farm.protocol.hashing)
    parent_hash: int | None = None  # the parent of the first stored block, when it has one
    tier: str = "device"

    def to_dict(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "epoch": self.epoch, "event_id": self.event_id,
                "kind": self.kind.value, "blocks": self.blocks, "parent_hash": self.parent_hash, "tier": self.tier}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEvent:
        """An event as read from the stream: ValueError for an unknown kind, KeyError for a missing field (a
        missing epoch is 0 and a missing tier `device`, as the first workers wrote them)."""
        return cls(worker_id=d["worker_id"], epoch=int(d.get("epoch", 0)), event_id=int(d["event_id"]),
                   kind=KVEventKind(d["kind"]), blocks=[int(h) for h in d["blocks"]],
                   parent_hash=d.get("parent_hash"), tier=d.get("tier") or "device")


class KVEventHook(Protocol):
    """The engines' report of a KV event (BlockPool, the KV tiers, vLLM's translated events), from the engine's
    thread: it must not block. `tier` None means the publisher's own (device)."""

    def __call__(self, kind: KVEventKind, hashes: list[int], parent: int | None,
                 tier: str | None = None) -> None: ...
