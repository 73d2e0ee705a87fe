"""OpenAI's Responses API, /v1/responses: the translation (farm.openai.responses_api, responses_output) on its own,
then the official `openai` SDK against the real app (httpx's WSGI transport, two API keys) with a scripted worker
on the real Redis (tests/test_api_stream.py), so the exact answer and the prompt the worker got are known. The route
is the chat route's own `generate`, so the semantic layer applies as on chat (tests/test_api_messages.py and the chat
tests cover it); it is off here so every request reaches the scripted worker."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import openai
import pytest
from flask import Flask

from farm.openai import responses_api as r
from farm.openai import responses_output as ro
from farm.openai.api_error import APIError
from farm.protocol.keys import owner_responses_key
from farm.tenancy.api_keys import digest, owner_of
from tests import test_api_messages
from tests.security_helpers import KEY_A, KEY_B, farm_app
from tests.test_api_stream import USAGE, ScriptedWorker, both_start, deltas, done


# ---- the translation ---------------------------------------------------------------------------
def test_request_becomes_the_chat_body():
    req = r.parse_request({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0, "top_p": 0.5,
        "user": "u-1", "stream": True, "metadata": {"k": "v"}, "reasoning": {"effort": "low"},
        "truncation": "disabled", "store": False,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                               {"type": "input_text", "text": "there"}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello",
                                                                         "annotations": []}]},
                  {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Oslo"}'},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                  {"role": "developer", "content": "Answer in French."}],
        "tools": [{"type": "function", "name": "weather", "description": "the weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}],
        "tool_choice": {"type": "function", "name": "weather"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}}})
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "answer"}]
    assert r.to_chat_body(req, history) == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, *history,
                     {"role": "user", "content": "Hi there"},
                     {"role": "assistant", "content": "Hello", "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                     {"role": "developer", "content": "Answer in French."}],
        "max_tokens": 7, "temperature": 0, "top_p": 0.5, "user": "u-1",
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"},
                                                                   "strict": True}},
        "tools": [{"type": "function", "function": {
            "name": "weather", "description": "the weather", "strict": True,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}}, "parallel_tool_calls": False,
        "stream": True, "stream_options": {"include_usage": True}}
    items = r.input_items(req)
    assert [i["type"] for i in items] == ["message", "message", "function_call", "function_call_output", "message"]
    assert items[0]["content"] == [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}]
    assert all(i["id"] and i["status"] == "completed" for i in items)
    one = r.parse_request({"model": "m", "input": "Hi", "text": {"format": {"type": "json_object"}}})
    assert r.to_chat_body(one, []) == {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                       "response_format": {"type": "json_object"}}
    auto = r.parse_request({"model": "m", "input": "Hi", "truncation": "auto"})  # as vLLM: drop the earliest tokens
    assert r.to_chat_body(auto, [])["truncate_prompt_tokens"] == -1


@pytest.mark.parametrize("body,where", [
    ({"input": "x", "frequency_penalty": 1}, "Unknown parameter: 'frequency_penalty'"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input[0]: 'input_image' items are not supported"),
    ({"input": [{"type": "item_reference", "id": "rs_1"}]}, "'item_reference' items are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]: 'input_file' content is not supported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]: 'web_search' tools are not supported"),
    ({"input": "x", "background": True}, "'background' is not supported"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "'include' is not supported"),
    ({"input": "x", "truncation": "middle"}, "truncation: Input should be 'disabled' or 'auto'"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens: Input should be greater than or equal to 1"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role: Input should be"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments: Field required"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata: Dictionary should have at most 16"),
    ({"input": "x", "temperature": "hot"}, "temperature: Input should be a valid number"),
    # stored as sent and never charged as prompt tokens: bounded as the store's own ids are
    ({"input": [{"role": "user", "content": "x", "id": "A" * 257}]}, "input[0].id: String should have at most 256"),
    ({"input": [{"type": "function_call_output", "call_id": "c" * 257, "output": "x"}]}, "input[0].call_id"),
])
def test_bad_requests_are_refused_naming_the_problem(body, where):
    with pytest.raises(APIError) as e:
        r.parse_request({"model": "m", **body})
    assert e.value.status == 400 and where in e.value.message, e.value.message


def test_a_reasoning_models_thought_is_a_reasoning_item_both_ways():
    """A reasoning model's thought (the chat path's `reasoning`) as a reasoning item before the message, JSON or
    streamed (response.reasoning_text.delta / .done, as vLLM streams it); sent back in `input`, it is kept among
    the input items and left out of the prompt."""
    ctx = ro.ResponseContext(r.parse_request({"model": "m", "input": "2+2?"}))
    chat = {"id": "chatcmpl-1", "model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 9},
            "choices": [{"message": {"role": "assistant", "content": "4", "reasoning": "2 and 2 make 4."},
                         "finish_reason": "stop"}]}
    obj, turn = ro.from_chat_completion(chat, ctx)
    assert [i["type"] for i in obj["output"]] == ["reasoning", "message"]
    assert obj["output"][0]["content"] == [{"type": "reasoning_text", "text": "2 and 2 make 4."}]
    assert turn.chat_message() == {"role": "assistant", "content": "4"}

    def chunk(**kw) -> str:
        return "data: " + json.dumps({"id": "chatcmpl-1", "model": "m", **kw}) + "\n\n"

    finals = []
    stream = [chunk(choices=[{"index": 0, "delta": {"reasoning": "2 and 2"}}]),
              chunk(choices=[{"index": 0, "delta": {"reasoning": " make 4."}}]),
              chunk(choices=[{"index": 0, "delta": {"content": "4"}}]),
              chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]), "data: [DONE]\n\n"]
    events = [json.loads(b.split("data: ", 1)[1]) for b in
              "".join(ro.translate_stream(stream, ctx, lambda f, t: finals.append(f))).split("\n\n") if b]
    kinds = [e["type"] for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
                          "response.reasoning_text.done"]
    assert events[5]["text"] == "2 and 2 make 4." and events[6]["item"]["type"] == "reasoning"
    assert [i["type"] for i in finals[0]["output"]] == ["reasoning", "message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    back = r.parse_request({"model": "m", "input": [
        {"role": "user", "content": "2+2?"}, obj["output"][0], {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"}]})
    assert [m["role"] for m in r.to_chat_body(back, [])["messages"]] == ["user", "assistant", "user"]
    assert [i["type"] for i in r.input_items(back)] == ["message", "reasoning", "message", "message"]


def test_a_chat_error_names_this_apis_parameter():
    assert r.renamed(APIError(400, "too long", param="max_tokens")).param == "max_output_tokens"
    assert r.renamed(APIError(400, "bad", param="messages[2].content")).param == "input"
    assert r.renamed(APIError(400, "bad", param="seed")).param == "seed"


def test_tool_calls_answer_becomes_function_call_items():
    """The translation of a chat answer with tool calls (the chat path's tool calling lands separately)."""
    ctx = ro.ResponseContext(r.parse_request({"model": "m", "input": "weather?",
                                              "tools": [{"type": "function", "name": "weather"}]}))
    call = {"id": "call_9", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}
    chat = {"id": "chatcmpl-1", "model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 3},
            "choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [call]},
                         "finish_reason": "tool_calls"}]}
    obj, turn = ro.from_chat_completion(chat, ctx)
    assert obj["status"] == "completed" and obj["tools"] == [{"type": "function", "name": "weather"}]
    [item] = obj["output"]
    assert item["type"] == "function_call" and item["id"].startswith("fc_")
    assert (item["call_id"], item["name"], item["arguments"], item["status"]) == (
        "call_9", "weather", '{"city":"Oslo"}', "completed")
    assert turn.chat_message() == {"role": "assistant", "content": None, "tool_calls": [call]}


