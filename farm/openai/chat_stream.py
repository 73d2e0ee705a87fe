"""The chat path's SSE read back by the routes that serve another protocol on it (Anthropic's Messages API,
OpenAI's Responses API): its `data:` payloads, however the chat stream cut them into writes, fed to that
protocol's translator; and the `event:`/`data:` blocks those protocols send."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def named_event(kind: str, data: dict[str, Any]) -> str:
    """One SSE block with an event name (Anthropic's and the Responses API's streams name every event)."""
    return f"event: {kind}\ndata: {_dumps(data)}\n\n"


def streamed_with_usage() -> dict[str, Any]:
    """The chat body's fields for a stream that ends with its usage, which a translated stream reports."""
    return {"stream": True, "stream_options": {"include_usage": True}}


class ChunkTranslator:
    """Turns the chat stream's payloads into another protocol's events: `chunk` for each JSON chunk, `end` once
    the chat stream is over (at `[DONE]`, or when it stops without one); nothing after `closed`."""

    closed = False

    def feed(self, payload: str) -> str:
        """The SSE text for one `data:` payload of the chat stream ("" when it adds nothing yet)."""
        if self.closed:
            return ""
        if payload == "[DONE]":
            return self.end()
        return self.chunk(json.loads(payload))

    def chunk(self, chunk: dict[str, Any]) -> str:
        raise NotImplementedError

    def choices(self, chunk: dict[str, Any]) -> str:
        """A chunk's choices handed to this protocol's `_reasoning`, `_text`, `_tool_call` and `_finished`, in
        order."""
        out = ""
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                out += self._reasoning(delta["reasoning"])
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                out += self._finished(choice["finish_reason"])
        return out

    def _reasoning(self, text: str) -> str:
        """A piece of the model's reasoning (a model with a reasoning parser); a protocol without a place for it
        leaves it out."""
        return ""

    def _text(self, text: str) -> str:
        raise NotImplementedError

    def _tool_call(self, call: dict[str, Any]) -> str:
        raise NotImplementedError

    def _finished(self, reason: str) -> str:
        raise NotImplementedError

    def end(self) -> str:
        raise NotImplementedError


def translate(chunks: Iterable[str | bytes], translator: ChunkTranslator) -> Iterator[str]:
    """The translator's events for each `data:` payload of the chat stream `chunks`, then its end; one write per
    chat write. Closing this generator closes `chunks`, which ends the chat stream's generation (the client went
    away)."""
    buf = ""
    try:
        for piece in chunks:
            buf += piece.decode() if isinstance(piece, bytes) else piece
            *blocks, buf = buf.split("\n\n")
            out = "".join(translator.feed(b[len("data: "):]) for b in blocks if b.startswith("data: "))
            if out:
                yield out
        tail = translator.end()
        if tail:
            yield tail
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
