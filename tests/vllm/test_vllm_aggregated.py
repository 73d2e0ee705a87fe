"""The farm's vLLM backend on a real vLLM engine (CPU build): two aggregated `backend: vllm` workers behind
the farm's API, driven with the official openai SDK, compared with `vllm serve` on the same settings.

The module's farm is shared; its last two tests take the workers down (one killed, one drained), so they
stay last."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import openai
import pytest
import redis
import requests

from farm.cluster import registry
from farm.gateway import Gateway
from farm.models.tokenization import bad_words_token_ids, chat_prompt_ids, get_tokenizer
from farm.protocol import GenerationRequest, SamplingParams
from farm.supervisor import Farm
from tests import tool_loops
from tests.vllm.conftest import MODEL, vllm_farm

pytestmark = pytest.mark.slow

SYSTEM = ("You are a meticulous assistant for a public library. You answer questions about opening hours, "
          "membership, borrowing rules, late fees, events for children and adults, the reading room, the "
          "archive of local newspapers, interlibrary loans, printing and scanning, and the study rooms that "
          "can be booked online. Answer briefly and politely, and say when you do not know.")
PROMPTS = ["What is 2+2?", "Name three colours of the rainbow.", "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def farm(tmp_path_factory, real_model_dir) -> Farm:
    with vllm_farm(tmp_path_factory.mktemp("vllm-farm"), real_model_dir, both=2,
                   env={"FARM_RELIABILITY__LEASE_TTL_S": "3"}) as f:
        yield f


@pytest.fixture(scope="module")
def r(farm) -> redis.Redis:
    return redis.Redis.from_url(farm.cfg.redis.url)


@pytest.fixture(scope="module")
def gateway(farm, r) -> Gateway:
    gw = Gateway(farm.cfg, r)
    yield gw
    gw.stop()


@pytest.fixture
def client(farm) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{farm.api_port}/v1", api_key="unused", max_retries=0)


def stats(r: redis.Redis, worker_id: str) -> dict:
    return json.loads(r.get(registry.alive_key(worker_id)) or "{}")


def request(farm, text: str, **sampling) -> GenerationRequest:
    ids = chat_prompt_ids(get_tokenizer(farm.cfg, MODEL), [{"role": "user", "content": text}])
    return GenerationRequest(uuid.uuid4().hex, MODEL, ids,
                             SamplingParams(**{"max_tokens": 64, "temperature": 0.0, **sampling}))


def test_workers_are_vllm_engines_with_the_models_block_size(farm, r):
    workers = registry.live_workers(r, model=MODEL)
    assert len(workers) == 2 and {w.block_size for w in workers} == {32}
    for w in workers:
        s = stats(r, w.worker_id)
        assert s["backend"] == "vllm" and s["blocks_total"] > 0
    assert {w.device for w in workers} == {"cpu"}
    for proc in farm.procs:  # on CPU, vLLM's engine core and executor wait for each other by blocking
        if proc.role == "both":
            assert "vLLM's engine core and executor block while they wait" in farm.log_path(proc.name).read_text()


def test_openai_sdk_chat_and_completion_streamed_and_not(farm, client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=24, temperature=0)
    resp = raw.parse()
    assert resp.choices[0].message.content.strip() and resp.choices[0].finish_reason in ("stop", "length")
    assert 0 < resp.usage.completion_tokens <= 24 and resp.usage.prompt_tokens > 0
    live = {w.worker_id for w in registry.live_workers(redis.Redis.from_url(farm.cfg.redis.url))}
    assert raw.headers["x-farm-decode-worker"] in live and raw.headers["x-farm-prefill"] == "local"
    assert raw.headers["x-farm-router-mode"] == "kv" and raw.headers["x-request-id"] == resp.id

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to five."}], max_tokens=16,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].usage.completion_tokens == 16 or [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert done.choices[0].text.strip() and done.usage.completion_tokens <= 8


def test_greedy_output_identical_to_vllm_serve(client, vllm_serve):
    """Same vLLM, model, dtype and block size: the farm's path changes nothing in what is generated."""
    serve = openai.OpenAI(base_url=vllm_serve.url, api_key="unused", max_retries=0)
    for text in PROMPTS:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
        ours = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
        theirs = serve.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens  # the same chat template, same tokens
        assert ours.choices[0].message.content == theirs.choices[0].message.content
        assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason
        ours = client.completions.create(model=MODEL, prompt=text, max_tokens=24, temperature=0)
        theirs = serve.completions.create(model=MODEL, prompt=text, max_tokens=24, temperature=0)
        assert ours.choices[0].text == theirs.choices[0].text


