"""Anthropic's Messages API, POST /v1/messages: the translation (farm.openai.anthropic) on its own, then the
official `anthropic` SDK against the real app (through httpx's WSGI transport, API keys on) with a scripted
worker on the real Redis (tests/test_api_stream.py), so the exact event stream is known. The real model's answer
equals /v1/chat/completions' in tests/test_e2e_openai.py."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import anthropic
import httpx
import httpx2
import pytest
from flask import Flask

from farm.openai import anthropic as a
from farm.openai.api_error import APIError
from tests.security_helpers import KEY_A, farm_app
from tests.test_api_errors import GHOST, _fill_ghost
from tests.test_api_stream import USAGE, ScriptedWorker, both_start, deltas, done, live_ghost


# ---- the translation ---------------------------------------------------------------------------
def test_request_becomes_the_chat_body():
    req = a.parse_request({
        "model": "m", "max_tokens": 7, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                     {"role": "assistant", "content": "Hello"}],
        "stop_sequences": ["END", ""], "temperature": 0, "top_p": 0.5, "top_k": 3, "stream": True,
        "metadata": {"user_id": "u-1"}})
    assert a.to_chat_body(req) == {
        "model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \nthere"},
                                   {"role": "assistant", "content": "Hello"}],
        "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "stop": ["END"],
        "include_stop_str_in_output": True, "add_generation_prompt": False, "continue_final_message": True,
        "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("body,where", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "n": 2}, "n: Extra inputs"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]: 'image' content blocks are not supported"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "'document' content blocks"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "'tool_use' blocks belong in assistant"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
     "input_schema: Field required"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}},
     "needs the tool's 'name'"),
    ({"max_tokens": "1", "messages": [{"role": "user", "content": "x"}]}, "max_tokens: Input should be a valid int"),
    ({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text: Field required"),
    ({"max_tokens": 1, "messages": []}, "messages: List should have at least 1 item"),
])
def test_bad_requests_are_refused_naming_the_problem(body, where):
    with pytest.raises(APIError) as e:
        a.parse_request({"model": "m", **body})
    assert e.value.status == 400 and where in e.value.message


def test_answer_and_stop_sequence_back():
    chat = {"id": "chatcmpl-xyz", "model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 3},
            "choices": [{"message": {"role": "assistant", "content": "one twoEND"}, "finish_reason": "stop"}]}
    msg = a.from_chat_completion(chat, ["X", "END"])
    assert msg == {"id": "msg_xyz", "type": "message", "role": "assistant", "model": "m",
                   "content": [{"type": "text", "text": "one two"}], "stop_reason": "stop_sequence",
                   "stop_sequence": "END", "usage": {"input_tokens": 5, "output_tokens": 3,
                                                     "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}
    chat["choices"][0]["finish_reason"] = "length"
    assert a.from_chat_completion(chat, ["END"])["stop_reason"] == "max_tokens"
    assert a.from_chat_completion(chat, [])["content"][0]["text"] == "one twoEND"
    assert a.error_body(503, "busy", "overloaded") == (529, {"type": "error", "error": {
        "type": "overloaded_error", "message": "busy"}})
    assert a.error_body(401, "no")[1]["error"]["type"] == "authentication_error"


def _chunk(**kw) -> str:
    return "data: " + json.dumps({"id": "chatcmpl-1", "model": "m", **kw}) + "\n\n"


def test_stream_holds_back_what_may_begin_a_stop_sequence():
    chat = [_chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
            _chunk(choices=[{"index": 0, "delta": {"content": "a <"}}]) + _chunk(
                choices=[{"index": 0, "delta": {"content": "b> c <"}}]),
            _chunk(choices=[{"index": 0, "delta": {"content": "/"}}]),
            _chunk(choices=[{"index": 0, "delta": {"content": "x>"}}]),
            _chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]),
            _chunk(choices=[], usage={"prompt_tokens": 4, "completion_tokens": 6}), "data: [DONE]\n\n"]
    events = [json.loads(b.split("data: ", 1)[1]) for b in "".join(a.translate_stream(chat, ["</x>"], lambda: 4))
              .split("\n\n") if b]
    texts = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    assert texts == ["a ", "<b> c "]  # "<", then "</x>" held back until they were (not) the stop sequence
    assert events[-2] == {"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "</x>"},
                          "usage": {"input_tokens": 4, "output_tokens": 6, "cache_read_input_tokens": 0,
                                    "cache_creation_input_tokens": 0}}


def test_tool_use_translates_both_ways():
    req = a.parse_request({"model": "m", "max_tokens": 50, "tools": [
        {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {
            "city": {"type": "string"}}}}], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "Weather in Oslo?"},
                     {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {
                         "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                                                  {"type": "text", "text": "And tomorrow?"}]}]})
    body = a.to_chat_body(req)
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                               "parameters": req.tools[0].input_schema}}]
    assert (body["tool_choice"], body["parallel_tool_calls"]) == ("required", False)
    assert body["messages"][1:] == [
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "And tomorrow?"}]
    chat = {"id": "chatcmpl-9", "model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 3}, "choices": [
        {"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}}]}
    msg = a.from_chat_completion(chat, [])
    assert msg["stop_reason"] == "tool_use"
    assert msg["content"] == [{"type": "tool_use", "id": "toolu_7", "name": "get_weather", "input": {"city": "Rome"}}]


def test_calls_stream_as_tool_use_blocks():
    call = {"index": 0, "id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    chat = [_chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
            _chunk(choices=[{"index": 0, "delta": {"content": "Let me check."}}]),
            _chunk(choices=[{"index": 0, "delta": {"tool_calls": [call]}}]),
            _chunk(choices=[{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}}]),
            _chunk(choices=[{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]}}]),
            _chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
            _chunk(choices=[], usage={"prompt_tokens": 4, "completion_tokens": 6}), "data: [DONE]\n\n"]
    events = [json.loads(b.split("data: ", 1)[1]) for b in "".join(a.translate_stream(chat, [], lambda: 4))
              .split("\n\n") if b]
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None), ("content_block_start", 0), ("ping", None), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    assert events[5]["content_block"] == {"type": "tool_use", "id": "toolu_7", "name": "get_weather", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in events if e.get("index") == 1 and "delta" in e) == \
        '{"city": "Rome"}'
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_a_forced_tools_call_stops_for_tool_use_json_or_streamed():
    """`tool_choice: {type: tool}`: the chat path ends a forced call with "stop" (as OpenAI does); Anthropic's
    answer holding a tool_use block says "tool_use", where an agent's loop goes on (it stopped on "end_turn")."""
    call = {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    chat = {"id": "chatcmpl-3", "model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 3}, "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": None,
                                                          "tool_calls": [call]}}]}
    assert a.from_chat_completion(chat, [])["stop_reason"] == "tool_use"
    chunks = [_chunk(choices=[{"index": 0, "delta": {"tool_calls": [{**call, "index": 0}]}}]),
              _chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]), "data: [DONE]\n\n"]
    events = [json.loads(b.split("data: ", 1)[1]) for b in "".join(a.translate_stream(chunks, [])).split("\n\n") if b]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    chat["choices"][0]["message"] = {"role": "assistant", "content": "Sunny."}  # no call: the turn ended
    assert a.from_chat_completion(chat, [])["stop_reason"] == "end_turn"


