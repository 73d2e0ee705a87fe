"""What a `vllm serve` user expects of the chat route (issue 28), without a model running: vLLM's chat-template
fields (`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`, `echo`) and text options
(`skip_special_tokens`, `include_stop_str_in_output`) checked as vLLM checks them and carried to the prompt and
to the workers' request message; the client's `X-Request-Id`; the built-in engine honouring the text options on
a tiny model; the per-request token series vLLM's dashboard reads, counted once per request.

The API runs its production path against a scripted worker (tests/test_api_stream.py); the real model's end to
end checks of the same are in tests/test_e2e_openai.py.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask

from farm.config import EngineConfig
from farm.engine.engine import Engine
from farm.engine.scheduler import KVImport
from farm.engine.timings import RequestTokens, token_buckets
from farm.models.tokenization import IncrementalDetokenizer, _load
from farm.openai.api_error import APIError
from farm.openai.parsing import chat_options, parse_chat
from farm.protocol import GenerationRequest, InvalidTask, SamplingParams
from tests import test_api_stream
from tests.test_api_errors import assert_error, chat, farm_app, post
from tests.test_api_stream import ScriptedWorker, both_start, deltas, done, sse
from tests.test_engine import Collector, run

NO_CACHE = {"Cache-Control": "no-cache"}  # answered by the (scripted) worker, never by the semantic cache
QUESTION = {"role": "user", "content": "What is the capital of France?"}
PREFILL = {"role": "assistant", "content": "The capital of France is"}
HINT_TEMPLATE = (  # SmolLM2's template, plus a variable a request can set through chat_template_kwargs
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if hint is defined %}({{ hint }}) {% endif %}{% endif %}")


@pytest.fixture(scope="module")
def app(redis_url, tmp_path_factory) -> Iterator[Flask]:
    with farm_app(redis_url, tmp_path_factory.mktemp("api-extensions")) as app:
        yield app


client = test_api_stream.client  # a test client, the config, and one live worker (GHOST) for a ScriptedWorker


@pytest.fixture(scope="module")
def tok(real_model_dir: Path):
    return _load(str(real_model_dir))


@pytest.fixture(scope="module")
def hint_tok(tmp_path_factory, real_model_dir: Path):
    """The default model's tokenizer with HINT_TEMPLATE as its chat template."""
    out = tmp_path_factory.mktemp("hint-tokenizer")
    for f in real_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = HINT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return _load(str(out))


@pytest.fixture(scope="module")
def bos_tok(tmp_path_factory, real_model_dir: Path):
    """The default model's tokenizer made to add a BOS (`<|endoftext|>`), as Llama's and Mistral's do: the default
    model's own adds no special token, so `add_special_tokens` would change nothing there."""
    out = tmp_path_factory.mktemp("bos-tokenizer")
    for f in real_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["bos_token"] = "<|endoftext|>"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    spec = json.loads((out / "tokenizer.json").read_text())  # the post-processor is what adds special tokens
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                       {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                   "tokens": ["<|endoftext|>"]}}}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    tok = _load(str(out))
    assert tok("hi")["input_ids"] == [tok.bos_token_id, *tok("hi", add_special_tokens=False)["input_ids"]]
    return tok


def body(**kw):
    return {"model": "m", "messages": [QUESTION], **kw}


# -- parsing: vLLM's checks, 400s naming the field ------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("chat_template_kwargs", "x"), ("chat_template_kwargs", ["enable_thinking"]), ("add_generation_prompt", "no"),
    ("add_generation_prompt", 0), ("continue_final_message", 1), ("echo", "yes"), ("skip_special_tokens", "false"),
    ("skip_special_tokens", 0), ("include_stop_str_in_output", 1),
])
def test_extension_fields_of_the_wrong_type_are_400s(app_client_no_worker, field, value):
    c, cfg = app_client_no_worker
    assert_error(post(c, "/v1/chat/completions", chat(cfg, **{field: value})), 400, field)