def test_prompt_scoring_is_vllm_serves(client, vllm_serve):
    """lm-eval's log-likelihood request (a batch of prompts, echo, logprobs 1, max_tokens 1): the farm's tokens and
    log-probabilities, the prompt's included, are `vllm serve`'s."""
    serve = openai.OpenAI(base_url=vllm_serve.url, api_key="unused", max_retries=0)
    kw = {"model": MODEL, "prompt": PROMPTS[:2], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    ours, theirs = client.completions.create(**kw), serve.completions.create(**kw)
    for a, b in zip(ours.choices, theirs.choices, strict=True):
        assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens
        assert a.logprobs.token_logprobs[0] is None and b.logprobs.token_logprobs[0] is None
        for x, y in zip(a.logprobs.token_logprobs[1:], b.logprobs.token_logprobs[1:], strict=True):
            assert abs(x - y) < 1e-3
        assert [set(t) for t in a.logprobs.top_logprobs[1:]] == [set(t) for t in b.logprobs.top_logprobs[1:]]
        # vLLM's choice shows them as `prompt_logprobs` too: the same ids, in the same order, the same ranks
        assert [x and [(k, v["rank"]) for k, v in x.items()] for x in a.prompt_logprobs] == \
            [y and [(k, v["rank"]) for k, v in y.items()] for y in b.prompt_logprobs]
    # `max_tokens` 0 (the scoring form of OpenAI's legacy API): the prompt alone, its usage and finish as vLLM's
    kw["max_tokens"] = 0
    ours, theirs = client.completions.create(**kw), serve.completions.create(**kw)
    assert (ours.usage.prompt_tokens, ours.usage.completion_tokens) == (theirs.usage.prompt_tokens,
                                                                      theirs.usage.completion_tokens)
    for a, b in zip(ours.choices, theirs.choices, strict=True):
        assert (a.text, a.finish_reason, a.logprobs.tokens) == (b.text, b.finish_reason, b.logprobs.tokens)
        assert all(abs(x - y) < 1e-3 for x, y in zip(a.logprobs.token_logprobs[1:], b.logprobs.token_logprobs[1:],
                                                     strict=True))
    streamed = ["", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in theirs.choices]


def test_every_sampling_parameter_reaches_vllm_as_vllm_serve_takes_it(client, vllm_serve):
    """Penalties, top_k, min_p, min_tokens, stop_token_ids, logit_bias and logprobs: the farm's answer is
    `vllm serve`'s, token for token (greedy, or seeded)."""
    serve = openai.OpenAI(base_url=vllm_serve.url, api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "List the days of the week, then the months of the year."}]
    cases = [
        {"temperature": 0, "frequency_penalty": 1.0, "presence_penalty": 0.5},
        {"temperature": 0, "extra_body": {"repetition_penalty": 1.4, "min_tokens": 20}},
        {"temperature": 0, "logit_bias": {"28": -100, "216": 5}},
        {"temperature": 0.8, "seed": 11, "extra_body": {"top_k": 5, "min_p": 0.05}},
        {"temperature": 0, "extra_body": {"stop_token_ids": [30]}},
        {"temperature": 0, "extra_body": {"allowed_token_ids": [28, 216, 253, 314, 359, 2]}},
    ]
    for kw in cases:
        ours = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, **kw)
        theirs = serve.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, **kw)
        assert ours.choices[0].message.content == theirs.choices[0].message.content, kw
        assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason, kw
    ours = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=3)
    theirs = serve.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                           top_logprobs=3)
    for a, b in zip(ours.choices[0].logprobs.content, theirs.choices[0].logprobs.content, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-3
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
    two = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=1.0, seed=3, n=2)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 12


