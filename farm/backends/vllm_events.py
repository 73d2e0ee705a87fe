"""vLLM's KV cache events -> the farm's KV events (farm/router/kv_publisher.py), so the router sees vLLM's blocks.

vLLM (with `kv_events_config`, publisher `zmq`) publishes from its engine core a ZMQ PUB stream of
multipart messages `(topic, seq: 8-byte big-endian, payload)`, where the payload is a msgpack-encoded
`KVEventBatch(ts, events[, data_parallel_rank])` of tagged `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` structs (vllm/distributed/kv_events.py). Up to v0.11 the structs are `array_like`
(`[ts, [["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium], ...]]`); later releases
encode them as maps with a `type` tag. Both are decoded here from plain msgpack, field by field, so the
farm does not depend on vLLM's class layout of one release. A ROUTER "replay" socket returns missed
batches by sequence number; the subscriber uses it when it sees a gap.

Why we re-hash: vLLM's block hashes are not the farm's. vLLM hashes `(parent, token ids, extra keys)`
with sha256 over a pickle/CBOR encoding from a seeded NONE_HASH (bytes, or their low 64 bits with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), while the API and router compute the farm's contract (xxh3_64 of
the tokens as LE u32, seed 1337, chained as Dynamo does; docs/ARCHITECTURE.md). A router looking up the
farm's hashes would never find vLLM's. `BlockStored` carries the stored blocks' token ids and the parent's
vLLM hash, so each stored block is re-hashed with farm.protocol.hashing, chained from the farm hash we
recorded for that parent, and a map vLLM hash -> farm hash (reference-counted per tier) turns later
`BlockRemoved` events into removals of the right farm hashes. A stored block whose parent we never saw
(events lost beyond the replay buffer) cannot be re-hashed: it is skipped and counted, which only makes
the router under-estimate that worker's cache (a wasted hit, never a wrong answer).

Cache salts: a salted request (GenerationRequest.cache_salt, given to vLLM as its `cache_salt`) has the salt
in the extra keys of its first block's hash, and vLLM publishes it there (`extra_keys[0]` of a BlockStored
from token 0: untagged, the bare salt string beside any LoRA name or multimodal pairs). A parentless stored
block's farm chain therefore starts from `salt_root(salt)`, as the API and the built-in engine start it, so
the router finds a tenant's vLLM blocks only under that tenant's hashes.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from farm.protocol.hashing import block_hashes, salt_root
from farm.protocol.kv_events import KVEventHook, KVEventKind

log = logging.getLogger(__name__)
MAX_IPC_PATH = 100  # a unix socket's path (sun_path holds 107 bytes on Linux)

# Field order of vLLM's structs (array_like encoding is positional; trailing defaults may be omitted).
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end-of-replay marker

class VllmNotInstalled(RuntimeError):
    """A model is configured with `backend: vllm` but vllm (or one of its dependencies) is missing."""


def _require(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise VllmNotInstalled(
            f"the vLLM backend needs the Python package {module!r} ({e}); install the extra on a GPU host: "
            "`.venv/bin/pip install -e '.[vllm]'`"
        ) from e


def medium_tier(medium: str | None) -> str:
    """vLLM's storage medium name -> the farm's tier (device, host, disk)."""
    if medium is None:
        return "device"
    m = medium.lower()
    if m in ("gpu", "cuda", "device", "hbm") or m.startswith(("gpu", "cuda")):
        return "device"
    if any(s in m for s in ("cpu", "host", "dram", "pinned", "memory")):
        return "host"
    return "disk"  # disk, ssd, nvme, remote stores: the cheapest weight, never over-promised


def decode_event_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """A vLLM KVEventBatch payload -> (ts, events as dicts with a `type` key, data_parallel_rank)."""
    msgspec = _require("msgspec")
    obj = msgspec.msgpack.decode(payload)
    if isinstance(obj, (list, tuple)):  # array_like batch: [ts, events, (dp_rank)]
        ts, raw, dp = obj[0], obj[1], (obj[2] if len(obj) > 2 else None)
    elif isinstance(obj, dict):
        ts, raw, dp = obj.get("ts", 0.0), obj.get("events", []), obj.get("data_parallel_rank")
    else:
        raise ValueError(f"not a vLLM KV event batch: {type(obj).__name__}")
    return float(ts), [normalize_event(e) for e in raw], dp


def normalize_event(e: Any) -> dict[str, Any]:
    """One tagged event (array_like list or map) -> {"type": tag, field: value, ...} with defaults."""
    if isinstance(e, (list, tuple)):
        tag, values = (e[0], list(e[1:])) if e else ("", [])
        fields = EVENT_FIELDS.get(tag, ())
        out: dict[str, Any] = dict(zip(fields, values, strict=False))
    elif isinstance(e, dict):
        tag = e.get("type", "")
        out = {k: v for k, v in e.items() if k != "type"}
    else:
        tag, out = "", {}
    for f in EVENT_FIELDS.get(tag, ()):
        out.setdefault(f, None)
    out["type"] = tag
    return out


def first_block_salt(extra_keys: Any) -> str | None:
    """The cache salt in a parentless BlockStored's extra keys ("" when its first block has none), or None
    when they cannot be read (several strings: a LoRA name beside it, which is never indexed anyway)."""
    first = extra_keys[0] if isinstance(extra_keys, (list, tuple)) and extra_keys else None
    if not first:
        return ""
    salts = [k for k in (first if isinstance(first, (list, tuple)) else [first]) if isinstance(k, str)]
    if len(salts) > 1:
        return None
    return salts[0] if salts else ""


def _key(h: Any) -> Hashable:
    """vLLM hashes arrive as bytes or ints (or lists, if a decoder turned bytes into arrays)."""
    return tuple(h) if isinstance(h, list) else h


class VllmKVEventTranslator:
    """Applies decoded vLLM events and publishes the farm's events through `publish` (KVEventPublisher)."""

    def __init__(self, publish: KVEventHook, block_size: int):
        self.publish = publish
        self.block_size = block_size
        self._farm: dict[Hashable, int] = {}  # vLLM hash -> farm hash (whatever tier holds it)
        self._tiers: dict[Hashable, set[str]] = {}  # vLLM hash -> tiers holding it
        self._refs: dict[tuple[int, str], int] = {}  # (farm hash, tier) -> vLLM blocks mapped onto it
        self.stored = 0
        self.removed = 0
        self.skipped = 0  # blocks we could not translate (unknown parent, other block size, LoRA, ...)
        self.device_blocks = 0  # vLLM's device blocks holding an indexed prefix (the engine's cached blocks)

    def __len__(self) -> int:
        return len(self._farm)

    def farm_hash(self, vllm_hash: Any) -> int | None:
        return self._farm.get(_key(vllm_hash))

    def apply(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            kind = ev.get("type")
            if kind == "BlockStored":
                self._stored(ev)
            elif kind == "BlockRemoved":
                self._removed(ev)
            elif kind == "AllBlocksCleared":
                self.reset()
            else:
                log.debug("ignoring vLLM KV event of type %r", kind)

    def reset(self) -> None:
        """Forget everything and tell the router this worker holds nothing."""
        self._farm.clear()
        self._tiers.clear()
        self._refs.clear()
        self.device_blocks = 0
        self.publish(KVEventKind.CLEARED, [], None)

    def _stored(self, ev: dict[str, Any]) -> None:
        hashes = [_key(h) for h in ev.get("block_hashes") or []]
        n = len(hashes)
        tokens = list(ev.get("token_ids") or [])
        bs = ev.get("block_size")
        why = None
        if bs is not None and int(bs) != self.block_size:
            why = f"block size {bs} != the farm's {self.block_size}"
        elif ev.get("group_idx") not in (None, 0):
            why = f"KV cache group {ev.get('group_idx')} (only group 0 is indexed)"
        elif ev.get("lora_id") is not None or ev.get("lora_name"):
            why = "a LoRA adapter's blocks (the farm routes base-model prefixes)"
        elif len(tokens) != n * self.block_size:
            why = f"{len(tokens)} token ids for {n} blocks"
        parent_vllm = ev.get("parent_block_hash")
        parent = None
        if why is None and parent_vllm is not None:
            parent = self._farm.get(_key(parent_vllm))
            if parent is None:
                why = "its parent block was never reported"
        elif why is None:  # the first blocks of a prompt: a salted one chains from its salt's root
            salt = first_block_salt(ev.get("extra_keys"))
            if salt is None:
                why = f"unreadable extra keys {str(ev.get('extra_keys'))[:80]}"
            parent = salt_root(salt)
        if why is not None:
            self.skipped += n
            log.debug("vLLM BlockStored of %d blocks not indexed: %s", n, why)
            return
        tier = medium_tier(ev.get("medium"))
        ours = block_hashes(tokens, self.block_size, parent=parent)
        new = []
        for vh, fh in zip(hashes, ours, strict=True):
            self._farm[vh] = fh
            tiers = self._tiers.setdefault(vh, set())
            if tier in tiers:
                continue  # vLLM re-reported a block it holds: nothing changes
            tiers.add(tier)
            self.device_blocks += tier == "device"
            refs = self._refs.get((fh, tier), 0)
            self._refs[(fh, tier)] = refs + 1
            if refs == 0:
                new.append(fh)
        if new:
            self.stored += len(new)
            self.publish(KVEventKind.STORED, new, parent, tier)

    def _removed(self, ev: dict[str, Any]) -> None:
        tier = medium_tier(ev.get("medium"))
        if ev.get("group_idx") not in (None, 0):
            return
        gone = []
        for vh in (_key(h) for h in ev.get("block_hashes") or []):
            tiers = self._tiers.get(vh)
            if not tiers or tier not in tiers:
                continue  # never indexed (skipped when stored)
            tiers.discard(tier)
            self.device_blocks -= tier == "device"
            fh = self._farm[vh]
            refs = self._refs[(fh, tier)] - 1
            if refs:
                self._refs[(fh, tier)] = refs  # another vLLM block (other extra keys) still holds it
            else:
                del self._refs[(fh, tier)]
                gone.append(fh)
            if not tiers:
                del self._tiers[vh]
                del self._farm[vh]
        if gone:
            self.removed += len(gone)
            self.publish(KVEventKind.REMOVED, gone, None, tier)


class VllmKVEventSubscriber:
    """Follows vLLM's ZMQ KV event stream in a thread and feeds the translator.

    vLLM binds its PUB socket and its replay ROUTER socket; ours connects to them. They are `ipc://` sockets in a
    directory of this process's own (mode 0700, made afresh, removed on stop): on `tcp://127.0.0.1` any local
    user (or a sidecar in the pod) could ask the replay socket for the last 10,000 batches, whose stored blocks
    carry their token ids, so every tenant's prompts, or publish forged events into the router's index. Sequence
    gaps (the first batches, sent before ZMQ connected, and any later loss) are filled from the replay socket; if
    that fails the index for this worker is reset (`cleared`) rather than left wrong.
    """

    def __init__(self, translator: VllmKVEventTranslator, topic: str = "", replay_timeout_s: float = 2.0):
        zmq = _require("zmq")
        self.translator = translator
        self.replay_timeout_s = replay_timeout_s
        self.topic = topic
        self._dir = Path(tempfile.mkdtemp(prefix="farm-kv-events-"))  # 0700, ours: nobody else may connect
        self.endpoint = f"ipc://{self._dir}/events"
        self.replay_endpoint = f"ipc://{self._dir}/replay"
        if len(self.replay_endpoint) - len("ipc://") > MAX_IPC_PATH:
            raise ValueError(f"the KV event socket path {self.replay_endpoint} is longer than a unix socket's "
                             f"{MAX_IPC_PATH} characters: set TMPDIR to a shorter directory")
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.connect(self.endpoint)  # connects (and reconnects) once vLLM's engine core has bound it
        self.next_seq = 0
        self.batches = 0
        self.gaps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)

    def start(self) -> VllmKVEventSubscriber:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sub.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._sub.poll(200):
                    continue
                _topic, seq_b, payload = self._sub.recv_multipart()
                self.handle(int.from_bytes(seq_b, "big", signed=True), payload)
            except Exception:  # a bad batch must not stop the stream
                log.exception("vLLM KV event batch failed")

    def handle(self, seq: int, payload: bytes) -> None:
        """One published batch: skip duplicates, fill a gap before it, then apply it."""
        if seq < self.next_seq:
            return
        if seq > self.next_seq:
            self.gaps += 1
            if not self._replay(self.next_seq, seq):
                log.warning("vLLM KV events %d..%d lost; resetting this worker's index", self.next_seq, seq - 1)
                self.translator.reset()
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        _ts, events, _dp = decode_event_batch(payload)
        self.translator.apply(events)
        self.next_seq = seq + 1
        self.batches += 1

    def _replay(self, start: int, until: int) -> bool:
        """Ask vLLM's replay socket for batches start..until-1; True if all of them arrived."""
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])  # the REQ envelope vLLM's ROUTER expects
            while sock.poll(int(self.replay_timeout_s * 1000)):
                frames = sock.recv_multipart()
                seq_b, payload = frames[-2], frames[-1]
                if seq_b == END_SEQ:
                    break
                seq = int.from_bytes(seq_b, "big", signed=True)
                if self.next_seq <= seq < until:
                    if seq != self.next_seq:
                        return False  # the replay buffer no longer holds what we missed
                    self._apply(seq, payload)
            return self.next_seq >= until
        finally:
            sock.close(linger=0)
