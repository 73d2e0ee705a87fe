"""Tool calling and structured output, below HTTP: the request's checks, the prompt a template without tools gets,
the parsers, and the built-in engine's grammar-constrained decoding on a random model (whose
unconstrained output is never JSON, so a valid answer is the grammar's doing)."""

from __future__ import annotations

import json

import pytest

from farm.config import EngineConfig
from farm.engine.engine import Engine
from farm.openai.api_error import APIError
from farm.openai.parsing import parse_chat
from farm.openai.responses import Choice, full_response
from farm.openai.tool_parsers import HermesParser, Llama3JsonParser
from farm.protocol import SamplingParams
from tests.test_engine import run

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
]


@pytest.fixture(scope="module")
def tok(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


def parse(tok, parser: str | None = "hermes", **body):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, tok, 4096,
                      tool_parser=parser)


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}},
     "response_format"),
])
def test_bad_tools_are_400s_naming_the_parameter(tok, body, param):
    with pytest.raises(APIError) as e:
        parse(tok, **body)
    assert e.value.status == 400 and e.value.param == param


def test_auto_needs_the_models_parser_and_required_does_not(tok):
    with pytest.raises(APIError) as e:
        parse(tok, None, tools=[WEATHER])  # auto is the default with tools
    assert "tool_call_parser" in e.value.message and e.value.param == "tool_choice"
    forced = parse(tok, None, tools=[WEATHER], tool_choice="required")
    schema = forced.sampling.response_format["json_schema"]["schema"]
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    named = parse(tok, None, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.sampling.response_format["json_schema"]["schema"] == WEATHER["function"]["parameters"]
    assert parse(tok, None, tools=[WEATHER], tool_choice="none").tools is None  # plain text: nothing to read


def test_a_template_without_tools_gets_them_in_the_parsers_format(tok):
    parsed = parse_chat({"model": "m", "messages": HISTORY, "tools": [WEATHER]}, tok, 4096, tool_parser="hermes")
    text = tok.decode(parsed.prompt_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>\n18C and sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_that_reads_tools_gets_them_itself(tok):
    import copy

    own = copy.copy(tok)
    own.chat_template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
                         "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
                         "{{ c.function.arguments.city }}\n{% endfor %}{% else %}{{ m.role }}: {{ m.content }}\n"
                         "{% endif %}{% endfor %}")
    parsed = parse_chat({"model": "m", "messages": HISTORY, "tools": [WEATHER]}, own, 4096, tool_parser="hermes")
    text = own.decode(parsed.prompt_ids)
    assert text.startswith("TOOL get_weather\n") and "CALL get_weather Paris\n" in text  # arguments as an object
    assert "<tools>" not in text and "tool: 18C and sunny" in text


@pytest.mark.parametrize("bad", [
    {"role": "tool", "content": "x"},  # no tool_call_id
    {"role": "user", "content": "x", "tool_calls": []},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]},
])
def test_bad_history_messages_are_400s(tok, bad):
    with pytest.raises(APIError) as e:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}, bad]}, tok, 4096)
    assert e.value.status == 400 and e.value.param.startswith("messages[1]")


def test_hermes_and_llama3_parsers():
    content, calls = HermesParser().extract('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                            '{"city": "Oslo"}}\n</tool_call>\n<tool_call>{"name": "get_time", '
                                            '"arguments": {}}</tool_call>')
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert HermesParser().extract("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    content, calls = Llama3JsonParser().extract('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'
                                                '; {"name": "get_time", "parameters": {}}')
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert Llama3JsonParser().extract("Rome is sunny.") == ("Rome is sunny.", [])


def test_choices_carry_calls_and_the_finish_reason(tok):
    auto = parse(tok, tools=[WEATHER]).tools
    choice = Choice.of('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', "stop",
                       tools=auto)
    msg = full_response("chat", "id", "m", [choice], {})["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] is None
    assert msg["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    plain = full_response("chat", "id", "m", [Choice.of("It is sunny.", "stop", tools=auto)], {})["choices"][0]
    assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]
    single = parse(tok, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert single.sampling.response_format["json_schema"]["schema"]["maxItems"] == 1
    two = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert [c.name for c in Choice.of(two, "stop", tools=parse(tok, tools=[WEATHER, TIME], tool_choice="required")
                                      .tools).tool_calls] == ["get_time", "get_weather"]
    cut = Choice.of(two[:-30], "length", tools=parse(tok, tools=[WEATHER, TIME], tool_choice="required").tools)
    assert [c.name for c in cut.tool_calls] == ["get_time"]  # max_tokens cut the second call: the first stands
    none = Choice.of(two[:20], "length", tools=parse(tok, tools=[WEATHER, TIME], tool_choice="required").tools)
    msg = full_response("chat", "id", "m", [none], {})["choices"][0]  # cut inside the first: no call, and no text
    assert msg["finish_reason"] == "length" and not msg["message"].get("tool_calls")
    assert msg["message"]["content"] == ""  # as vLLM; the raw JSON as content read as the model's final answer


# --- the built-in engine's structured output -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = Engine(tiny_model_dir, EngineConfig(block_size=4), max_model_len=512).start()
    yield eng
    eng.stop()


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
                                           "unit": {"enum": ["C", "F"]}}, "required": ["city", "days", "unit"],
          "additionalProperties": False}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_builtin_engine_follows_a_json_schema(engine, seed):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    c = run(engine, list(range(100, 140)), SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                                                          response_format=fmt))
    assert c.last.finish_reason == "stop", c.text
    jsonschema.validate(json.loads(c.text), SCHEMA)
    free = run(engine, list(range(100, 140)), SamplingParams(max_tokens=40, temperature=1.0, seed=seed))
    with pytest.raises(ValueError):  # the same random model, unconstrained
        json.loads(free.text)