def test_structured_output_through_vllm(client):
    """response_format reaches vLLM's structured outputs (xgrammar): the answer is JSON of the schema."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}], max_tokens=150,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    person = json.loads(resp.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    msgs = [{"role": "user", "content": "Tell me about cats."}]
    free = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
    obj = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                         response_format={"type": "json_object"})
    assert not free.choices[0].message.content.lstrip().startswith("{")  # prose, unless constrained
    text = obj.choices[0].message.content.lstrip()
    assert text.startswith("{")  # a JSON object (40 tokens may end it before its closing brace)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_vllms_structured_outputs_answer_as_vllm_serve(client, vllm_serve):
    """vLLM's `structured_outputs` (a choice, a regex, a GBNF grammar, a JSON schema as text), on chat and text
    completions: the farm's greedy answer is `vllm serve`'s, and within the constraint."""
    import re

    serve = openai.OpenAI(base_url=vllm_serve.url, api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Is the sky blue? Then give a date."}]
    cases = [({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
             ({"regex": "(yes|no), [0-9]{4}-[0-9]{2}-[0-9]{2}"},
              lambda t: re.fullmatch("(yes|no), [0-9]{4}-[0-9]{2}-[0-9]{2}", t)),
             ({"grammar": 'root ::= answer ". " colour\nanswer ::= "Yes" | "No"\ncolour ::= "Blue" | "Grey"'},
              lambda t: re.fullmatch(r"(Yes|No)\. (Blue|Grey)", t)),
             ({"json": json.dumps({"type": "object", "properties": {"blue": {"type": "boolean"}}, "required": ["blue"]}),
               "disable_additional_properties": True}, lambda t: set(json.loads(t)) == {"blue"})]
    for so, ok in cases:
        kw = {"model": MODEL, "max_tokens": 40, "temperature": 0, "extra_body": {"structured_outputs": so}}
        ours = client.chat.completions.create(messages=msgs, **kw).choices[0]
        theirs = serve.chat.completions.create(messages=msgs, **kw).choices[0]
        assert ours.message.content == theirs.message.content and ok(ours.message.content), (so, ours, theirs)
        assert ours.finish_reason == theirs.finish_reason == "stop"
    kw = {"model": MODEL, "prompt": "The sky is", "max_tokens": 8, "temperature": 0,
          "extra_body": {"structured_outputs": {"choice": [" blue", " green"]}}}
    assert client.completions.create(**kw).choices[0].text == serve.completions.create(**kw).choices[0].text


def test_prompt_logprobs_are_vllm_serves(client, vllm_serve):
    """vLLM's `prompt_logprobs` through a farm of vLLM workers: `vllm serve`'s tokens, ranks and decoded tokens,
    on a text completion's choice and a chat's response."""
    serve = openai.OpenAI(base_url=vllm_serve.url, api_key="unused", max_retries=0)
    kw = {"model": MODEL, "max_tokens": 1, "temperature": 0, "extra_body": {"prompt_logprobs": 2}}
    ours, theirs = client.completions.create(prompt=PROMPTS[0], **kw), serve.completions.create(prompt=PROMPTS[0], **kw)
    msgs = [{"role": "user", "content": "Say hello."}]
    chat_ours, chat_theirs = (client.chat.completions.create(messages=msgs, **kw),
                              serve.chat.completions.create(messages=msgs, **kw))
    for a, b in ((ours.choices[0].prompt_logprobs, theirs.choices[0].prompt_logprobs),
                 (chat_ours.prompt_logprobs, chat_theirs.prompt_logprobs)):
        assert a[0] is None and b[0] is None and len(a) == len(b) > 3
        for x, y in zip(a[1:], b[1:], strict=True):
            assert list(x) == list(y)  # the same token ids, in the same order
            assert all(x[t]["rank"] == y[t]["rank"] and x[t]["decoded_token"] == y[t]["decoded_token"]
                       and abs(x[t]["logprob"] - y[t]["logprob"]) < 1e-3 for t in x)


def test_truncate_prompt_tokens_keeps_what_vllm_serve_keeps(client, vllm_serve):
    """vLLM's `truncate_prompt_tokens` and `truncation_side` through a farm of vLLM workers: `vllm serve`'s prompt
    ids, greedy answer and echo, on a text completion and a chat."""
    serve = openai.OpenAI(base_url=vllm_serve.url, api_key="unused", max_retries=0)
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[2]}]
    for side in ("left", "right"):
        extra = {"truncate_prompt_tokens": 12, "truncation_side": side, "return_token_ids": True}
        ours, theirs = (c.completions.create(prompt=SYSTEM, **kw, extra_body=extra) for c in (client, serve))
        assert ours.choices[0].prompt_token_ids == theirs.choices[0].prompt_token_ids
        assert len(ours.choices[0].prompt_token_ids) == 12 and ours.choices[0].text == theirs.choices[0].text
        ours, theirs = (c.chat.completions.create(messages=msgs, **kw, extra_body=extra) for c in (client, serve))
        assert ours.prompt_token_ids == theirs.prompt_token_ids and len(ours.prompt_token_ids) == 12
        assert ours.choices[0].message.content == theirs.choices[0].message.content
    # the same answer after the same 9 tokens; the farm's echo is those 9 tokens' text, vLLM's the whole prompt sent
    echo = {"echo": True, "extra_body": {"truncate_prompt_tokens": 9}}
    ours, theirs = (c.completions.create(prompt=SYSTEM, **kw, **echo) for c in (client, serve))
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens == 9
    assert theirs.choices[0].text.startswith(SYSTEM) and theirs.choices[0].text.endswith(ours.choices[0].text)
    assert SYSTEM.endswith(ours.choices[0].text[:-len(theirs.choices[0].text[len(SYSTEM):]) or None])


def test_bad_words_are_tokenized_as_vllm_tokenizes_them(real_model_dir):
    """The built-in engine's bad words are vLLM's token sequences (SamplingParams.update_from_tokenizer): a word
    alone and after a space, a phrase, a word with a leading space, punctuation."""
    from transformers import AutoTokenizer
    from vllm.sampling_params import SamplingParams as VllmParams
    from vllm.tokenizers import get_tokenizer as vllm_tokenizer

    words = ["Paris", " hello", "of the", "!", "unbelievable", "Paris"]
    theirs = VllmParams(bad_words=words)
    theirs.update_from_tokenizer(vllm_tokenizer(str(real_model_dir)))
    assert bad_words_token_ids(AutoTokenizer.from_pretrained(real_model_dir), words) == theirs.bad_words_token_ids


def test_bad_words_answer_as_vllm_serve_answers(client, vllm_serve):
    """vLLM's bad_words through a farm of vLLM workers: `vllm serve`'s greedy answer, chat and text."""
    serve = openai.OpenAI(base_url=vllm_serve.url, api_key="unused", max_retries=0)
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    free = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    banned = {"extra_body": {"bad_words": ["Paris", "capital"]}}
    ours, theirs = (c.chat.completions.create(messages=msgs, **kw, **banned) for c in (client, serve))
    assert ours.choices[0].message.content == theirs.choices[0].message.content != free
    assert "Paris" not in ours.choices[0].message.content
    ours, theirs = (c.completions.create(prompt="The capital of France is", **kw, **banned) for c in (client, serve))
    assert ours.choices[0].text == theirs.choices[0].text and "Paris" not in ours.choices[0].text


def test_logprob_token_ids_are_vllm_serves(client, vllm_serve, real_model_dir):
    """vLLM's logprob_token_ids through a farm of vLLM workers: `vllm serve`'s tokens and values at every position,
    chat and text (a label set scored: " Yes" / " No"; the built-in engine's are tests/test_engine.py's)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_dir)
    labels = [tok.encode(w, add_special_tokens=False)[0] for w in (" Yes", " No", "Yes")]
    serve = openai.OpenAI(base_url=vllm_serve.url, api_key="unused", max_retries=0)
    kw = {"model": MODEL, "max_tokens": 3, "temperature": 0, "extra_body": {"logprob_token_ids": labels}}
    msgs = [{"role": "user", "content": "Is the sky blue? Answer Yes or No."}]
    ours, theirs = (c.chat.completions.create(messages=msgs, logprobs=True, **kw) for c in (client, serve))
    a, b = ours.choices[0].logprobs.content, theirs.choices[0].logprobs.content
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs] and len(x.top_logprobs) >= 3
        assert all(abs(p.logprob - q.logprob) < 1e-3 for p, q in zip(x.top_logprobs, y.top_logprobs, strict=True))
    ours, theirs = (c.completions.create(prompt="Is the sky blue? Answer:", logprobs=0, **kw) for c in (client, serve))
    a, b = ours.choices[0].logprobs, theirs.choices[0].logprobs
    assert a.tokens == b.tokens and [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]


