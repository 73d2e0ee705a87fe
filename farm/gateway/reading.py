"""What a reader makes of a request's typed events (Submission.events): the one read path of the HTTP routes
(streamed and not) and the batch driver.

- `until_decode_starts`: read until the worker that generates has started, so response headers can name both
  workers; what arrived before it is replayed (`replay`).
- `until_first_token`: read on until that worker's first token too: a request that fails before it may still go
  elsewhere (MoM's fallback), since nothing of it has reached the client.
- `stream_choice`: the deltas of one choice, returning its `done` event.
- `collect`: a whole choice (text, token ids and log-probabilities, finish reason, usage).
- `total_usage`: a response of several choices counts its prompt once and sums the completions.

A worker's `error` event becomes a `WorkerError` here, so callers handle failures as exceptions (the API maps
them to HTTP statuses in api/error_handlers.py; the batch driver records them).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field, replace

from farm.gateway.failures import WorkerError
from farm.protocol import DeltaEvent, DoneEvent, ErrorEvent, Event, StartEvent, Usage


@dataclass
class Answer:
    """One choice, read to its end."""

    text: str
    done: DoneEvent
    token_ids: list[int] = field(default_factory=list)  # every generated token's id
    logprobs: list[list] = field(default_factory=list)  # aligned with token_ids, when the request asked for them
    prompt_logprobs: list[list | None] | None = None  # per prompt token, when the request asked for them

    @property
    def finish_reason(self) -> str:
        return self.done.finish_reason

    @property
    def usage(self) -> Usage:
        return self.done.usage

    def prompt_only(self) -> Answer:
        """The choice of vLLM's `echo` with `max_tokens` 0: the one token generated is counted in the usage but
        not answered; the echoed prompt (and its log-probabilities) is the whole choice."""
        return replace(self, text="", token_ids=[], logprobs=[])


def _ended() -> WorkerError:
    return WorkerError("the request's event stream ended unexpectedly", "stream_ended")


def until_decode_starts(events: Iterator[Event]) -> tuple[StartEvent | DoneEvent, list[Event]]:
    """Read until the worker that generates has started. Returns that start event (or the `done` event of a
    request that finished before any, e.g. aborted) and the events read before it that are not starts."""
    buffered: list[Event] = []
    for ev in events:
        if isinstance(ev, StartEvent):
            if ev.decodes:
                return ev, buffered
        elif isinstance(ev, ErrorEvent):
            raise WorkerError(ev.message, ev.code)
        else:
            buffered.append(ev)
            if isinstance(ev, DoneEvent):
                return ev, buffered
    raise _ended()


def until_first_token(events: Iterator[Event]) -> tuple[StartEvent | DoneEvent, list[Event]]:
    """`until_decode_starts`, then on until the first token (a delta) or the end: the same start event and every
    event read after it but starts (what `replay` gives back)."""
    head, buffered = until_decode_starts(events)
    if isinstance(head, DoneEvent) or any(isinstance(ev, DeltaEvent) for ev in buffered):
        return head, buffered
    for ev in events:
        if isinstance(ev, ErrorEvent):
            raise WorkerError(ev.message, ev.code)
        if isinstance(ev, (DeltaEvent, DoneEvent)):
            buffered.append(ev)
            return head, buffered
    raise _ended()


def replay(buffered: list[Event], events: Iterator[Event]) -> Iterator[Event]:
    """The events `until_decode_starts` (or `until_first_token`) read, then the rest of the stream."""
    yield from buffered
    if not (buffered and isinstance(buffered[-1], (DoneEvent, ErrorEvent))):
        yield from events


def stream_choice(events: Iterable[Event]) -> Generator[DeltaEvent, None, DoneEvent]:
    """The deltas of one choice; returns its `done` event; a worker error raises WorkerError."""
    for ev in events:
        if isinstance(ev, DeltaEvent):
            yield ev
        elif isinstance(ev, DoneEvent):
            return ev
        elif isinstance(ev, ErrorEvent):
            raise WorkerError(ev.message, ev.code)
    raise _ended()


def collect(events: Iterable[Event], on_first_delta: Callable[[DeltaEvent], None] | None = None) -> Answer:
    """A whole choice: its text, its done event, its token ids and, when the worker sent them, log-probabilities
    (`on_first_delta` is told when the first tokens arrive: the prompt is prefilled)."""
    parts: list[str] = []
    ids: list[int] = []
    lps: list[list] = []
    prompt_lps = None
    gen = stream_choice(events)
    while True:
        try:
            ev = next(gen)
        except StopIteration as stop:
            return Answer("".join(parts), stop.value, ids, lps, prompt_lps)
        if not parts:
            prompt_lps = ev.prompt_lp  # with the first delta only
            if on_first_delta is not None:
                on_first_delta(ev)
        parts.append(ev.text)
        ids.extend(ev.ids)
        if ev.lp is not None:
            lps.extend(ev.lp)


def total_usage(usages: Iterable[Usage], per_prompt: int = 0) -> Usage:
    """The usage of a response of several choices: each prompt (and its cached part) counted once, the
    completions summed. Every `per_prompt` choices in a row share a prompt (0: all of them)."""
    usages = list(usages)
    if not usages:
        return Usage()
    firsts = usages[::per_prompt] if per_prompt else usages[:1]
    return Usage(sum(u.prompt_tokens for u in firsts), sum(u.completion_tokens for u in usages),
                 sum(u.cached_tokens for u in firsts))
