"""Stream events (worker -> API): one JSON object per entry of the request's Redis Stream (`farm:out:<id>`), in
the entry's field `e`.

Workers build them through these types (`to_dict` is the wire form); a reader may parse one back with
`parse_event`. The stream writer (farm/streams.py) batches consecutive deltas and adds `w` (the writer) and `s`
(its sequence number) to every event, so a write retried across a Redis restart is read once; the types ignore
those two.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

EVENT_FIELD = "e"


@dataclass(frozen=True)
class _Event:
    type: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """The wire form: `type` plus every field that is set (None fields are left out)."""
        return {"type": self.type, **{k: v for k, v in asdict(self).items() if v is not None}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        if d.get("type") != cls.type:
            raise ValueError(f"not a {cls.type} event: {d.get('type')!r}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class StartEvent(_Event):
    """A worker took the request: its role, and for a decode (or aggregated) worker where the prompt's KV came
    from (`prefill` remote|local, the prefill worker, the transfer's figures)."""

    type: ClassVar[str] = "start"
    role: str
    worker: str
    prefill_worker: str | None = None
    prefill: str | None = None
    kv_transfer: dict[str, Any] | None = None


@dataclass(frozen=True)
class DeltaEvent(_Event):
    """New tokens: their text, count and ids, and (when asked for) `lp` = [[logprob, [[id, logprob], ...]], ...]
    aligned with `ids`."""

    type: ClassVar[str] = "delta"
    text: str
    n: int
    ids: list[int]
    lp: list[list[Any]] | None = None


@dataclass(frozen=True)
class DoneEvent(_Event):
    """The request finished: why, its usage (prompt, completion and cached tokens) and the workers that served it."""

    type: ClassVar[str] = "done"
    finish_reason: str
    usage: dict[str, int]
    prefill_worker: str | None = None
    decode_worker: str | None = None
    prefill: str | None = None


@dataclass(frozen=True)
class ErrorEvent(_Event):
    """The request failed: a message for the client and a machine-readable code (engine_error, invalid_task...)."""

    type: ClassVar[str] = "error"
    message: str
    code: str


Event = StartEvent | DeltaEvent | DoneEvent | ErrorEvent
_BY_TYPE: dict[str, type[_Event]] = {c.type: c for c in (StartEvent, DeltaEvent, DoneEvent, ErrorEvent)}


def parse_event(d: dict[str, Any]) -> Event:
    """The typed event of a wire dict (ValueError for an unknown type or missing fields)."""
    cls = _BY_TYPE.get(d.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown stream event type {d.get('type')!r}")
    try:
        return cls.from_dict(d)
    except TypeError as e:
        raise ValueError(f"malformed {cls.type} event: {e}") from None