def test_bad_words_past_vllms_token_bound_are_refused_by_the_worker(farm, gateway):
    """bad_words of more than 1,024 tokens in all, sent past the API's checks (anything holding the Redis password
    can send a task): vLLM's model runner raises when it schedules such a request, which ends its engine core and
    every request of the worker with it (the review, from vLLM's source). The worker refuses the request alone, as
    a client's error, and answers the next one."""
    from farm.gateway.failures import WorkerError

    huge = ["".join(chr(0x4E00 + 97 * i + j) + "\U0001F600" for j in range(128)) for i in range(4)]
    try:
        events = list(gateway.submit(request(farm, "Say hi.", bad_words=huge)).events(first_timeout_s=120,
                                                                                      idle_timeout_s=120))
        failure = next((e.message for e in events if e.type == "error"), None)
    except WorkerError as e:
        failure = str(e)
    assert failure is not None and "bad_words" in failure and "1024" in failure
    after = list(gateway.submit(request(farm, "Say hi.", max_tokens=4)).events(first_timeout_s=120,
                                                                                idle_timeout_s=120))
    assert after[-1].type == "done"


def test_return_token_ids_are_vllm_serves(client, vllm_serve):
    """vLLM's `return_token_ids`: the farm's prompt and generated ids are `vllm serve`'s, chat and text, streamed
    or not (the end-of-sequence token among them, as vLLM counts it)."""
    serve = openai.OpenAI(base_url=vllm_serve.url, api_key="unused", max_retries=0)
    kw = {"model": MODEL, "max_tokens": 16, "temperature": 0, "extra_body": {"return_token_ids": True}}
    msgs = [{"role": "user", "content": "Say hello in French."}]
    ours, theirs = client.chat.completions.create(messages=msgs, **kw), serve.chat.completions.create(messages=msgs, **kw)
    assert ours.prompt_token_ids == theirs.prompt_token_ids
    assert ours.choices[0].token_ids == theirs.choices[0].token_ids
    ours, theirs = client.completions.create(prompt=PROMPTS[0], **kw), serve.completions.create(prompt=PROMPTS[0], **kw)
    assert (ours.choices[0].prompt_token_ids, ours.choices[0].token_ids) == \
        (theirs.choices[0].prompt_token_ids, theirs.choices[0].token_ids)
    streamed = [i for c in client.chat.completions.create(messages=msgs, stream=True, **kw) if c.choices
                for i in (getattr(c.choices[0], "token_ids", None) or [])]
    assert streamed == serve.chat.completions.create(messages=msgs, **kw).choices[0].token_ids


