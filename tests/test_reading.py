"""The read path's waits (farm/gateway/reading.py): what the API holds back before it answers 200, so a failure
before the first token can still fall back to another model (issue 29, item 5)."""

from __future__ import annotations

import pytest

from farm.gateway.failures import WorkerError
from farm.gateway.reading import collect, replay, until_decode_starts, until_first_token
from farm.protocol import DeltaEvent, DoneEvent, ErrorEvent, StartEvent, Usage

PREFILL = StartEvent("prefill", "prefill-0")
DECODE = StartEvent("decode", "decode-0", prefill_worker="prefill-0", prefill="remote")
DONE = DoneEvent("stop", Usage(5, 2))


def _delta(text: str) -> DeltaEvent:
    return DeltaEvent(text, 1, [7])


def test_until_first_token_reads_past_the_start_and_replays_the_token():
    events = iter([PREFILL, DECODE, _delta("Hi"), _delta(" there"), DONE])
    head, buffered = until_first_token(events)
    assert head is DECODE and buffered == [_delta("Hi")]
    assert collect(replay(buffered, events)).text == "Hi there"  # nothing lost, nothing repeated


def test_a_failure_between_the_decode_start_and_the_first_token_raises_before_any_answer():
    """The case bench/mom_choice's kill phase met: the worker started, then was lost before its first token.
    until_decode_starts would already have returned (the API had answered 200); until_first_token raises."""
    lost = ErrorEvent("the worker was lost", "worker_lost")
    head, _ = until_decode_starts(iter([DECODE, lost]))
    assert head is DECODE
    with pytest.raises(WorkerError) as e:
        until_first_token(iter([DECODE, lost]))
    assert e.value.code == "worker_lost"
    with pytest.raises(WorkerError, match="ended unexpectedly"):
        until_first_token(iter([PREFILL, DECODE]))


def test_a_request_that_ends_without_a_token_or_had_one_before_its_start_returns_at_once():
    head, buffered = until_first_token(iter([PREFILL, DECODE, DONE]))
    assert head is DECODE and buffered == [DONE]
    head, buffered = until_first_token(iter([DONE]))  # aborted before any start
    assert head is DONE and buffered == [DONE]
    rest = iter([_delta("a"), DECODE, _delta("b"), DONE])  # a token before the decode start: no further read
    head, buffered = until_first_token(rest)
    assert head is DECODE and buffered == [_delta("a")]
    assert next(rest) == _delta("b")
