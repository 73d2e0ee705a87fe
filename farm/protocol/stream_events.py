"""Stream events (worker -> API), typed on both sides of the wire.

Workers build events with these types; `to_dict` is the wire form. Events travel in *reply batches*: one entry
of the reading API process's reply stream (`farm:out:<reader id>`, farm.protocol.keys) per flush of a worker's
stream writer, holding the events of every request of that reader the flush carries, in order:

    {"w": <writer id>, "s": <sequence number>, "r": {<request id>: [<event>, ...], ...}}

`w` and `s` let a reader skip a batch it already has: a flush retried across a Redis restart or failover is
read once. The reader turns each event back into its type with `parse_event`; nothing downstream reads raw
dicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, ClassVar

EVENT_FIELD = "e"
# Why a request ended, as vLLM names it (its FinishReason: vllm:request_success_total's finished_reason label);
# an engine's done event says stop, length or abort, and an engine error becomes an error event
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of one finished request: prompt (of which `cached_tokens` came from the prefix cache) and completion."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens}

    @classmethod
    def from_dict(cls, d: Any) -> Usage:
        if isinstance(d, Usage):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"usage must be an object, got {type(d).__name__}")
        return cls(int(d.get("prompt_tokens", 0)), int(d.get("completion_tokens", 0)), int(d.get("cached_tokens", 0)))


@dataclass(frozen=True, slots=True)
class _Event:
    type: ClassVar[str]
    _names: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        """The wire form: `type` plus every field that is set (None fields are left out)."""
        d: dict[str, Any] = {"type": self.type}
        for name in self._names:
            v = getattr(self, name)
            if v is not None:
                d[name] = v.to_dict() if isinstance(v, Usage) else v
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        if d.get("type") != cls.type:
            raise ValueError(f"not a {cls.type} event: {d.get('type')!r}")
        return cls(**{k: d[k] for k in cls._names if k in d})


def _named(cls: type[_Event]) -> type[_Event]:
    """Record the field names once per class (to_dict / from_dict run per token)."""
    cls._names = tuple(f.name for f in fields(cls))
    return cls


@_named
@dataclass(frozen=True, slots=True)
class StartEvent(_Event):
    """A worker took the request: its role, and for a decode (or aggregated) worker where the prompt's KV came
    from (`prefill` remote|local, the prefill worker, the transfer's figures)."""

    type: ClassVar[str] = "start"
    role: str
    worker: str
    prefill_worker: str | None = None
    prefill: str | None = None
    kv_transfer: dict[str, Any] | None = None

    @property
    def decodes(self) -> bool:
        """The worker that will generate the tokens has started (not a prefill worker's start)."""
        return self.role in ("decode", "both")


@_named
@dataclass(frozen=True, slots=True)
class DeltaEvent(_Event):
    """New tokens: their text, count and ids, and (when asked for) `lp` = [[logprob, [[id, logprob], ...]], ...]
    aligned with `ids`; a request's first delta carries `prompt_lp` when it asks for the prompt's (one per prompt
    token, null for the first)."""

    type: ClassVar[str] = "delta"
    text: str
    n: int
    ids: list[int]
    lp: list[list[Any]] | None = None
    prompt_lp: list[list[Any] | None] | None = None


@_named
@dataclass(frozen=True, slots=True)
class DoneEvent(_Event):
    """The request finished: why, its usage and the workers that served it (`migrations`: how often the gateway
    moved it to another worker on the way; set by the gateway, never by a worker)."""

    type: ClassVar[str] = "done"
    finish_reason: str
    usage: Usage
    prefill_worker: str | None = None
    decode_worker: str | None = None
    prefill: str | None = None
    migrations: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.usage, Usage):
            object.__setattr__(self, "usage", Usage.from_dict(self.usage))


@_named
@dataclass(frozen=True, slots=True)
class ErrorEvent(_Event):
    """The request failed: a message for the client and a machine-readable code (engine_error, invalid_task,
    worker_lost, orphaned...). `HANDOVER_FAILED` is the one a reader does not pass on: the prefill could not send
    the decode task, so the reader places the request again."""

    type: ClassVar[str] = "error"
    message: str
    code: str

    HANDOVER_FAILED: ClassVar[str] = "handover_failed"
    INVALID_REQUEST: ClassVar[str] = "invalid_request"  # the engine could not do what the request asked


Event = StartEvent | DeltaEvent | DoneEvent | ErrorEvent
_BY_TYPE: dict[str, type[_Event]] = {c.type: c for c in (StartEvent, DeltaEvent, DoneEvent, ErrorEvent)}


def parse_event(d: dict[str, Any]) -> Event:
    """The typed event of a wire dict (ValueError for an unknown type or missing fields)."""
    cls = _BY_TYPE.get(d.get("type")) if isinstance(d, dict) else None  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown stream event type {d.get('type') if isinstance(d, dict) else d!r}")
    try:
        return cls.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"malformed {cls.type} event: {e}") from None


# -- reply batches -----------------------------------------------------------------------------------------
def encode_reply(writer: str, seq: int, events: dict[str, list[dict[str, Any]]]) -> str:
    """One reply-stream entry: a writer's flush of events for the requests of one reader."""
    return json.dumps({"w": writer, "s": seq, "r": events}, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class ReplyBatch:
    """A decoded reply-stream entry: who wrote it, its sequence number, and each request's typed events."""

    writer: str
    seq: int
    events: dict[str, list[Event]]


def decode_reply(raw: bytes | str) -> ReplyBatch:
    """A reply-stream entry back into typed events; ValueError when it is not one (a reader drops it).

    Each request's events are read on their own: one request's malformed event (a worker's bug, or an event type
    from a newer worker) ends that request with an `error` event (code `bad_event`) after its well-formed ones,
    and never takes the other requests' events of the flush with it; dropped, they would leave holes in answers
    that still finished as if whole."""
    d = json.loads(raw)
    if not isinstance(d, dict) or not isinstance(d.get("r"), dict):
        raise ValueError("not a reply batch")
    writer, seq = d.get("w"), d.get("s")
    if not isinstance(writer, str) or type(seq) is not int:
        raise ValueError("a reply batch needs its writer and sequence number")
    out: dict[str, list[Event]] = {}
    for rid, evs in d["r"].items():
        if not isinstance(evs, list):
            out[rid] = [ErrorEvent(f"malformed reply from worker {writer[:80]}: events not a list", "bad_event")]
            continue
        parsed: list[Event] = []
        for e in evs:
            try:
                parsed.append(parse_event(e))
            except ValueError as err:
                parsed.append(ErrorEvent(f"malformed event from worker {writer[:80]}: {err}", "bad_event"))
                break
        out[rid] = parsed
    return ReplyBatch(writer, seq, out)
