"""A streamed answer's tool calls as OpenAI streams them: content until a call begins, then each call's id and
name as soon as they are written, and its arguments piece by piece while the model writes them (as vLLM's tool
parsers stream them), not the whole call once the answer ends.

`CallScanner` reads the calls incrementally from the text after the first call's start. It streams a call whose
object opens with its name and then its arguments object (`{"name": "f", "arguments": {...`, the order every
parser's format and the forced `required` schema write); a call written another way is read whole when the answer
ends, as before, so nothing is lost when a model strays from its format.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from farm.models.tokenization import partial_stop
from farm.openai.tool_parsers import PYTHON_TAG, ToolCall, call_id, get_parser
from farm.openai.tools import ToolRequest

# A call's head up to the opening brace of its arguments; the name as check_tools allows it.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.:-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')
_HEAD_MAX = 160  # characters after a call's start by which its head must have matched, else it is read whole


@dataclass
class CallDelta:
    """A piece of a streamed call: the first of each call carries its id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class _Json:
    """Brace depth of JSON text read a character at a time (strings and their escapes skipped)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


class CallScanner:
    """Reads calls out of text fed to it piece by piece, starting where the first call begins.

    States: `seek` (the next call's start: `<tool_call>` for hermes, the next `{` for the JSON formats), `head`
    (its text until `_HEAD` matches), `args` (the arguments object, streamed as written), `tail` (the rest of
    the call's object, skipped). A head that does not match stops the streaming (`stopped`): the answer's calls
    after the streamed ones are then read whole at its end."""

    def __init__(self, start: str, limit: int | None):
        self.start, self.limit = start, limit  # limit: at most this many calls (parallel_tool_calls false: 1)
        self.state, self.buf = "seek", ""
        self.calls: list[ToolCall] = []  # streamed, arguments as written so far
        self.open = False  # the last call's arguments have not closed yet
        self.stopped = False
        self._json = _Json()

    def feed(self, text: str) -> Iterator[CallDelta]:
        self.buf += text
        while not self.stopped and self.buf:
            before = (self.state, len(self.buf))
            yield from getattr(self, f"_{self.state}")()
            if (self.state, len(self.buf)) == before:
                return  # needs more text

    def _seek(self) -> Iterator[CallDelta]:
        if self.limit is not None and len(self.calls) >= self.limit:
            self.stopped = True
            return
        marker = self.start or "{"
        at = self.buf.find(marker)
        if at < 0:
            self.buf = self.buf[len(self.buf) - partial_stop(self.buf, [marker]):]
            return
        self.buf = self.buf[at + len(self.start):]
        self.state = "head"
        yield from ()

    def _head(self) -> Iterator[CallDelta]:
        m = _HEAD.match(self.buf)
        if m is None:
            if len(self.buf) > _HEAD_MAX:
                self.stopped = True
            return
        call = ToolCall(call_id(), m.group(1), "")
        self.calls.append(call)
        self.open, self.state, self.buf = True, "args", self.buf[m.end() - 1:]
        self._json = _Json()
        yield CallDelta(len(self.calls) - 1, "", call.id, call.name)

    def _closed_at(self) -> int | None:
        """Where in `buf` the object being read closes (the index after its brace), or None: all of it is inside."""
        for i, ch in enumerate(self.buf):
            self._json.step(ch)
            if self._json.depth == 0:
                return i + 1
        return None

    def _args(self) -> Iterator[CallDelta]:
        end = self._closed_at()
        if end is None:
            piece, self.buf = self.buf, ""
            yield from self._arguments(piece)
            return
        yield from self._arguments(self.buf[:end])
        self.open, self.state, self.buf = False, "tail", self.buf[end:]
        self._json = _Json(depth=1)  # inside the call's object, after its arguments

    def _arguments(self, piece: str) -> Iterator[CallDelta]:
        last = self.calls[-1]
        self.calls[-1] = ToolCall(last.id, last.name, last.arguments + piece)
        yield CallDelta(len(self.calls) - 1, piece)

    def _tail(self) -> Iterator[CallDelta]:
        end = self._closed_at()
        self.state, self.buf = ("tail", "") if end is None else ("seek", self.buf[end:])
        yield from ()


@dataclass
class ToolStream:
    """Turns one choice's text deltas into content deltas and call deltas (OpenAI's streamed `tool_calls`)."""

    request: ToolRequest
    text: str = ""
    sent: int = 0  # characters of `text` sent as content
    calls: list[ToolCall] = field(default_factory=list)
    scanner: CallScanner | None = None  # from where the first call begins: the rest of the answer is calls

    def feed(self, delta: str) -> Iterator[str | CallDelta]:
        self.text += delta
        r = self.request
        if r.choice == "function":  # every token is the named function's arguments
            if not self.calls:
                self.calls.append(ToolCall(call_id(), str(r.function), ""))
                yield CallDelta(0, delta, self.calls[0].id, r.function)
            elif delta:
                yield CallDelta(0, delta)
            return
        if self.scanner is not None:
            yield from self.scanner.feed(delta)
            return
        limit = None if r.parallel else 1
        if r.choice == "required":  # a forced JSON list of {name, parameters}
            self.scanner = CallScanner("", limit)
            yield from self.scanner.feed(self.text)
            return
        parser = get_parser(r.parser)
        if not parser.starts_anywhere:  # llama3_json: a call is the whole answer, so its first characters decide
            head = self.text.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return  # not decided yet
            if head.startswith(("{", PYTHON_TAG)):
                self.scanner = CallScanner("", limit)
                yield from self.scanner.feed(self.text)
                return
            yield from self._content(len(self.text))
            return
        at = self.text.find(parser.start, self.sent)
        if at >= 0:
            self.scanner = CallScanner(parser.start, limit)
            yield from self._content(at)
            yield from self.scanner.feed(self.text[at:])
            return
        yield from self._content(len(self.text) - partial_stop(self.text, [parser.start]))

    def _content(self, end: int) -> Iterator[str]:
        if end > self.sent:
            piece, self.sent = self.text[self.sent:end], end
            yield piece

    def finish(self) -> Iterator[str | CallDelta]:
        """What is left once the answer ended: the calls not streamed, read from the whole answer; or, when it held
        no call at all, its held text as content."""
        r = self.request
        if r.choice == "function":
            if not self.calls:
                self.calls.append(ToolCall(call_id(), str(r.function), ""))
                yield CallDelta(0, "", self.calls[0].id, r.function)
            return
        streamed = self.scanner.calls if self.scanner is not None else []
        _, read = r.read(self.text)
        self.calls = list(streamed)
        for i, c in enumerate(read[len(streamed):], start=len(streamed)):  # those written another way
            self.calls.append(c)
            yield CallDelta(i, c.arguments, c.id, c.name)
        if not self.calls and r.choice != "required":  # a forced answer's JSON is never content (read above)
            yield from self._content(len(self.text))

    @property
    def cut(self) -> bool:
        """Whether the answer ended inside a streamed call's arguments (max_tokens): that call is incomplete."""
        return self.scanner is not None and self.scanner.open