@pytest.fixture
def app_client_no_worker(app, redis_client):
    return app.test_client(), app.extensions["farm"].cfg


def test_continue_final_message_needs_add_generation_prompt_false(app_client_no_worker):
    """As vLLM: both true is a 400, and add_generation_prompt is true unless the request sets it false."""
    c, cfg = app_client_no_worker
    msgs = [QUESTION, PREFILL]
    for extra in ({}, {"add_generation_prompt": True}):
        err = assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=msgs, continue_final_message=True,
                                                                **extra)), 400, "continue_final_message")
        assert "add_generation_prompt" in err["message"]
    # valid: with no worker the answer is 503, not 400
    assert_error(post(c, "/v1/chat/completions", chat(cfg, messages=msgs, continue_final_message=True,
                                                      add_generation_prompt=False, echo=True)), 503,
                 code="no_workers")


@pytest.mark.parametrize("key", ["tokenize", "chat_template", "return_tensors", "padding", "max_length", "tools",
                                 "messages", "add_generation_prompt", "continue_final_message", "eos_token"])
def test_chat_template_kwargs_hold_only_template_variables(app_client_no_worker, key):
    """The template's own parameters are refused (vLLM refuses chat_template and tokenize); padding to a
    max_length, say, would make the prompt anything, and a long eos_token would be repeated after every message.
    The two that are request fields point at them."""
    c, cfg = app_client_no_worker
    err = assert_error(post(c, "/v1/chat/completions", chat(cfg, chat_template_kwargs={key: 1})), 400,
                       "chat_template_kwargs", "invalid_value")
    assert key in err["message"]


def test_chat_template_kwargs_are_bounded(app_client_no_worker, hint_tok):
    """Switches and short texts: a 16 KiB cap as JSON, and a template that renders a variable into a prompt longer
    than the model's context is refused before that prompt is tokenized."""
    c, cfg = app_client_no_worker
    assert_error(post(c, "/v1/chat/completions", chat(cfg, chat_template_kwargs={"hint": "x" * 17000})), 400,
                 "chat_template_kwargs", "invalid_value")
    with pytest.raises(APIError) as e:
        parse_chat(body(chat_template_kwargs={"hint": "word " * 3000}), hint_tok, 2048, chars_per_token=1)
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "messages")


def test_truly_unknown_fields_are_still_refused(app_client_no_worker):
    c, cfg = app_client_no_worker
    for field in ("spaces_between_special_tokens", "chat_template_kwarg", "echo_prompt"):
        assert_error(post(c, "/v1/chat/completions", chat(cfg, **{field: True})), 400, field, "unknown_parameter")


def test_openai_fields_that_change_nothing_a_client_relies_on_are_accepted(app_client_no_worker):
    """`store`, `metadata`, `service_tier`, `prompt_cache_key`, `safety_identifier`, `reasoning_effort`,
    `verbosity`, `modalities: ["text"]` and `prediction` were 400 `unknown_parameter`; LiteLLM and LangChain send
    several on their own, and vLLM accepts them. They pass validation now (503 here: no worker), a value OpenAI
    would refuse is still a 400 naming it, and what would change the answer (audio, web search) stays refused."""
    c, cfg = app_client_no_worker
    accepted = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto", "prompt_cache_key": "user-1",
                "safety_identifier": "hash-1", "reasoning_effort": "low", "verbosity": "low",
                "modalities": ["text"], "prediction": {"type": "content", "content": "x"}}
    for field, value in accepted.items():
        resp = post(c, "/v1/chat/completions", chat(cfg, **{field: value}))
        assert resp.status_code == 503, (field, resp.get_json())
    assert post(c, "/v1/chat/completions", chat(cfg, **accepted)).status_code == 503
    for field, value in (("modalities", ["text", "audio"]), ("service_tier", "fastest"), ("store", "yes"),
                         ("metadata", {f"k{i}": "v" for i in range(17)}), ("reasoning_effort", "max")):
        assert_error(post(c, "/v1/chat/completions", chat(cfg, **{field: value})), 400, field if field != "modalities"
                     else "modalities[1]", "invalid_value")
    for field in ("audio", "web_search_options"):
        assert_error(post(c, "/v1/chat/completions", chat(cfg, **{field: {}})), 400, field, "unknown_parameter")


