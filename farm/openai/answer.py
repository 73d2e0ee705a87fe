"""A generated answer's text as the parts of a chat message: reasoning (farm.openai.reasoning), content, and tool
calls (farm.openai.tools), whole or streamed. Reasoning is split off first; only the answer after it may hold calls."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from farm.openai.reasoning import REASONING_PARSERS, ReasoningStream, Thought
from farm.openai.tool_parsers import ToolCall
from farm.openai.tool_stream import CallDelta, ToolStream
from farm.openai.tools import ToolRequest


@dataclass
class ReadAnswer:
    """The parts of a whole answer."""

    content: str | None
    finish_reason: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def read_answer(text: str, finish_reason: str | None, tools: ToolRequest | None = None,
                reasoning_parser: str | None = None, echo: str = "") -> ReadAnswer:
    """`echo` (vLLM's: the last message's content) starts the content; it is never reasoning nor a call."""
    reasoning, content = None, text
    if reasoning_parser is not None:
        reasoning, content = REASONING_PARSERS[reasoning_parser]().split(text)
    calls: list[ToolCall] = []
    if tools is not None and content is not None:
        content, calls = tools.read(content)
        finish_reason = tools.finish_reason(finish_reason, calls)
    if echo:
        content = echo + (content or "")
    return ReadAnswer(content, finish_reason, reasoning, calls)


class AnswerStream:
    """One choice's text deltas as chunk pieces: `Thought` (reasoning), `str` (content) and `CallDelta`."""

    def __init__(self, tools: ToolRequest | None, reasoning_parser: str | None):
        self.reasoning = ReasoningStream(REASONING_PARSERS[reasoning_parser]()) if reasoning_parser else None
        self.tools = ToolStream(tools) if tools is not None else None

    def _route(self, pieces: Iterable[str | Thought]) -> Iterator[str | Thought | CallDelta]:
        for p in pieces:
            if isinstance(p, Thought) or self.tools is None:
                yield p
            else:
                yield from self.tools.feed(p)

    def feed(self, delta: str) -> Iterator[str | Thought | CallDelta]:
        yield from self._route(self.reasoning.feed(delta) if self.reasoning is not None else (delta,))

    def finish(self) -> Iterator[str | Thought | CallDelta]:
        if self.reasoning is not None:
            yield from self._route(self.reasoning.finish())
        if self.tools is not None:
            yield from self.tools.finish()

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.tools is None or self.tools.cut:  # a call cut short (max_tokens) ends as the engine says
            return engine_reason
        return self.tools.request.finish_reason(engine_reason, self.tools.calls)