def test_tool_calls_through_vllm(client):
    """tool_choice required and a named function through vLLM's structured outputs, streamed and not; the calls read
    by the API as for the built-in engine."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}}
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    resp = client.chat.completions.create(model=MODEL, messages=ask, tools=[tool], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert resp.choices[0].finish_reason == "tool_calls"
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, tools=[tool], max_tokens=60,
                                                 temperature=0, stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert json.loads("".join(d.function.arguments or "" for d in deltas))["city"] in ("Paris", "Oslo")


def test_tool_loops_of_three_clients_through_vllm(farm):
    """The openai SDK, OpenAI's Agents SDK and the anthropic SDK each run a real tool loop on vLLM workers, as they do
    on built-in ones (tests/tool_loops.py): forced calls through vLLM's structured outputs, results through the
    template, auto turns read by the API."""
    base = f"http://127.0.0.1:{farm.api_port}"
    tool_loops.openai_sdk_loop(base, MODEL)
    tool_loops.agent_loop(base, MODEL)
    tool_loops.anthropic_sdk_loop(base, MODEL)


def test_vllm_kv_events_reach_the_router_and_cached_tokens_confirm_them(client):
    """vLLM's KV events (stored blocks, re-hashed into the farm's hashes) fill the Redis index: a request
    sharing a prefix is predicted cached on its worker, and vLLM's own cached-token count agrees."""
    system = f"Reference {uuid.uuid4().hex}. " + SYSTEM  # a prefix no earlier test cached
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hello"}],
        max_tokens=4, temperature=0)
    assert first.headers["x-farm-router-overlap-tokens"] == "0"
    assert first.parse().usage.prompt_tokens_details.cached_tokens == 0
    holders = {first.headers["x-farm-decode-worker"]}  # the workers that computed the prefix
    deadline = time.monotonic() + 15
    while True:  # the events travel worker -> Redis stream -> the API's index: allow them a moment
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "system", "content": system},
                                   {"role": "user", "content": f"Hi {uuid.uuid4().hex[:6]}"}],
            max_tokens=4, temperature=0)
        predicted = int(raw.headers["x-farm-router-overlap-tokens"])
        if predicted or time.monotonic() > deadline:
            break
        holders.add(raw.headers["x-farm-decode-worker"])  # placed before the events came: it holds it now too
        time.sleep(0.5)
    resp = raw.parse()
    prompt_tokens = resp.usage.prompt_tokens
    assert predicted >= 32 * ((prompt_tokens - 16) // 32) - 32 and predicted % 32 == 0
    assert raw.headers["x-farm-decode-worker"] in holders, holders  # placed where the prefix is
    assert resp.usage.prompt_tokens_details.cached_tokens == predicted


def test_client_disconnect_aborts_the_request_inside_vllm(farm, r):
    url = f"http://127.0.0.1:{farm.api_port}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
    with requests.post(url, json=body, stream=True, timeout=60) as resp:
        worker = resp.headers["x-farm-decode-worker"]
        before = stats(r, worker).get("tokens_generated", 0)
        got = 0
        for line in resp.iter_lines():
            got += line.startswith(b"data:")
            if got == 10:
                break
        assert got == 10
    closed = time.time()
    # The API notices the closed connection, sets the cancel key; the worker aborts the request in vLLM.
    # Stats come with heartbeats (every registry.HEARTBEAT_INTERVAL_S): only one taken after the close counts.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        s = stats(r, worker)
        if s.get("ts", 0) > closed and s.get("running") == 0 and s.get("vllm_unfinished") == 0:
            break
        time.sleep(0.5)
    assert s.get("ts", 0) > closed and s.get("running") == 0 and s.get("vllm_unfinished") == 0, s
    settled = s
    time.sleep(2 * registry.HEARTBEAT_INTERVAL_S + 1)
    later = stats(r, worker)
    assert later["ts"] > settled["ts"], "a newer heartbeat"
    assert later["tokens_generated"] == settled["tokens_generated"]  # nothing generates any more
    assert settled["tokens_generated"] - before < 1500


def test_killed_vllm_worker_stream_migrates_with_the_same_greedy_output(farm, gateway, r):
    ref = list(gateway.submit(request(farm, "Tell me a story about a lighthouse.", max_tokens=120,
                                      ignore_eos=True)).events(first_timeout_s=120, idle_timeout_s=120))
    ref_ids = [i for e in ref if e.type == "delta" for i in e.ids]
    assert ref[-1].type == "done" and len(ref_ids) == 120
    sub = gateway.submit(request(farm, "Tell me a story about a lighthouse.", max_tokens=120, ignore_eos=True))
    events, victim, seen = [], None, 0
    for ev in sub.events(first_timeout_s=120, idle_timeout_s=120):
        events.append(ev)
        if ev.type == "start" and victim is None:
            victim = ev.worker
        seen += ev.n if ev.type == "delta" else 0
        if victim and seen >= 20 and farm_proc(farm, victim).alive():
            engine = _engine_processes(farm_proc(farm, victim).pid)
            assert engine  # vLLM runs its engine core (and its model worker) in processes of its own
            os.kill(farm_proc(farm, victim).pid, signal.SIGKILL)
    done = events[-1]
    assert done.type == "done", events[-3:]
    assert done.migrations == 1 and done.decode_worker != victim
    assert done.usage.completion_tokens == 120 and done.finish_reason == "length"
    assert [i for e in events if e.type == "delta" for i in e.ids] == ref_ids
    assert _all_gone(engine)  # the killed worker's vLLM processes go with it: no orphan keeps cores or memory


def test_warm_shutdown_drains_the_request_in_flight(farm, gateway, r):
    """SIGTERM (Celery's warm shutdown): the worker leaves routing, finishes its request, then exits."""
    sub = gateway.submit(request(farm, "Describe a walk through a forest.", max_tokens=100, ignore_eos=True))
    events, worker = [], None
    for ev in sub.events(first_timeout_s=120, idle_timeout_s=120):
        events.append(ev)
        if ev.type == "start" and worker is None:
            worker = ev.worker
            proc = farm_proc(farm, worker)
            proc.send(signal.SIGTERM)
    done = events[-1]
    assert done.type == "done" and done.decode_worker == worker and not done.migrations
    assert done.usage.completion_tokens == 100
    assert proc.popen.wait(90) == 0
    assert worker not in {w.worker_id for w in registry.live_workers(r)}


def farm_proc(farm, worker_id: str):
    return next(p for p in farm.procs if p.worker_id == worker_id)


def _engine_processes(pid: int) -> list:
    """The vLLM engine processes (VLLM::EngineCore, VLLM::Worker) a worker process started."""
    import psutil

    return [c for c in psutil.Process(pid).children(recursive=True) if "VLLM" in c.name() + " ".join(c.cmdline())]


def _all_gone(procs: list, timeout: float = 20) -> bool:
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not alive