def test_thinking_both_ways():
    """A reasoning model's thought as Anthropic's thinking block (JSON: first; streamed: thinking_delta, then its
    signature_delta as the block closes), `thinking` as the reasoning template's enable_thinking, an earlier
    answer's thinking blocks accepted back and left out of the prompt, `display: omitted` sending no text."""
    chat = {"id": "chatcmpl-4", "model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 9}, "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "4",
                                                          "reasoning": "2 and 2 make 4."}}]}
    msg = a.from_chat_completion(chat, [])
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"]
    assert msg["content"][0]["thinking"] == "2 and 2 make 4." and msg["content"][0]["signature"]
    assert a.from_chat_completion(chat, [], show_thinking=False)["content"][0]["thinking"] == ""
    chunks = [_chunk(choices=[{"index": 0, "delta": {"reasoning": "2 and 2"}}]),
              _chunk(choices=[{"index": 0, "delta": {"reasoning": " make 4."}}]),
              _chunk(choices=[{"index": 0, "delta": {"content": "4"}}]),
              _chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]), "data: [DONE]\n\n"]
    events = [json.loads(b.split("data: ", 1)[1]) for b in "".join(a.translate_stream(chunks, [])).split("\n\n") if b]
    deltas_ = [(e["index"], e["delta"]["type"]) for e in events if e["type"] == "content_block_delta"]
    assert deltas_ == [(0, "thinking_delta"), (0, "thinking_delta"), (0, "signature_delta"), (1, "text_delta")]
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == ["thinking", "text"]
    history = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "easy", "signature": "s"},
                                                 {"type": "redacted_thinking", "data": "opaque"},
                                                 {"type": "text", "text": "4", "citations": None}]},
               {"role": "user", "content": "And 3+3?"}]
    for thinking, flag in (({"type": "enabled", "budget_tokens": 2048}, True), ({"type": "adaptive"}, True),
                           ({"type": "disabled"}, False)):
        body = a.to_chat_body(a.parse_request({"model": "m", "max_tokens": 4096, "messages": history,
                                               "thinking": thinking}))
        assert body["chat_template_kwargs"] == {"enable_thinking": flag}
        assert body["messages"][1] == {"role": "assistant", "content": "4"}
    only = [_chunk(choices=[{"index": 0, "delta": {"reasoning": "Still thinking"}}]),  # cut off by max_tokens
            _chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "length"}]), "data: [DONE]\n\n"]
    events = [json.loads(b.split("data: ", 1)[1]) for b in "".join(a.translate_stream(only, [])).split("\n\n") if b]
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == ["thinking", "text"]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"  # the JSON answer's blocks and stop, streamed
    with pytest.raises(APIError):  # reasoning is the assistant's
        a.parse_request({"model": "m", "max_tokens": 9, "messages": [
            {"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]}]})


def test_output_config_strict_tools_and_consecutive_turns():
    """`output_config.format` is the chat path's json_schema format, a tool's `strict` its function's; turns of one
    role in a row are one turn, as Anthropic combines them (a template that wants them to alternate refused them)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = a.to_chat_body(a.parse_request({
        "model": "m", "max_tokens": 9, "output_config": {"format": {"type": "json_schema", "schema": schema},
                                                         "effort": "low"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "strict": True}],
        "messages": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"},
                     {"role": "assistant", "content": "a"}, {"role": "assistant", "content": [
                         {"type": "text", "text": "b"}, {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}))
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert body["tools"][0]["function"]["strict"] is True
    assert [(m["role"], m["content"]) for m in body["messages"]] == [("user", "one\n\ntwo"), ("assistant", "a\n\nb"),
                                                                   ("tool", "ok")]
    assert body["messages"][1]["tool_calls"][0]["id"] == "t1"


def test_a_failure_mid_stream_is_an_error_event():
    chat = [_chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": "hi"}}]),
            'data: {"error": {"message": "boom", "type": "server_error", "param": null, "code": "no_workers"}}\n\n',
            "data: [DONE]\n\n"]
    out = "".join(a.translate_stream(chat, []))
    assert out.endswith('event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"boom"}}\n\n')
    assert "message_stop" not in out


# ---- the SDK against the app -------------------------------------------------------------------
@pytest.fixture(scope="module")
def app(redis_url, tmp_path_factory) -> Iterator[Flask]:
    # without the semantic layer, as tests/test_api_responses.py: its jailbreak head blocks about 1 in 1,000 of
    # these prompts with their random suffixes ("Say hello (0586a0)"), and a scripted worker left waiting then
    # answers the next test's request (a CI run met it)
    with farm_app(redis_url, tmp_path_factory.mktemp("api-messages"), FARM_API_KEYS=KEY_A,
                  FARM_SEMANTIC__ENABLED="false") as app:
        yield app


@pytest.fixture
def ghost(app, redis_client):
    """One live worker (GHOST) whose tasks a ScriptedWorker takes; the app's config."""
    with live_ghost(app, redis_client) as cfg:
        yield cfg


def sdk(app: Flask, key: str = KEY_A) -> anthropic.Anthropic:
    # no semantic cache: every request here must reach the scripted worker (the SDK brings its own httpx2)
    return anthropic.Anthropic(api_key=key, base_url="http://localhost", max_retries=0,
                               default_headers={"Cache-Control": "no-cache"},
                               http_client=httpx2.Client(transport=httpx2.WSGITransport(app=app)))


def raw(app: Flask, body, headers: dict[str, str] | None = None) -> httpx.Response:
    with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://localhost") as c:
        return c.post("/v1/messages", content=json.dumps(body), headers={
            "content-type": "application/json", "x-api-key": KEY_A, "anthropic-version": "2023-06-01",
            **(headers or {})})


def assert_anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error"
    assert body["request_id"] == resp.headers["request-id"] and body["request_id"].startswith("req_")
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind and body["error"]["message"]
    assert "Traceback" not in resp.text
    return body["error"]["message"]


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{text} ({uuid.uuid4().hex[:6]})"}]


def test_no_worker_is_a_503_overloaded_error(app, redis_client):
    cfg = app.extensions["farm"].cfg
    resp = raw(app, {"model": cfg.default_model, "max_tokens": 3, "messages": user("x")})
    assert_anthropic_error(resp, 503, "overloaded_error")
    assert int(resp.headers["Retry-After"]) > 0


def test_message_with_x_api_key(app, ghost, redis_client):
    w = ScriptedWorker(redis_client, [both_start(), *deltas("Hel", "lo"), done("stop")])
    raw_resp = sdk(app).messages.with_raw_response.create(
        model=ghost.default_model, max_tokens=5, messages=user("Say hello"), metadata={"user_id": "someone"},
        extra_body={"temperature": 0, "top_k": 3})  # this SDK no longer declares the sampling fields
    msg = raw_resp.parse()
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == ghost.default_model
    assert [(b.type, b.text) for b in msg.content] == [("text", "Hello")]
    assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)
    # the prompt's tokens read from the prefix cache apart, as Anthropic and vLLM count them
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens, msg.usage.output_tokens) == (
        USAGE["prompt_tokens"] - USAGE["cached_tokens"], USAGE["cached_tokens"], USAGE["completion_tokens"])
    assert raw_resp.headers["x-farm-decode-worker"] == GHOST
    assert raw_resp.headers["request-id"] == "req_" + raw_resp.headers["x-request-id"].removeprefix("chatcmpl-")
    s = w.request.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.stop) == (5, 0.0, 3, [])


def test_stream_events_in_order_and_stop_sequence(app, ghost, redis_client):
    w = ScriptedWorker(redis_client, [both_start(), *deltas("Hel", "lo wor", "ld EN", "D"), done("stop")])
    with sdk(app).messages.stream(model=ghost.default_model, max_tokens=20, messages=user("Count"),
                                  stop_sequences=["END"]) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    raw_kinds = [k for k in kinds if k != "text"]  # "text": the SDK's own event beside each delta (it drops pings)
    assert raw_kinds[:2] == ["message_start", "content_block_start"]
    assert raw_kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw_kinds[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == "Hello world "
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens) == (
        USAGE["prompt_tokens"] - USAGE["cached_tokens"], USAGE["cached_tokens"], USAGE["completion_tokens"])
    s = w.request.sampling
    assert s.stop == ["END"] and s.include_stop_str_in_output


def test_max_tokens_and_the_raw_stream(app, ghost, redis_client):
    ScriptedWorker(redis_client, [both_start(), *deltas("a", "b"), done("length")])
    resp = raw(app, {"model": ghost.default_model, "max_tokens": 2, "messages": user("Go"), "stream": True},
               headers={"Authorization": f"Bearer {KEY_A}", "x-api-key": ""})  # the Bearer header works too
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    blocks = [b.split("\n") for b in resp.text.split("\n\n") if b]
    assert all(b[0].startswith("event: ") and b[1].startswith("data: ") for b in blocks)
    events = [json.loads(b[1][len("data: "):]) for b in blocks]
    assert [b[0][len("event: "):] for b in blocks] == [e["type"] for e in events]
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta",
                                           "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] > 0  # the prompt's count, known before the answer
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    ScriptedWorker(redis_client, [both_start(), *deltas("x"), done("length")])
    msg = sdk(app).messages.create(model=ghost.default_model, max_tokens=1, messages=user("Go"))
    assert msg.stop_reason == "max_tokens"


def test_system_prompt_reaches_the_template(app, ghost, redis_client):
    tok = app.extensions["farm"].tokenizer(ghost.default_model)
    prompts = []
    for system in ("Be terse.", [{"type": "text", "text": "Be terse. "},
                                 {"type": "text", "text": "Answer every question in one plain word, never more."}]):
        w = ScriptedWorker(redis_client, [both_start(), *deltas("ok"), done()])
        sdk(app).messages.create(model=ghost.default_model, max_tokens=3, messages=user("Hi"), system=system)
        prompts.append(w.request.prompt_token_ids)
    assert "Be terse." in tok.decode(prompts[0])
    # blocks on lines of their own, as vLLM joins a message's text blocks
    assert "Be terse. \nAnswer every question in one plain word, never more." in tok.decode(prompts[1])
    assert len(prompts[1]) > len(prompts[0]) + 8


def test_errors_in_anthropics_shape(app, ghost):
    with pytest.raises(anthropic.AuthenticationError) as e:
        sdk(app, key="sk-wrong-key").messages.create(model=ghost.default_model, max_tokens=3, messages=user("Hi"))
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    assert_anthropic_error(raw(app, {"model": ghost.default_model, "max_tokens": 3, "messages": user("x")},
                               headers={"x-api-key": ""}), 401, "authentication_error")
    ok = {"model": ghost.default_model, "max_tokens": 3, "messages": user("x")}
    assert "max_tokens" in assert_anthropic_error(
        raw(app, {k: v for k, v in ok.items() if k != "max_tokens"}), 400, "invalid_request_error")
    assert "frequency_penalty" in assert_anthropic_error(raw(app, {**ok, "frequency_penalty": 1}), 400,
                                                         "invalid_request_error")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    assert "image" in assert_anthropic_error(
        raw(app, {**ok, "messages": [{"role": "user", "content": [image]}]}), 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError):
        sdk(app).messages.create(model=ghost.default_model, max_tokens=3, messages=user("Hi"), stop_sequences=["a"] * 5)
    assert_anthropic_error(raw(app, {**ok, "model": "no-such-model"}), 404, "not_found_error")
    assert_anthropic_error(_broken(app), 400, "invalid_request_error")
    too_long = {**ok, "max_tokens": ghost.model(ghost.default_model).max_model_len + 1}
    assert "context length" in assert_anthropic_error(raw(app, too_long), 400, "invalid_request_error")
    # a routing error, raised before the route is matched: Anthropic's shape too (and the Allow header kept)
    with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://localhost") as c:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            resp = c.get(path, headers={"x-api-key": KEY_A})
            assert_anthropic_error(resp, 405, "invalid_request_error")
            assert "POST" in resp.headers["Allow"]
        assert set(c.get("/v1/chat/completions", headers={"x-api-key": KEY_A}).json()) == {"error"}  # OpenAI's


def test_count_tokens_is_the_prompt_a_message_request_sends(app, ghost, redis_client):
    """/v1/messages/count_tokens through the SDK: the very prompt ids a message request sends the worker (its system
    prompt and tools rendered as the chat path renders them), no worker needed; its own fields only."""
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    ask = {"model": ghost.default_model, "system": "Be brief.", "messages": user("Weather in Oslo?")}
    plain = sdk(app).messages.count_tokens(**ask).input_tokens
    with_tools = sdk(app).messages.count_tokens(**ask, tools=tools).input_tokens
    assert with_tools > plain + 30  # the tools' descriptions are in the prompt
    w = ScriptedWorker(redis_client, [both_start(), *deltas("ok"), done()])
    sdk(app).messages.create(**ask, tools=tools, max_tokens=5)
    assert len(w.request.prompt_token_ids) == with_tools
    resp = httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://localhost").post(
        "/v1/messages/count_tokens", json={**ask, "max_tokens": 5}, headers={"x-api-key": KEY_A})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in resp.json()["error"]["message"]


def _broken(app: Flask) -> httpx.Response:
    with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://localhost") as c:
        return c.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json",
                                                                    "x-api-key": KEY_A})


def test_every_worker_busy_is_a_529_overloaded_error(app, ghost, redis_client, monkeypatch):
    monkeypatch.setattr(ghost.router, "admission_wait_s", 0.5)  # the bounded wait for room, short here
    _fill_ghost(app, redis_client)
    with pytest.raises(anthropic.APIStatusError) as e:
        sdk(app).messages.create(model=ghost.default_model, max_tokens=3, messages=user("Hi"))
    assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
    assert int(e.value.response.headers["Retry-After"]) == ghost.router.retry_after_s