def test_the_builtin_engine_makes_any_json_object_and_forced_calls(engine, tok):
    c = run(engine, list(range(200, 230)), SamplingParams(max_tokens=100, temperature=0.8, seed=5,
                                                          response_format={"type": "json_object"}))
    assert c.last.finish_reason in ("stop", "length")
    if c.last.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)
    bounded = {"type": "function", "function": {"name": "get_weather", "parameters": {  # a random model's strings
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"], "additionalProperties": False}}}  # never end
    forced = parse(tok, None, tools=[bounded, TIME], tool_choice="required")
    c = run(engine, list(range(300, 330)), SamplingParams(max_tokens=150, temperature=0.7, seed=9,
                                                          response_format=forced.sampling.response_format))
    assert c.last.finish_reason == "stop", c.text
    calls = Choice.of(c.text, "stop", tools=forced.tools).tool_calls
    assert calls and all(x.name in ("get_weather", "get_time") for x in calls)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_builtin_engine_follows_vllms_regex_choice_and_grammar(engine, seed):
    """vLLM's `structured_outputs` kinds that are no JSON schema: a random model's free answer matches none of
    them, the constrained one matches each whole."""
    import re

    prompt = list(range(100, 140))
    cases = [({"type": "regex", "regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
             ({"type": "choice", "choice": ["alpha", "beta gamma"]}, lambda t: t in ("alpha", "beta gamma")),
             ({"type": "grammar", "grammar": 'root ::= ("yes" | "no") " " [0-9]'},  # GBNF, as vLLM takes it
              lambda t: re.fullmatch("(yes|no) [0-9]", t)),
             ({"type": "grammar", "grammar": 'start: ("ab" | "cd")+ "!"'}, lambda t: re.fullmatch("(ab|cd)+!", t))]
    for fmt, ok in cases:
        c = run(engine, prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=seed, response_format=fmt))
        assert c.last.finish_reason == "stop" and ok(c.text), (fmt, c.text)
        free = run(engine, prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=seed))
        assert not ok(free.text), free.text


def test_a_schema_the_engine_refuses_ends_the_request_not_the_engine(engine):
    bad = {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}
    c = run(engine, [1, 2, 3], SamplingParams(max_tokens=5, response_format=bad))
    assert c.last.finish_reason.startswith("error:invalid request")
    assert run(engine, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)).last.completion_tokens == 3


def test_a_grammar_that_fails_while_generating_ends_with_an_error_not_a_whole_answer(engine):
    """A schema the grammar compiler accepts can still trip one of the parser's limits at the first steps (3,000
    properties: a row of 12,007 items, the most being 2,000). The matcher then stops, and the request ended as
    `stop`: a cut, invalid JSON given as a whole answer. It ends with the matcher's error now."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    fmt = {"type": "json_schema", "json_schema": {"schema": wide}}
    failed = []
    for seed in range(1, 13):  # the first token is `{`, `{}` or `{"`; after `{"` the parser meets the wide row
        c = run(engine, [1, 2, 3], SamplingParams(max_tokens=20, temperature=1.0, seed=seed, response_format=fmt))
        if c.last.finish_reason == "stop":
            assert json.loads(c.text) == {}, c.text  # a whole answer is a valid one
        else:
            assert c.last.finish_reason.startswith("error:structured output failed"), (c.last.finish_reason, c.text)
            failed.append(c.last.finish_reason)
    assert failed and "2000" in failed[0]
    assert run(engine, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)).last.completion_tokens == 3


def test_a_migrated_structured_request_resumes_its_grammar(engine):
    """A request moved to another worker after some tokens (`generated`): the grammar continues after them, so the
    whole answer (what came before the move and after) is one valid object; tokens that break the format end it
    with a clear error."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    prompt = list(range(100, 140))
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=4, response_format=fmt)
    whole = run(engine, prompt, params)
    cut = whole.token_ids[:5]
    rest = run(engine, prompt + cut, SamplingParams(max_tokens=115, temperature=1.0, seed=11, response_format=fmt),
               generated=len(cut))
    assert rest.last.finish_reason == "stop", rest.text
    jsonschema.validate(json.loads(engine.tokenizer.decode(cut) + rest.text), SCHEMA)
    bad = run(engine, prompt + engine.tokenizer.encode("hello"), params, generated=1)
    assert bad.last.finish_reason.startswith("error:invalid request")
