"""Streamed tool calls: content until a call begins, then the call's id and name as soon as they are written and
its arguments piece by piece; calls written another way read whole at the end; a call cut short ends as the
engine says."""

from __future__ import annotations

import json

import pytest

from farm.openai.answer import AnswerStream
from farm.openai.tool_stream import CallDelta, ToolStream
from farm.openai.tools import ToolRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def request(choice: str = "auto", parser: str | None = "hermes", parallel: bool = True) -> ToolRequest:
    function = "get_weather" if choice == "function" else None
    return ToolRequest([WEATHER, TIME], choice, function, parallel, parser)


def chars(text: str) -> list[str]:
    """The answer a token (here: a character) at a time, as an engine streams it."""
    return list(text)


def run(stream: ToolStream, pieces: list[str]) -> tuple[list[list[str | CallDelta]], list[str | CallDelta]]:
    """(what each piece produced, what the end produced)."""
    during = [list(stream.feed(p)) for p in pieces]
    return during, list(stream.finish())


def calls_of(out: list[str | CallDelta]) -> list[tuple[str, str, dict]]:
    """(id, name, arguments) per call, put together from the deltas as a client does."""
    calls: dict[int, dict] = {}
    for d in out:
        if isinstance(d, CallDelta):
            c = calls.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
            assert d.id is None or d.id == c["id"]
            c["arguments"] += d.arguments
    return [(c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


HERMES_TWO = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo \\"}\\" {x}"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_hermes_calls_stream_their_name_then_their_arguments_as_written():
    s = ToolStream(request())
    during, end = run(s, chars(HERMES_TWO))
    flat = [d for piece in during for d in piece]
    assert "".join(d for d in flat if isinstance(d, str)) == "Let me look.\n"
    calls = calls_of(flat)  # every call complete before the answer ended
    assert [(n, a) for _, n, a in calls] == [("get_weather", {"city": 'Oslo "}" {x}'}), ("get_time", {})]
    assert end == []
    heads = [i for i, piece in enumerate(during) if any(isinstance(d, CallDelta) and d.name for d in piece)]
    first_args = next(i for i, piece in enumerate(during)
                      if any(isinstance(d, CallDelta) and d.index == 0 and d.arguments for d in piece))
    assert heads[0] == HERMES_TWO.index('"arguments": {') + len('"arguments": ')  # the name goes once its head is read
    assert first_args == heads[0] and sum(  # ...with its arguments' brace, then the rest a piece at a time
        1 for piece in during for d in piece if isinstance(d, CallDelta) and d.index == 0 and d.arguments) > 10
    assert s.calls and [c.name for c in s.calls] == ["get_weather", "get_time"] and not s.cut


def test_streamed_and_whole_answers_agree():
    for req, text in [(request(), HERMES_TWO),
                      (request(parser="llama3_json"),
                       '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", '
                       '"parameters": {}}'),
                      (request("required", None), '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                                  '"parameters": {"city": "Lima"}}]')]:
        s = ToolStream(req)
        during, end = run(s, chars(text))
        streamed = calls_of([d for piece in during for d in piece] + end)
        _, whole = req.read(text)
        assert [(n, a) for _, n, a in streamed] == [(c.name, json.loads(c.arguments)) for c in whole]
        assert [c.id for c in s.calls] == [i for i, _, _ in streamed]


def test_a_call_written_another_way_is_read_whole_at_the_end():
    text = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    s = ToolStream(request())
    during, end = run(s, chars(text))
    assert not any(d for piece in during for d in piece)
    assert [(n, a) for _, n, a in calls_of(end)] == [("get_weather", {"city": "Oslo"})]
    assert len([d for d in end if isinstance(d, CallDelta)]) == 1  # whole: id, name and arguments at once


def test_text_that_only_looks_like_a_call_start_stays_content():
    s = ToolStream(request())
    during, end = run(s, ["a <", "b> c", " <tool"])
    assert "".join(d for piece in during for d in piece) + "".join(end) == "a <b> c <tool"
    assert s.calls == []
    s = ToolStream(request())  # a block that is no call: the answer stays text, as vLLM returns it
    during, end = run(s, chars("<tool_call> not json </tool_call>"))
    assert "".join(d for piece in during for d in piece) + "".join(end) == "<tool_call> not json </tool_call>"


def test_one_call_when_parallel_calls_are_off():
    s = ToolStream(request(parallel=False))
    during, end = run(s, chars(HERMES_TWO))
    assert [n for _, n, _ in calls_of([d for piece in during for d in piece] + end)] == ["get_weather"]
    assert len(s.calls) == 1


@pytest.mark.parametrize("engine_reason", ["length", "stop"])
def test_a_call_cut_short_keeps_its_streamed_part_and_ends_as_the_engine_says(engine_reason):
    answer = AnswerStream(request(), None)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'
    out = [d for p in chars(text) for d in answer.feed(p)] + list(answer.finish())
    deltas = [d for d in out if isinstance(d, CallDelta)]
    assert deltas[0].name == "get_weather" and "".join(d.arguments for d in deltas) == '{"city": "Os'
    assert answer.finish_reason(engine_reason) == engine_reason
    done = AnswerStream(request(), None)
    list(done.feed(text + 'lo"}}\n</tool_call>'))
    list(done.finish())
    assert done.finish_reason("stop") == "tool_calls"


def test_a_named_function_streams_every_token_as_its_arguments():
    s = ToolStream(request("function"))
    during, end = run(s, ['{"city"', ': "Oslo"}'])
    out = [d for piece in during for d in piece] + end
    assert out[0].name == "get_weather" and out[0].id and out[1].id is None
    assert "".join(d.arguments for d in out) == '{"city": "Oslo"}'
