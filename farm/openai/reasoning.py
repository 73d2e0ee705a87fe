"""Reasoning output: for models that think in tags before they answer, the thinking goes to the message's `reasoning`
(and `reasoning_content`, its older name, which DeepSeek's API and many clients read) and the answer to `content`,
as vLLM's `--reasoning-parser` splits them (`models[].reasoning_parser`).

- `deepseek_r1`: the template opens `<think>` in the prompt, so the output is thinking up to `</think>`; an output
  without `</think>` is all thinking (cut short, or never finished).
- `qwen3`: thinking only when the output has `</think>` (`enable_thinking: false` answers directly: all content).

Both drop a leading `<think>` the model writes itself. Text-based, so one parser serves both engines.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from farm.models.tokenization import partial_stop

THINKING_FLAG = "enable_thinking"  # the chat-template variable that switches a reasoning model's thinking (Qwen3, ...)

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Thought:
    """A streamed piece of reasoning (a `str` piece is content)."""

    text: str


class ReasoningParser:
    name = ""
    unterminated_is_reasoning = False  # an output without END: thinking (deepseek_r1) or an answer (qwen3)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer, as `ReasoningStream` hands it out."""
        opened = text.lstrip().startswith(START)
        if not opened and not self.unterminated_is_reasoning:
            return None, text  # qwen3: an answer that does not open with START is all content
        body = text[text.index(START) + len(START):] if opened else text
        if END not in body:
            return body, None  # still thinking when it ended
        thought, answer = body.split(END, 1)
        return thought, (answer or None)


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    unterminated_is_reasoning = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


class ReasoningStream:
    """Splits one choice's text deltas into thoughts and content as they come. Until END appears, text may be either
    (qwen3: an answer without tags is content, known only when it does not start with START), so it is held back
    only while undecided; a tail that may begin END is held back one delta."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` handed out
        self.thinking: bool | None = True if parser.unterminated_is_reasoning else None  # None: undecided
        self.done_thinking = False

    def feed(self, delta: str) -> Iterator[str | Thought]:
        self.text += delta
        if self.thinking is None:  # qwen3: thinking only if the answer opens with START
            head = self.text.lstrip()
            if START.startswith(head) and len(head) < len(START):
                return
            self.thinking = head.startswith(START)
        if self.sent == 0 and self.text.lstrip().startswith(START):
            self.sent = self.text.index(START) + len(START)
        if self.thinking and not self.done_thinking:
            at = self.text.find(END, self.sent)
            if at < 0:
                end = len(self.text) - partial_stop(self.text, [END])
                if end > self.sent:
                    yield Thought(self.text[self.sent:end])
                    self.sent = end
                return
            if at > self.sent:
                yield Thought(self.text[self.sent:at])
            self.sent, self.done_thinking = at + len(END), True
        if len(self.text) > self.sent:
            yield self.text[self.sent:]
            self.sent = len(self.text)

    def finish(self) -> Iterator[str | Thought]:
        """What is still held back once the answer ended."""
        if len(self.text) <= self.sent:
            return
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        if self.thinking and not self.done_thinking:
            yield Thought(rest)
        else:
            yield rest
