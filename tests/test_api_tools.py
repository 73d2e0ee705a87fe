"""Tool calls read by the model's parser (tool_choice auto) and reasoning split from content, through the chat route
against a scripted worker (tests/test_api_stream.py): the worker's text is fixed, so what the API makes of it is
exact, streamed and not. The default model is served here with `tool_call_parser: hermes` and
`reasoning_parser: qwen3`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from flask import Flask

from tests import test_api_stream
from tests.conftest import make_farm_env
from tests.security_helpers import farm_app
from tests.test_api_errors import post
from tests.test_api_stream import ScriptedWorker, both_start, deltas, done, sse

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = ['I will check.', '\n<tool', '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_call>']


@pytest.fixture(scope="module")
def app(redis_url, tmp_path_factory) -> Iterator[Flask]:
    tmp: Path = tmp_path_factory.mktemp("api-tools")
    override = yaml.safe_load(Path(make_farm_env(redis_url, tmp)["FARM_CONFIG"]).read_text())
    override["models"][0].update(tool_call_parser="hermes", reasoning_parser="qwen3")
    (tmp / "tools.yaml").write_text(yaml.safe_dump(override))
    with farm_app(redis_url, tmp, FARM_CONFIG=str(tmp / "tools.yaml")) as app:
        yield app


client = test_api_stream.client  # the test client with one scripted worker, on this module's app


def ask(cfg, **kw):
    return {"model": cfg.default_model, "messages": [{"role": "user", "content": "Weather in Oslo?"}], **kw}


def test_auto_tool_calls_read_by_the_models_parser(client, redis_client):
    c, cfg = client
    ScriptedWorker(redis_client, [both_start(), *deltas(*CALL), done()])
    body = post(c, "/v1/chat/completions", ask(cfg, tools=[TOOL])).get_json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "I will check."
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_auto_tool_calls_streamed_as_openai_streams_them(client, redis_client):
    c, cfg = client
    pieces = [*CALL[:-1], '"arguments": {"ci', 'ty": "Os', 'lo"}}\n</tool_call>']  # arguments as a model writes them
    w = ScriptedWorker(redis_client, [both_start(), *deltas(*pieces), done()])
    events = sse(post(c, "/v1/chat/completions", ask(cfg, tools=[TOOL], stream=True)))
    assert w.request.sampling.response_format is None  # auto: the model decides, nothing forced
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    content = "".join(ch["delta"].get("content") or "" for ch in chunks)
    assert content == "I will check.\n"  # the text before the call, as it came; nothing of the call itself
    calls = [tc for ch in chunks for tc in ch["delta"].get("tool_calls", [])]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",  # the name once it is written...
                        "function": {"name": "get_weather", "arguments": ""}}
    assert all(tc.keys() == {"index", "function"} and tc["index"] == 0 for tc in calls[1:])  # ...then arguments
    assert [tc["function"]["arguments"] for tc in calls[1:]] == ['{"ci', 'ty": "Os', 'lo"}']
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_a_streamed_call_with_token_ids_keeps_every_id_and_the_same_deltas(client, redis_client):
    """vLLM's `return_token_ids` on a stream the tool parser shapes: each event's ids in a chunk of their own (an
    empty delta, as vLLM sends ids whose text its parser holds), the content and call deltas as without them."""
    c, cfg = client
    ScriptedWorker(redis_client, [both_start(), *deltas(*CALL), done()])
    plain = [e["choices"][0]["delta"] for e in sse(post(c, "/v1/chat/completions", ask(cfg, tools=[TOOL],
                                                                                          stream=True)))[:-1]]
    w = ScriptedWorker(redis_client, [both_start(), *deltas(*CALL), done()])
    events = sse(post(c, "/v1/chat/completions", ask(cfg, tools=[TOOL], stream=True, return_token_ids=True)))[:-1]
    assert events[0]["prompt_token_ids"] == w.request.prompt_token_ids
    assert [i for e in events for i in e["choices"][0].get("token_ids", [])] == [100, 101, 102, 103]
    shaped = [e["choices"][0]["delta"] for e in events if "token_ids" not in e["choices"][0]]
    assert [{**d, "tool_calls": [{**tc, "id": None} for tc in d.get("tool_calls", [])]} for d in shaped] == \
        [{**d, "tool_calls": [{**tc, "id": None} for tc in d.get("tool_calls", [])]} for d in plain]


def test_text_that_only_looks_like_a_call_stays_text(client, redis_client):
    c, cfg = client
    ScriptedWorker(redis_client, [both_start(), *deltas("Use <tool", "_call> tags {not json", "</tool_call>"), done()])
    events = sse(post(c, "/v1/chat/completions", ask(cfg, tools=[TOOL], stream=True)))
    chunks = [e["choices"][0] for e in events[:-1]]
    assert "".join(ch["delta"].get("content") or "" for ch in chunks) == "Use <tool_call> tags {not json</tool_call>"
    assert chunks[-1]["finish_reason"] == "stop" and not any("tool_calls" in ch["delta"] for ch in chunks)


def test_reasoning_split_from_content_streamed_and_not(client, redis_client):
    c, cfg = client
    text = ["<think>", "The user asks", " about 2+2.</th", "ink>\n\n", "It is 4."]
    ScriptedWorker(redis_client, [both_start(), *deltas(*text), done()])
    msg = post(c, "/v1/chat/completions", ask(cfg)).get_json()["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "The user asks about 2+2."
    assert msg["content"] == "\n\nIt is 4."
    again = post(c, "/v1/chat/completions", ask(cfg)).get_json()["choices"][0]["message"]  # no worker: the cache
    assert again == {"role": "assistant", "content": "\n\nIt is 4."}, "the cache keeps the answer, not the thinking"
    ScriptedWorker(redis_client, [both_start(), *deltas(*text), done()])
    chunks = [e["choices"][0]["delta"] for e in sse(post(c, "/v1/chat/completions", ask(cfg, stream=True),
                                                         headers={"Cache-Control": "no-cache"}))[:-1]]
    assert "".join(d.get("reasoning") or "" for d in chunks) == "The user asks about 2+2."
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in chunks)
    assert "".join(d.get("content") or "" for d in chunks) == "\n\nIt is 4."
    first_content = next(i for i, d in enumerate(chunks) if d.get("content"))
    assert all(not d.get("reasoning") for d in chunks[first_content:])  # thinking first, then the answer
    ScriptedWorker(redis_client, [both_start(), *deltas("Just ", "4."), done()])
    msg = post(c, "/v1/chat/completions", ask(cfg), headers={"Cache-Control": "no-cache"}).get_json()
    msg = msg["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Just 4."}  # no thinking (qwen3 without <think>): all content


def test_reasoning_then_a_call(client, redis_client):
    c, cfg = client
    ScriptedWorker(redis_client, [both_start(), *deltas("<think>Need the tool.</think>", *CALL[1:]), done()])
    events = sse(post(c, "/v1/chat/completions", ask(cfg, tools=[TOOL], stream=True)))
    chunks = [e["choices"][0] for e in events[:-1]]
    assert "".join(ch["delta"].get("reasoning") or "" for ch in chunks) == "Need the tool."
    calls = [tc for ch in chunks for tc in ch["delta"].get("tool_calls", [])]
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Oslo"}
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_forced_calls_reach_the_worker_as_structured_output(client, redis_client):
    c, cfg = client
    w = ScriptedWorker(redis_client, [both_start(), *deltas('{"city": ', '"Oslo"}'), done()])
    body = post(c, "/v1/chat/completions", ask(cfg, tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})).get_json()
    assert w.request.sampling.response_format == {"type": "json_schema", "json_schema": {
        "name": "get_weather", "schema": TOOL["function"]["parameters"]}}
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"  # a named call ends as the engine says (vLLM's)
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_reasoning_through_the_messages_and_responses_apis(client, redis_client):
    """The same qwen3 answer through Anthropic's Messages API (a thinking block, then the text; streamed as
    thinking_delta, signature_delta, text_delta) and OpenAI's Responses API (a reasoning item, then the message);
    before, both dropped the thinking while usage still counted its tokens. A forced tool's call there stops
    for tool_use."""
    c, cfg = client
    text = ["<think>", "The user asks", " about 2+2.</think>", "\n\nIt is 4."]
    nocache = {"Cache-Control": "no-cache"}
    ask_a = {"model": cfg.default_model, "max_tokens": 50, "messages": [{"role": "user", "content": "2+2?"}]}
    ScriptedWorker(redis_client, [both_start(), *deltas(*text), done()])
    msg = post(c, "/v1/messages", ask_a, headers=nocache).get_json()
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"]
    assert msg["content"][0]["thinking"] == "The user asks about 2+2." and msg["content"][1]["text"] == "\n\nIt is 4."
    ScriptedWorker(redis_client, [both_start(), *deltas(*text), done()])
    resp = post(c, "/v1/messages", {**ask_a, "stream": True}, headers=nocache)
    events = [json.loads(b.split("data: ", 1)[1]) for b in resp.get_data(as_text=True).split("\n\n") if b]
    kinds = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert kinds[0] == "thinking_delta" and "signature_delta" in kinds and kinds[-1] == "text_delta"
    assert "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta") == \
        "The user asks about 2+2."
    ScriptedWorker(redis_client, [both_start(), *deltas(*text), done()])
    out = post(c, "/v1/responses", {"model": cfg.default_model, "input": "2+2?", "store": False},
               headers=nocache).get_json()["output"]
    assert [i["type"] for i in out] == ["reasoning", "message"]
    assert out[0]["content"][0]["text"] == "The user asks about 2+2."
    ScriptedWorker(redis_client, [both_start(), *deltas('{"city": ', '"Oslo"}'), done()])
    tools = [{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}]
    forced = post(c, "/v1/messages", {**ask_a, "tools": tools, "tool_choice": {"type": "tool", "name": "get_weather"}},
                  headers=nocache).get_json()
    assert forced["stop_reason"] == "tool_use" and forced["content"][-1]["input"] == {"city": "Oslo"}