def test_what_a_worker_would_refuse_as_an_invalid_task_is_settled_in_the_api(app_client_no_worker, hint_tok):
    """The fuzz audit's 500s, where the worker's task check was stricter than the API's: a `top_k` past the
    vocabulary (vLLM samples among all tokens then: it is clamped), a response format past the 64 KiB a task
    carries (a 400 naming it, for a client's schema and for the one forced tools make), and an earlier tool
    call whose `arguments` nest thousands deep (json.loads raised RecursionError: kept as sent instead)."""
    c, cfg = app_client_no_worker
    assert parse_chat(body(top_k=10**6), hint_tok, 2048).sampling.top_k == len(hint_tok)
    assert parse_chat(body(top_k=7), hint_tok, 2048).sampling.top_k == 7
    big = {"type": "object", "description": "d" * 70_000}
    err = assert_error(post(c, "/v1/chat/completions", chat(cfg, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": big}})), 400, "response_format", "invalid_value")
    assert "65536" in err["message"]
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "description": "d" * 20_000}}} for i in range(4)]
    with pytest.raises(APIError) as e:  # a context long enough for the tools' prompt: their forced format is past
        parse_chat(body(tools=tools, tool_choice="required"), hint_tok, 1 << 20)
    assert (e.value.status, e.value.param, e.value.code) == (400, "tools", "invalid_value")
    deep = "[" * 2000 + "]" * 2000
    history = [{"role": "user", "content": "go"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    resp = post(c, "/v1/chat/completions", {"model": cfg.default_model, "messages": history})
    assert resp.status_code == 503 and resp.get_json()["error"]["code"] == "no_workers"  # valid: on to the workers


def test_chat_options_defaults_and_values():
    assert chat_options(body()).default
    o = chat_options(body(chat_template_kwargs={"enable_thinking": False}, add_generation_prompt=False,
                          continue_final_message=True, echo=True))
    assert (o.template_kwargs, o.add_generation_prompt, o.continue_final_message, o.echo) == (
        {"enable_thinking": False}, False, True, True)
    assert not o.default
    with pytest.raises(APIError):
        chat_options(body(continue_final_message=True))


# -- the prompt: what the template makes of the fields ----------------------------------------------------------
def test_generation_prompt_and_continued_final_message(tok):
    """continue_final_message leaves the assistant's text open (no end of turn, no new header); without a
    generation prompt the last message is closed and nothing follows; the default opens an assistant turn."""
    msgs = [QUESTION, PREFILL]
    plain = parse_chat(body(messages=msgs), tok, 2048)
    closed = parse_chat(body(messages=msgs, add_generation_prompt=False), tok, 2048)
    cont = parse_chat(body(messages=msgs, add_generation_prompt=False, continue_final_message=True), tok, 2048)
    text = {k: tok.decode(p.prompt_ids) for k, p in (("plain", plain), ("closed", closed), ("cont", cont))}
    assert text["plain"].endswith("The capital of France is<|im_end|>\n<|im_start|>assistant\n")
    assert text["closed"].endswith("The capital of France is<|im_end|>\n")
    assert text["cont"].endswith("<|im_start|>assistant\nThe capital of France is")
    assert len(cont.prompt_ids) < len(closed.prompt_ids) < len(plain.prompt_ids)
    assert plain.prompt_ids[:len(cont.prompt_ids)] == cont.prompt_ids
    # the response's role: assistant, or the last message's without a generation prompt (vLLM)
    assert (plain.role, closed.role, cont.role) == ("assistant", "assistant", "assistant")
    assert parse_chat(body(add_generation_prompt=False), tok, 2048).role == "user"


def test_echo_is_the_last_message_when_it_has_the_responses_role(tok):
    msgs = [QUESTION, PREFILL]
    cont = parse_chat(body(messages=msgs, add_generation_prompt=False, continue_final_message=True, echo=True),
                      tok, 2048)
    assert cont.prompts[0].echo == "The capital of France is"
    assert parse_chat(body(echo=True), tok, 2048).prompts[0].echo == ""  # a user message, an assistant answer: nothing
    assert parse_chat(body(echo=True, add_generation_prompt=False), tok, 2048).prompts[0].echo == QUESTION["content"]
    assert parse_chat(body(messages=msgs, continue_final_message=False, add_generation_prompt=False), tok,
                      2048).prompts[0].echo == ""  # echo not asked


def test_chat_template_kwargs_reach_the_template_and_win_over_the_layers(hint_tok):
    base = parse_chat(body(), hint_tok, 2048)
    hinted = parse_chat(body(chat_template_kwargs={"hint": "answer in French"}), hint_tok, 2048)
    assert hint_tok.decode(hinted.prompt_ids).endswith("<|im_start|>assistant\n(answer in French) ")
    assert len(hinted.prompt_ids) > len(base.prompt_ids)
    # the semantic layer's variables (its reasoning mode) come first; the client's own win
    layered = parse_chat(body(chat_template_kwargs={"hint": "mine"}), hint_tok, 2048, template_kwargs={"hint": "x"})
    assert hint_tok.decode(layered.prompt_ids).endswith("(mine) ")


def test_add_special_tokens_as_vllm_reads_it(bos_tok):
    """vLLM's `add_special_tokens`: off by default on chat (the template writes its own), on by default on a
    completion's text prompt; token-id prompts are taken as sent; /tokenize gives the same ids for the same field."""
    from farm.openai.parsing import parse_completion
    from farm.openai.utility import parse_tokenize, tokenize

    bos = bos_tok.bos_token_id
    plain = parse_chat(body(), bos_tok, 2048).prompt_ids
    special = parse_chat(body(add_special_tokens=True), bos_tok, 2048)
    assert plain[0] != bos and special.prompt_ids == [bos, *plain]
    assert parse_chat(body(add_special_tokens=False), bos_tok, 2048).prompt_ids == plain
    for field in (True, False):
        tokenized = tokenize(parse_tokenize({"messages": [QUESTION], "add_special_tokens": field}), bos_tok, 2048)
        assert tokenized["tokens"] == parse_chat(body(add_special_tokens=field), bos_tok, 2048).prompt_ids

    text = {"model": "m", "prompt": "The capital of France is"}
    with_bos = parse_completion(text, bos_tok, 2048).prompt_ids
    without = parse_completion({**text, "add_special_tokens": False}, bos_tok, 2048).prompt_ids
    assert with_bos == [bos, *without] and bos not in without
    ids = {"model": "m", "prompt": without}
    assert parse_completion(ids, bos_tok, 2048).prompt_ids == without  # ids as sent, whatever the field
    assert parse_completion({**ids, "add_special_tokens": True}, bos_tok, 2048).prompt_ids == without
    echoed = parse_completion({**text, "echo": True}, bos_tok, 2048)
    assert echoed.prompts[0].echo == text["prompt"]  # the prompt as sent, as vLLM echoes it
    for kind in (body(add_special_tokens="yes"), {**text, "add_special_tokens": 1}):
        with pytest.raises(APIError) as e:
            (parse_chat if "messages" in kind else parse_completion)(kind, bos_tok, 2048)
        assert e.value.param == "add_special_tokens"


def test_text_options_reach_sampling(tok):
    p = parse_chat(body(), tok, 2048).sampling
    assert (p.skip_special_tokens, p.include_stop_str_in_output) == (True, False)  # vLLM's defaults
    p = parse_chat(body(skip_special_tokens=False, include_stop_str_in_output=True), tok, 2048).sampling
    assert (p.skip_special_tokens, p.include_stop_str_in_output) == (False, True)


# -- the request message: typed on both sides of the wire ------------------------------------------------------
def test_request_message_carries_the_text_options_and_old_messages_still_parse():
    req = GenerationRequest("chatcmpl-a", "m", [1, 2], SamplingParams(skip_special_tokens=False,
                                                                      include_stop_str_in_output=True))
    back = GenerationRequest.from_dict(json.loads(json.dumps(req.to_dict())))
    assert (back.sampling.skip_special_tokens, back.sampling.include_stop_str_in_output) == (False, True)
    old = req.to_dict()
    del old["sampling"]["skip_special_tokens"], old["sampling"]["include_stop_str_in_output"]
    back = GenerationRequest.from_dict(old)  # a message from an API of before: vLLM's defaults
    assert (back.sampling.skip_special_tokens, back.sampling.include_stop_str_in_output) == (True, False)
    for field, bad in (("skip_special_tokens", "false"), ("include_stop_str_in_output", 1)):
        msg = req.to_dict()
        msg["sampling"][field] = bad
        with pytest.raises(InvalidTask, match=field):
            GenerationRequest.from_dict(msg)


# -- through the API to the worker's message and back ------------------------------------------------------------
def test_fields_reach_the_worker_and_shape_the_answer(client, redis_client):
    """continue_final_message with echo: the worker gets the open prompt and the text options; the answer starts
    with the continued message, in the body and in the stream (a chunk of its own after the role)."""
    c, cfg = client
    msgs = [QUESTION, PREFILL]
    ext = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True, "echo": True,
           "skip_special_tokens": False, "include_stop_str_in_output": True, "stop": ["."]}
    w = ScriptedWorker(redis_client, [both_start(), *deltas(" Paris", "."), done()])
    resp = post(c, "/v1/chat/completions", chat(cfg, **ext))
    assert resp.status_code == 200, resp.data
    assert resp.get_json()["choices"][0]["message"] == {"role": "assistant",
                                                        "content": "The capital of France is Paris."}
    tok = c.application.extensions["farm"].tokenizer(cfg.default_model)
    assert tok.decode(w.request.prompt_token_ids).endswith("<|im_start|>assistant\nThe capital of France is")
    s = w.request.sampling
    assert (s.skip_special_tokens, s.include_stop_str_in_output, s.stop) == (False, True, ["."])
    ScriptedWorker(redis_client, [both_start(), *deltas(" Paris", "."), done()])
    chunks = sse(post(c, "/v1/chat/completions", chat(cfg, stream=True, **ext)))[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [ch["choices"][0]["delta"].get("content") for ch in chunks[1:4]] == [
        "The capital of France is", " Paris", "."]
    # without a generation prompt the answer has the last message's role (vLLM), and echo repeats it
    ScriptedWorker(redis_client, [both_start(), *deltas("!"), done()])
    resp = post(c, "/v1/chat/completions", chat(cfg, messages=[QUESTION], add_generation_prompt=False, echo=True))
    assert resp.get_json()["choices"][0]["message"] == {"role": "user", "content": QUESTION["content"] + "!"}


def test_chat_template_kwargs_reach_the_workers_prompt(client, redis_client, monkeypatch):
    c, cfg = client
    tok = c.application.extensions["farm"].tokenizer(cfg.default_model)
    monkeypatch.setattr(tok, "chat_template", HINT_TEMPLATE)
    w = ScriptedWorker(redis_client, [both_start(), *deltas("Oui"), done()])
    resp = post(c, "/v1/chat/completions", chat(cfg, chat_template_kwargs={"hint": "answer in French"}))
    assert resp.status_code == 200, resp.data
    assert tok.decode(w.request.prompt_token_ids).endswith("<|im_start|>assistant\n(answer in French) ")


def test_client_request_id_is_echoed_and_the_farms_own_stays_unique(client, redis_client):
    """vLLM's answer to X-Request-Id: the header echoed and `chatcmpl-<id>` as the response's id. Inside the farm
    (task messages, Redis keys, logs) each request keeps an id of its own that carries the client's: two requests
    with one X-Request-Id never share one."""
    c, cfg = client
    seen = []
    for stream in (False, True):
        w = ScriptedWorker(redis_client, [both_start(), *deltas("Hi"), done()])
        resp = post(c, "/v1/chat/completions", chat(cfg, stream=stream),
                    headers={"X-Request-Id": "trace-42.a:b_c", **NO_CACHE})
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "trace-42.a:b_c"
        ids = {ch["id"] for ch in sse(resp)[:-1]} if stream else {resp.get_json()["id"]}
        assert ids == {"chatcmpl-trace-42.a:b_c"}
        assert re.fullmatch(r"chatcmpl-trace-42\.a:b_c@[0-9a-f]{32}", w.request_id)
        seen.append(w.request_id)
    assert seen[0] != seen[1]
    w = ScriptedWorker(redis_client, [both_start(), *deltas(" x"), done()])
    resp = post(c, "/v1/completions", {"model": cfg.default_model, "prompt": "a"}, headers={"X-Request-Id": "c1"})
    assert resp.get_json()["id"] == "cmpl-c1" and resp.headers["x-request-id"] == "c1"
    assert w.request_id.startswith("cmpl-c1@")
    # not 1-128 of [A-Za-z0-9._:-]: ignored, an id of the farm's own as without one (no 400)
    for bad in ("has space", "x" * 129, "semi;colon", "a@b", "é"):
        w = ScriptedWorker(redis_client, [both_start(), *deltas("Hi"), done()])
        resp = post(c, "/v1/chat/completions", chat(cfg), headers={"X-Request-Id": bad, **NO_CACHE})
        assert resp.status_code == 200
        assert resp.headers["x-request-id"] == resp.get_json()["id"] == w.request_id
        assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", w.request_id)


# -- the built-in engine honours the text options (tiny random model, tokens forced with logit_bias) -----------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Iterator[Engine]:
    eng = Engine(tiny_model_dir, EngineConfig(block_size=4, max_num_batched_tokens=64), max_model_len=512).start()
    yield eng
    eng.stop()


def one_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, ids
    return ids[0]


def forced(token: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, logit_bias={token: 100.0}, **kw)


def test_detokenizer_shows_special_tokens_only_when_asked(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    hello = one_token(tok, "Hello")
    assert IncrementalDetokenizer(tok).add([hello, end]) == "Hello"
    shown = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert shown.add([hello]) + shown.add([end]) == "Hello<|im_end|>"


@pytest.mark.parametrize("skip", [True, False])
def test_the_detokenizer_gives_the_whole_decode_token_by_token(tok, skip):
    """Each token decodes a short window, not the whole output again (1.2 ms a token at 8,192 tokens before):
    the deltas still add up to the whole decode, through multi-byte characters, emoji, CJK, special tokens, odd
    spacing and random ids, and a migrated request's detokenizer resumes after the text already sent."""
    import random

    rng = random.Random(7)
    words = tok("Héllo wörld! 你好，世界。 emoji 😀😀 tabs\tand\nnewlines  double  spaces, \"quotes\" .",
                add_special_tokens=False)["input_ids"]
    pool = words + list(tok.all_special_ids)
    for n in range(300):
        ids = [rng.choice(pool) if n % 2 else rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 90))]
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        out = "".join(d.add([t]) for t in ids)
        whole = tok.decode(ids, skip_special_tokens=skip)
        assert out == d.text and whole.startswith(out) and (out == whole or whole.endswith("\ufffd")), (ids, out)
        # a migration carries the longest prefix whose text the reader has whole (Submission._clean_prefix)
        cut = next((k for k in range(len(ids) // 2, 0, -1)
                    if tok.decode(ids[:k], skip_special_tokens=skip) == whole[:len(tok.decode(
                        ids[:k], skip_special_tokens=skip))] and not tok.decode(ids[:k]).endswith("\ufffd")), 0)
        sent = tok.decode(ids[:cut], skip_special_tokens=skip)
        resumed = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        resumed.resume(ids[:cut], sent)
        assert sent + "".join(resumed.add([t]) for t in ids[cut:]) == out


def test_engine_skip_special_tokens(tiny):
    end = one_token(tiny.tokenizer, "<|im_end|>")
    assert end in tiny.eos_ids
    prompt = list(range(100, 110))
    hidden = run(tiny, prompt, forced(end, max_tokens=3, ignore_eos=True))
    shown = run(tiny, prompt, forced(end, max_tokens=3, ignore_eos=True, skip_special_tokens=False))
    assert hidden.token_ids == shown.token_ids == [end] * 3
    assert (hidden.text, shown.text) == ("", "<|im_end|>" * 3)


def test_engine_include_stop_str_in_output(tiny):
    word = one_token(tiny.tokenizer, "Hello")
    prompt = list(range(200, 210))
    cut = run(tiny, prompt, forced(word, max_tokens=8, stop=["ell"]))
    kept = run(tiny, prompt, forced(word, max_tokens=8, stop=["ell"], include_stop_str_in_output=True))
    assert (cut.text, cut.last.finish_reason) == ("H", "stop")
    assert (kept.text, kept.last.finish_reason) == ("Hell", "stop")
    # of two stop strings, the one that ends first ends the text (as vLLM picks it), cut at its start or end
    for include, text in ((True, "Hel"), (False, "H")):
        out = run(tiny, prompt, forced(word, max_tokens=8, stop=["Hello", "el"], include_stop_str_in_output=include))
        assert out.text == text
    # a stop token's text: kept when asked (vLLM), so a shown special token appears; an invisible one adds nothing
    end = one_token(tiny.tokenizer, "<|im_end|>")
    for skip, text in ((False, "<|im_end|>"), (True, "")):
        out = run(tiny, prompt, forced(end, max_tokens=4, include_stop_str_in_output=True, skip_special_tokens=skip))
        assert (out.text, out.last.finish_reason, out.token_ids) == (text, "stop", [end])
    plain = run(tiny, prompt, forced(end, max_tokens=4, skip_special_tokens=False))
    assert plain.text == ""  # not kept unless asked
    for include, text in ((True, "Hello"), (False, "")):  # stop_token_ids: the stop token's text, when asked
        out = run(tiny, prompt, forced(word, max_tokens=4, stop_token_ids=[word], include_stop_str_in_output=include))
        assert (out.text, out.last.finish_reason) == (text, "stop")


def test_engine_holds_back_a_stop_string_split_across_tokens(tiny):
    """A stop string that begins in one token and ends in the next is never sent in part (vLLM holds the tail
    back): "Hello" forced twice, stop "loH" spans the two; a tail that turns out not to stop is sent later."""
    word = one_token(tiny.tokenizer, "Hello")
    prompt = list(range(300, 310))
    out = run(tiny, prompt, forced(word, max_tokens=6, stop=["loH"]))
    assert (out.text, out.last.finish_reason) == ("Hel", "stop")
    assert [o.text for o in out.outs] == ["Hel", ""]  # "lo" held back from the first token's delta, then cut
    kept = run(tiny, prompt, forced(word, max_tokens=6, stop=["loH"], include_stop_str_in_output=True))
    assert kept.text == "HelloH"
    loose = run(tiny, prompt, forced(word, max_tokens=3, stop=["lox"]))  # "lo" begins it, "H" does not go on
    assert [o.text for o in loose.outs] == ["Hel", "loHel", "loHello"] and loose.text == "Hello" * 3
    assert loose.last.finish_reason == "length"


# -- vLLM's per-request token series, once per request ---------------------------------------------------------
def test_token_buckets_are_vllms():
    assert token_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert token_buckets(1) == (1,)
    t = RequestTokens(100)
    t.prefilled(7)
    t.finished("stop", 7, 3)
    t.finished("error:boom", 7, 0)
    snap = t.snapshot()
    assert snap["prompt_tokens"] == 7
    assert snap["request_success"] == {"stop": 1, "length": 0, "abort": 0, "error": 1, "repetition": 0}
    h = snap["histograms"]["request_generation_tokens"]
    assert h["le"][:3] == [1, 2, 5] and h["counts"][:3] == [1, 1, 2] and h["sum"] == 3 and h["count"] == 2


def test_engine_counts_a_disaggregated_request_once(tiny_model_dir):
    """The prefill engine counts the prompt and no finished request; the decode engine that imports the KV counts
    the request's end (its prompt and completion tokens) and not the prompt again."""
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=64)
    src, dst = (Engine(tiny_model_dir, cfg, max_model_len=512).start() for _ in range(2))
    try:
        prompt = list(range(4000, 4037))
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        held = run(src, prompt, params, prefill_only=True).last
        data = src.runner.read_blocks(held.held_blocks)
        src.release_held(held.request_id)
        out = run(dst, prompt, params, kv_import=KVImport(data, len(prompt), held.first_token)).last
        assert out.completion_tokens == 5
        s, d = src.stats(), dst.stats()
        assert (s["prompt_tokens"], sum(s["request_success"].values())) == (37, 0)
        assert (d["prompt_tokens"], d["request_success"]["length"]) == (0, 1)
        assert d["histograms"]["request_prompt_tokens"]["sum"] == 37
        assert d["histograms"]["request_generation_tokens"]["sum"] == 5
        assert d["histograms"]["request_max_num_generation_tokens"]["count"] == 1
        # aggregated: both on one engine; an abort counts as one
        c = Collector()
        dst.submit("agg", prompt, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), c)
        run(dst, prompt[:9], params)
        dst.abort("agg")
        c.wait()
        d = dst.stats()
        assert d["prompt_tokens"] == 37 + 9  # an engine counts the prompts it computes
        assert (d["request_success"]["length"], d["request_success"]["abort"]) == (2, 1)
    finally:
        src.stop()
        dst.stop()