def _chunk(**kw: Any) -> str:
    return "data: " + json.dumps({"id": "chatcmpl-1", "model": "m", **kw}) + "\n\n"


def _events(sse: str) -> list[dict[str, Any]]:
    out = []
    for block in sse.split("\n\n"):
        if block:
            name, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert name == "event: " + event["type"]
            out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_stream_of_tool_call_deltas_is_function_call_items():
    ctx = ro.ResponseContext(r.parse_request({"model": "m", "input": "weather?"}))
    finals = []
    chat = [_chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
            _chunk(choices=[{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}}]}}]),
            _chunk(choices=[{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}}]),
            _chunk(choices=[{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":1}'}}]}}]),
            _chunk(choices=[{"index": 0, "delta": {"tool_calls": [
                {"index": 1, "id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]}}]),
            _chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
            _chunk(choices=[], usage={"prompt_tokens": 4, "completion_tokens": 6}), "data: [DONE]\n\n"]
    events = _events("".join(ro.translate_stream(chat, ctx, lambda resp, turn: finals.append((resp, turn)))))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[5]["arguments"] == '{"city":1}' and events[5]["output_index"] == 0
    final = events[-1]["response"]
    assert [(i["call_id"], i["name"], i["arguments"]) for i in final["output"]] == [
        ("call_1", "weather", '{"city":1}'), ("call_2", "time", "{}")]
    assert final["usage"]["total_tokens"] == 10 and finals[0][0] == final
    assert [c["id"] for c in finals[0][1].chat_message()["tool_calls"]] == ["call_1", "call_2"]


def test_a_failure_mid_stream_is_response_failed():
    ctx = ro.ResponseContext(r.parse_request({"model": "m", "input": "x"}))
    chat = [_chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": "hi"}}]),
            'data: {"error": {"message": "boom", "type": "server_error", "param": null, "code": "no_workers"}}\n\n',
            "data: [DONE]\n\n"]
    events = _events("".join(ro.translate_stream(chat, ctx, lambda resp, turn: None)))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "no_workers", "message": "boom"}
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"]["status"] == "incomplete"


# ---- the SDK against the app -------------------------------------------------------------------
ghost = test_api_messages.ghost  # the fixture of one live worker, GHOST, whose tasks a ScriptedWorker takes
@pytest.fixture(scope="module")
def app(redis_url, tmp_path_factory) -> Iterator[Flask]:
    # without the semantic layer: its guards may block a prompt now and then (a name looks like PII), and a
    # scripted worker left waiting would answer the next test's request
    with farm_app(redis_url, tmp_path_factory.mktemp("api-responses"), FARM_API_KEYS=f"{KEY_A},{KEY_B}",
                  FARM_SEMANTIC__ENABLED="false") as app:
        farm = app.extensions["farm"]
        farm.tokenizer(farm.cfg.default_model)  # loaded before the ghost's heartbeat (6 s) starts ticking
        yield app


def sdk(app: Flask, key: str = KEY_A) -> openai.OpenAI:
    # no semantic cache: every request here must reach the scripted worker
    return openai.OpenAI(api_key=key, base_url="http://localhost/v1", max_retries=0,
                         default_headers={"Cache-Control": "no-cache"},
                         http_client=httpx2.Client(transport=httpx2.WSGITransport(app=app)))


def raw(app: Flask, body: Any, key: str = KEY_A) -> httpx.Response:
    with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://localhost") as c:
        return c.post("/v1/responses", content=json.dumps(body), headers={
            "content-type": "application/json", "Authorization": f"Bearer {key}"})


def fresh(text: str) -> str:
    return f"{text} ({uuid.uuid4().hex[:6]})"


def prompt_of(app: Flask, cfg, w: ScriptedWorker) -> str:
    w.join(10)
    return app.extensions["farm"].tokenizer(cfg.default_model).decode(w.request.prompt_token_ids)


def test_text_response(app, ghost, redis_client):
    w = ScriptedWorker(redis_client, [both_start(), *deltas("Hel", "lo"), done("stop")])
    resp = sdk(app).responses.create(model=ghost.default_model, input=fresh("Say hello"), instructions="Be terse.",
                                     max_output_tokens=20, temperature=0, metadata={"k": "v"})
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.status == "completed"
    assert resp.model == ghost.default_model and resp.output_text == "Hello"
    [msg] = resp.output
    assert (msg.type, msg.role, msg.status, msg.id[:4]) == ("message", "assistant", "completed", "msg_")
    assert [(c.type, c.text, c.annotations) for c in msg.content] == [("output_text", "Hello", [])]
    u = resp.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (USAGE["prompt_tokens"], USAGE["completion_tokens"],
                                                                 USAGE["prompt_tokens"] + USAGE["completion_tokens"])
    assert u.input_tokens_details.cached_tokens == USAGE["cached_tokens"] and u.output_tokens_details.reasoning_tokens == 0
    assert (resp.instructions, resp.max_output_tokens, resp.metadata, resp.store, resp.error) == (
        "Be terse.", 20, {"k": "v"}, True, None)
    s = w.request.sampling
    assert (s.max_tokens, s.temperature) == (20, 0.0)
    assert "Be terse." in prompt_of(app, ghost, w)


def test_truncation_auto_keeps_the_end_of_a_conversation_too_long(app, ghost, redis_client):
    """`truncation: auto`, as vLLM serves it: a conversation past the context loses its earliest tokens instead of a
    400, and the response says which truncation it ran under."""
    max_len = ghost.model(ghost.default_model).max_model_len
    long = fresh("".join(f"w{i} " for i in range(max_len)))
    with pytest.raises(openai.BadRequestError):
        sdk(app).responses.create(model=ghost.default_model, input=long, max_output_tokens=8)
    w = ScriptedWorker(redis_client, [both_start(), *deltas("ok"), done("stop")])
    resp = sdk(app).responses.create(model=ghost.default_model, input=long, max_output_tokens=8, truncation="auto")
    assert resp.truncation == "auto" and resp.output_text == "ok"
    assert len(w.request.prompt_token_ids) == max_len - 8


def test_stream_events_in_order_and_the_text_is_the_deltas(app, ghost, redis_client):
    ScriptedWorker(redis_client, [both_start(), *deltas("Hel", "lo wor", "ld"), done("stop")])
    events = list(sdk(app).responses.create(model=ghost.default_model, input=fresh("Count"), stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 3, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_id = events[2].item.id
    text_deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all((e.item_id, e.output_index, e.content_index) == (item_id, 0, 0) for e in text_deltas)
    final = events[-1].response
    assert "".join(e.delta for e in text_deltas) == events[7].text == final.output_text == "Hello world"
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    assert final.usage.output_tokens == USAGE["completion_tokens"]
    # the SDK's own stream helper assembles the same response; it is stored like a plain one
    ScriptedWorker(redis_client, [both_start(), *deltas("a", "b"), done("stop")])
    with sdk(app).responses.stream(model=ghost.default_model, input=fresh("Go")) as stream:
        got = stream.get_final_response()
    assert got.output_text == "ab"
    assert sdk(app).responses.retrieve(got.id).output_text == "ab"


def test_previous_response_continues_the_conversation(app, ghost, redis_client):
    client = sdk(app)
    first_input = fresh("My name is Ada.")
    ScriptedWorker(redis_client, [both_start(), *deltas("Hello ", "Ada!"), done("stop")])
    first = client.responses.create(model=ghost.default_model, input=first_input, instructions="Be warm.")
    w = ScriptedWorker(redis_client, [both_start(), *deltas("Ada."), done("stop")])
    second = client.responses.create(model=ghost.default_model, input="What is my name?",
                                     previous_response_id=first.id, instructions="Be short.")
    prompt = prompt_of(app, ghost, w)
    assert first_input in prompt and "Hello Ada!" in prompt and "What is my name?" in prompt
    assert prompt.index(first_input) < prompt.index("Hello Ada!") < prompt.index("What is my name?")
    assert "Be short." in prompt and "Be warm." not in prompt  # instructions are not carried over
    assert second.previous_response_id == first.id and second.output_text == "Ada."
    # the third turn holds all of it
    w = ScriptedWorker(redis_client, [both_start(), *deltas("ok"), done("stop")])
    client.responses.create(model=ghost.default_model, input=[{"role": "user", "content": "Thanks"}],
                            previous_response_id=second.id)
    third = prompt_of(app, ghost, w)
    assert all(t in third for t in (first_input, "Hello Ada!", "What is my name?", "Ada.", "Thanks"))
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "What is my name?")]
    # retrieve, delete, then 404 everywhere
    assert client.responses.retrieve(first.id).output_text == "Hello Ada!"
    deleted = client.responses.delete(first.id)
    assert deleted is None  # the SDK returns nothing: the body is checked raw below
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                 lambda: client.responses.input_items.list(first.id),
                 lambda: client.responses.create(model=ghost.default_model, input="x", previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] in ("response_not_found", "previous_response_not_found")
    with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://localhost") as c:
        gone = c.delete(f"/v1/responses/{second.id}", headers={"Authorization": f"Bearer {KEY_A}"})
    assert gone.status_code == 200 and gone.json() == {"id": second.id, "object": "response", "deleted": True}


def test_input_items_pages_and_order(app, ghost, redis_client):
    ScriptedWorker(redis_client, [both_start(), *deltas("ok"), done("stop")])
    texts = [fresh(f"item {i}") for i in range(3)]
    resp = sdk(app).responses.create(model=ghost.default_model,
                                     input=[{"role": "user", "content": t} for t in texts])
    client = sdk(app)
    newest = client.responses.input_items.list(resp.id, limit=2)
    assert [i.content[0].text for i in newest.data] == texts[::-1][:2] and newest.has_more
    rest = client.responses.input_items.list(resp.id, limit=2, after=newest.data[-1].id)
    assert [i.content[0].text for i in rest.data] == texts[:1] and not rest.has_more
    oldest = client.responses.input_items.list(resp.id, order="asc")
    assert [i.content[0].text for i in oldest.data] == texts


def test_another_key_sees_nothing(app, ghost, redis_client):
    ScriptedWorker(redis_client, [both_start(), *deltas("secret"), done("stop")])
    mine = sdk(app, KEY_A).responses.create(model=ghost.default_model, input=fresh("Keep this"))
    other = sdk(app, KEY_B)
    for call in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.delete(mine.id),
                 lambda: other.responses.input_items.list(mine.id),
                 lambda: other.responses.create(model=ghost.default_model, input="x", previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert sdk(app, KEY_A).responses.retrieve(mine.id).output_text == "secret"  # B's delete took nothing


def test_store_false_keeps_nothing(app, ghost, redis_client):
    ScriptedWorker(redis_client, [both_start(), *deltas("x"), done("stop")])
    resp = sdk(app).responses.create(model=ghost.default_model, input=fresh("Hi"), store=False)
    assert resp.store is False
    with pytest.raises(openai.NotFoundError):
        sdk(app).responses.retrieve(resp.id)


def test_a_keys_stored_responses_stop_at_its_quota(app, ghost, redis_client, monkeypatch):
    """A record holds what its request was not charged for (ids, an earlier answer's annotations, tools' words):
    a key's stored responses are counted, and past api.responses_owner_max (or _max_mb) a request that would store
    one is a 400 naming the way out, while store: false still answers; deleting one gives its room back; an earlier
    answer's annotations are not stored at all."""
    cfg, owner_b = app.extensions["farm"].cfg, owner_of(digest(KEY_B))
    for key in redis_client.scan_iter(f"{owner_responses_key(owner_b)}*"):  # earlier tests' records of KEY_B
        redis_client.delete(key)
    kept = []
    for _ in range(2):
        ScriptedWorker(redis_client, [both_start(), *deltas("x"), done("stop")])
        kept.append(sdk(app, KEY_B).responses.create(model=ghost.default_model, input=[
            {"role": "assistant", "content": [{"type": "output_text", "text": "earlier", "annotations": ["A" * 5000]}]},
            {"role": "user", "content": fresh("Hi")}]).id)
    record = redis_client.get(f"farm:resp:{owner_b}:{kept[0]}")
    assert b"AAAA" not in record and b"earlier" in record
    monkeypatch.setattr(cfg.api, "responses_owner_max", 2)
    err = assert_openai_error(raw(app, {"model": ghost.default_model, "input": "x"}, KEY_B), 400, "store")
    assert err["code"] == "stored_responses_quota_exceeded" and "store: false" in err["message"]
    ScriptedWorker(redis_client, [both_start(), *deltas("x"), done("stop")])
    assert sdk(app, KEY_B).responses.create(model=ghost.default_model, input=fresh("Hi"), store=False).store is False
    ScriptedWorker(redis_client, [both_start(), *deltas("x"), done("stop")])  # another key has its own quota
    assert sdk(app).responses.create(model=ghost.default_model, input=fresh("Hi")).id
    sdk(app, KEY_B).responses.delete(kept[0])
    ScriptedWorker(redis_client, [both_start(), *deltas("x"), done("stop")])
    assert sdk(app, KEY_B).responses.create(model=ghost.default_model, input=fresh("Hi")).id
    monkeypatch.setattr(cfg.api, "responses_owner_max", 10_000)  # and by bytes: 1 MB, with 2 MB counted
    monkeypatch.setattr(cfg.api, "responses_owner_max_mb", 1)
    redis_client.incrby(f"{owner_responses_key(owner_b)}:bytes", 2 << 20)
    err = assert_openai_error(raw(app, {"model": ghost.default_model, "input": "x"}, KEY_B), 400, "store")
    assert "MB" in err["message"]


def test_max_output_tokens_makes_it_incomplete(app, ghost, redis_client):
    w = ScriptedWorker(redis_client, [both_start(), *deltas("a", "b"), done("length")])
    resp = sdk(app).responses.create(model=ghost.default_model, input=fresh("Go on"), max_output_tokens=2)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.output_text == "ab"
    assert w.request.sampling.max_tokens == 2
    ScriptedWorker(redis_client, [both_start(), *deltas("a"), done("length")])
    events = list(sdk(app).responses.create(model=ghost.default_model, input=fresh("Go on"), max_output_tokens=1,
                                            stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def test_bad_requests_are_openai_errors(app, ghost):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(app).responses.create(model=ghost.default_model, input="x", extra_body={"frequency_penalty": 1})
    assert e.value.body["code"] == "unknown_parameter" and e.value.body["param"] == "frequency_penalty"
    ok = {"model": ghost.default_model, "input": "x"}
    err = assert_openai_error(raw(app, {**ok, "input": [{"type": "input_image", "image_url": "http://x/a.png"}]}),
                              400, "input[0].type")
    assert "not supported" in err["message"]
    assert_openai_error(raw(app, {**ok, "background": True}), 400, "background")
    assert_openai_error(raw(app, {**ok, "input": [{"role": "user"}]}), 400, "input[0].content")
    assert_openai_error(raw(app, ["not", "an", "object"]), 400)
    assert_openai_error(raw(app, {**ok, "model": "no-such-model"}), 404, "model")
    assert_openai_error(raw(app, {"model": ghost.default_model}), 400, "input")
    too_long = {**ok, "max_output_tokens": ghost.model(ghost.default_model).max_model_len + 1}
    assert "context length" in assert_openai_error(raw(app, too_long), 400, "max_output_tokens")["message"]
    for choice in ("required", {"type": "function", "name": "zz"}):  # without tools: refused, never ignored
        assert "tools" in assert_openai_error(raw(app, {**ok, "tool_choice": choice}), 400, "tool_choice")["message"]
    with pytest.raises(openai.AuthenticationError):
        sdk(app, key="sk-wrong-key").responses.create(model=ghost.default_model, input="x")


WEATHER = {"type": "function", "name": "weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_function_tools_through_the_chat_paths_tool_calling(app, ghost, redis_client):
    """`tool_choice: required` (forced by structured output on the chat path, so no model parser is needed): the
    call comes back as a function_call item, its result goes in as function_call_output, streamed or not."""
    answer = '[{"name": "weather", "parameters": {"city": "Oslo"}}]'
    w = ScriptedWorker(redis_client, [both_start(), *deltas(answer[:20], answer[20:]), done("stop")])
    client = sdk(app)
    first = client.responses.create(model=ghost.default_model, input=fresh("Weather in Oslo?"), tools=[WEATHER],
                                    tool_choice="required")
    assert w.request.sampling.response_format is not None  # the chat path forced the call
    [call] = first.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call", "weather", {"city": "Oslo"}, "completed")
    assert first.tools[0].name == "weather" and first.tool_choice == "required"
    w = ScriptedWorker(redis_client, [both_start(), *deltas("Sunny in Oslo."), done("stop")])
    second = client.responses.create(model=ghost.default_model, previous_response_id=first.id, tools=[WEATHER],
                                     tool_choice="none", input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny, 21 C"}])
    assert second.output_text == "Sunny in Oslo." and "sunny, 21 C" in prompt_of(app, ghost, w)
    ScriptedWorker(redis_client, [both_start(), *deltas(answer[:20], answer[20:]), done("stop")])
    events = list(client.responses.create(model=ghost.default_model, input=fresh("Weather?"), tools=[WEATHER],
                                          tool_choice="required", stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in args] == [{"city": "Oslo"}]
    assert events[-1].response.output[0].name == "weather"


def test_expired_responses_leave_the_quota(redis_client):
    """A stored response that expired (its key gone by its TTL) no longer counts: its id, size and bytes are taken
    out of the owner's count the next time it is read; a deleted one at once."""
    from farm.openai.response_store import ResponseStore

    owner = f"owner-ttl-{uuid.uuid4().hex[:6]}"
    store = ResponseStore(redis_client, ttl_s=1, max_bytes=1 << 20, max_records=2)
    for rid in ("resp_a", "resp_b"):
        store.save(owner, {"id": rid}, [], [{"role": "user", "content": "x" * 100}])
    used, count = store.usage(owner)
    assert count == 2 and used > 200 and store.full(owner) is not None
    assert store.delete(owner, "resp_a") and store.usage(owner)[1] == 1 and store.full(owner) is None
    import time

    time.sleep(1.2)  # resp_b's TTL
    assert store.usage(owner) == (0, 0) and store.get(owner, "resp_b") is None