def test_a_batch_without_max_tokens_gives_each_prompt_its_own_room(app, tok):
    """The review: with `max_tokens` left out, every prompt of a batch got the longest one's room (a short prompt
    was cut shorter than sent alone); vLLM defaults each prompt to what its context leaves it. An explicit value,
    a model's default and a quota's cap still hold for all."""
    from dataclasses import replace

    from api.routes.openai import _choice_requests
    from farm.config import SamplingDefaults
    from farm.openai.parsing import parse_completion

    body = {"model": "m", "prompt": [[1, 2, 3], [5] * 100]}
    parsed = parse_completion(body, tok, 512)
    with app.test_request_context():  # the requests carry the caller's cache scope
        reqs = _choice_requests("cmpl-x", "m", replace(parsed, n=1))
        assert [r.sampling.max_tokens for r in reqs] == [509, 412]
        assert [r.sampling.max_tokens for r in _choice_requests("cmpl-x", "m", parsed.capped(100))] == [100, 100]
        assert {r.sampling.max_tokens for r in _choice_requests(
            "cmpl-x", "m", parse_completion({**body, "max_tokens": 7}, tok, 512))} == {7}
        assert [r.sampling.max_tokens for r in _choice_requests(
            "cmpl-x", "m", parse_completion(body, tok, 512, SamplingDefaults(max_tokens=450)))] == [450, 412]
