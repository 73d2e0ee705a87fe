"""vLLM's /tokenize, /detokenize and /version, and OpenAI's /v1/embeddings (api/routes/utility.py,
api/routes/embeddings.py, farm/openai/utility.py): real apps on a real Redis with the real tokenizer and the real
MiniLM embedder. A chat completion's prompt is checked against /tokenize twice: the exact ids the API queues for a
scripted worker (it takes the task as Celery would), and, last, usage.prompt_tokens of a real aggregated worker's
answer."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from flask import Flask

from farm import __version__
from farm.models.tokenization import chat_prompt_ids, max_token_chars
from farm.openai.parsing import prompt_char_limit
from farm.protocol import EVENT_FIELD, GenerationRequest, encode_reply, reply_stream_key
from farm.protocol.queues import direct_queue
from farm.semantic.embeddings import DIM, MAX_TOKENS, MODEL_NAME
from farm.tenancy.api_keys import owner_of
from tests.conftest import make_farm_env
from tests.ghosts import ghost_alive
from tests.procs import WorkerProc, wait_registered
from tests.security_helpers import KEY_A, KEY_B, assert_openai_error, bearer, farm_app

GHOST = "utility-ghost@test"
MESSAGES = [{"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
REMOTE = {"REMOTE_ADDR": "10.9.8.7"}


@pytest.fixture(scope="module")
def app(redis_url, tmp_path_factory) -> Iterator[Flask]:
    """No keys (the test client is a loopback client); the semantic layer on, without its PII guard (slow to
    load, not what is tested here)."""
    with farm_app(redis_url, tmp_path_factory.mktemp("utility"), FARM_SEMANTIC__PII__ENABLED="false") as app:
        app.extensions["farm"].semantic()  # built now: the embedder and the layer's warm-up
        yield app


@pytest.fixture
def c(app, redis_client):
    return app.test_client()


@pytest.fixture(scope="module")
def keyed_app(redis_url, tmp_path_factory) -> Iterator[Flask]:
    """API keys, a request-rate limit and a token quota; the semantic layer off (/v1/embeddings loads the
    embedder itself)."""
    with farm_app(redis_url, tmp_path_factory.mktemp("utility-keyed"), FARM_API_KEYS=f"{KEY_A},{KEY_B}",
                  FARM_SEMANTIC__ENABLED="false", FARM_API__LIMITS__REQUESTS_PER_MINUTE="4",
                  FARM_API__LIMITS__TOKEN_QUOTA="200") as app:
        yield app


def _model(app: Flask) -> str:
    return app.extensions["farm"].cfg.default_model


def _tok(app: Flask):
    return app.extensions["farm"].tokenizer(_model(app))


# -- /tokenize and /detokenize ----------------------------------------------------------------------
def test_tokenize_a_prompt_and_detokenize_it_back(app, c):
    text = "Hello, world! Grüße aus Zürich: 2+2=4 ✓"
    resp = c.post("/tokenize", json={"model": _model(app), "prompt": text})
    assert resp.status_code == 200, resp.data
    body = resp.get_json()
    assert list(body) == ["count", "max_model_len", "tokens", "token_strs"]
    assert body["tokens"] == _tok(app)(text, add_special_tokens=True)["input_ids"]
    assert body["count"] == len(body["tokens"]) > 5 and body["token_strs"] is None
    assert body["max_model_len"] == app.extensions["farm"].cfg.model(_model(app)).max_model_len
    back = c.post("/detokenize", json={"model": _model(app), "tokens": body["tokens"]})
    assert back.status_code == 200 and back.get_json() == {"prompt": text}
    # the model may be left out (the default model, as vLLM's server takes its one model); token strings
    strs = c.post("/tokenize", json={"prompt": text, "return_token_strs": True,
                                     "add_special_tokens": False}).get_json()
    assert strs["tokens"] == _tok(app)(text, add_special_tokens=False)["input_ids"]
    assert strs["token_strs"] == _tok(app).convert_ids_to_tokens(strs["tokens"]) and len(strs["token_strs"]) == strs["count"]
    assert c.post("/detokenize", json={"tokens": []}).get_json() == {"prompt": ""}


class EchoWorker(threading.Thread):
    """Plays GHOST: takes one task from its queue (kombu's list, JSON body), answers "4" with usage.prompt_tokens
    = the prompt ids it got."""

    def __init__(self, r: redis.Redis):
        super().__init__(daemon=True)
        self.r = r
        self.request: GenerationRequest | None = None
        self.start()

    def run(self) -> None:
        popped = self.r.brpop([direct_queue(GHOST)], timeout=20)
        assert popped, "no task was queued"
        args = json.loads(base64.b64decode(json.loads(popped[1])["body"]))[0]
        req = self.request = GenerationRequest.from_dict(args[0])
        events = [{"type": "start", "role": "both", "worker": GHOST, "prefill_worker": GHOST, "prefill": "local"},
                  {"type": "delta", "text": "4", "n": 1, "ids": [100]},
                  {"type": "done", "finish_reason": "stop", "prefill_worker": GHOST, "decode_worker": GHOST,
                   "prefill": "local",
                   "usage": {"prompt_tokens": len(req.prompt_token_ids), "completion_tokens": 1, "cached_tokens": 0}}]
        writer = "echo-" + uuid.uuid4().hex
        for seq, ev in enumerate(events, start=1):
            self.r.xadd(reply_stream_key(req.reply_to), {EVENT_FIELD: encode_reply(writer, seq, {req.request_id: [ev]})})


@pytest.fixture
def ghost(app, redis_client):
    """GHOST, live while the test runs (an EchoWorker plays it)."""
    cfg = app.extensions["farm"].cfg
    with ghost_alive(redis_client, GHOST, cfg.default_model, cfg.engine.block_size):
        yield


def test_tokenized_chat_is_the_prompt_a_chat_completion_sends(app, c, redis_client, ghost):
    cfg = app.extensions["farm"].cfg
    tok = c.post("/tokenize", json={"model": cfg.default_model, "messages": MESSAGES}).get_json()
    worker = EchoWorker(redis_client)
    resp = c.post("/v1/chat/completions", json={"model": cfg.default_model, "messages": MESSAGES, "max_tokens": 4},
                  headers={"Cache-Control": "no-cache"})
    worker.join(20)
    assert resp.status_code == 200, resp.data
    assert worker.request.prompt_token_ids == tok["tokens"]  # the very ids the worker was sent
    assert resp.get_json()["usage"]["prompt_tokens"] == tok["count"]
    # and the farm's own templating (developer as system, text parts joined)
    normalized = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What is 2+2?"}]
    assert tok["tokens"] == chat_prompt_ids(_tok(app), normalized)
    # the template options mean the same on both routes
    opts = {"messages": [*MESSAGES, {"role": "assistant", "content": "It is"}], "add_generation_prompt": False,
            "continue_final_message": True, "chat_template_kwargs": {"some_flag": 1}}
    tok = c.post("/tokenize", json={"model": cfg.default_model, **opts}).get_json()
    worker = EchoWorker(redis_client)
    resp = c.post("/v1/chat/completions", json={"model": cfg.default_model, **opts, "max_tokens": 4},
                  headers={"Cache-Control": "no-cache"})
    worker.join(20)
    assert resp.status_code == 200, resp.data
    assert worker.request.prompt_token_ids == tok["tokens"] and resp.get_json()["usage"]["prompt_tokens"] == tok["count"]
    # and with tools and a tool call in the history: the same rendering (tools as the model's call format)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    tok = c.post("/tokenize", json={"model": cfg.default_model, "messages": history, "tools": tools}).get_json()
    worker = EchoWorker(redis_client)
    resp = c.post("/v1/chat/completions", json={"model": cfg.default_model, "messages": history, "tools": tools,
                                                "max_tokens": 4}, headers={"Cache-Control": "no-cache"})
    worker.join(20)
    assert resp.status_code == 200, resp.data
    assert worker.request.prompt_token_ids == tok["tokens"] and "<tool_response>" in _tok(app).decode(tok["tokens"])


def test_tokenize_chat_options(app, c):
    def tokens(**kw) -> list[int]:
        resp = c.post("/tokenize", json={"messages": MESSAGES, **kw})
        assert resp.status_code == 200, resp.data
        return resp.get_json()["tokens"]

    def text(ids: list[int]) -> str:
        return c.post("/detokenize", json={"tokens": ids}).get_json()["prompt"]

    with_prompt, without = tokens(), tokens(add_generation_prompt=False)
    assert len(without) < len(with_prompt) and with_prompt[:len(without)] == without
    assert text(with_prompt).startswith(text(without)) and text(with_prompt)[len(text(without)):].strip()
    # continue_final_message: the last (assistant) message stays open for the model to go on with
    prefill = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    resp = c.post("/tokenize", json={"messages": prefill, "continue_final_message": True,
                                     "add_generation_prompt": False})
    assert resp.status_code == 200, resp.data
    assert text(resp.get_json()["tokens"]).endswith("The answer is")
    closed = c.post("/tokenize", json={"messages": prefill, "add_generation_prompt": False}).get_json()["tokens"]
    assert not text(closed).endswith("The answer is")
    # chat_template_kwargs reach the template (a variable it does not read changes nothing)
    assert tokens(chat_template_kwargs={"some_flag": True}) == with_prompt
    assert len(tokens(add_special_tokens=True)) >= len(with_prompt)


@pytest.mark.parametrize("body,status,param,code", [
    ({"model": "no-such-model", "prompt": "hi"}, 404, "model", "model_not_found"),
    ({"model": "MoM", "prompt": "hi"}, 400, "model", "model_not_supported"),
    ({"prompt": "hi", "messages": MESSAGES}, 400, "prompt", None),
    ({"model": "SmolLM2-135M-Instruct"}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": "hi", "temperature": 1}, 400, "temperature", "unknown_parameter"),
    ({"prompt": 5}, 400, "prompt", "invalid_value"),
    ({"prompt": "hi", "add_special_tokens": 1}, 400, "add_special_tokens", "invalid_value"),
    ({"prompt": "hi", "return_token_strs": "yes"}, 400, "return_token_strs", "invalid_value"),
    ({"messages": []}, 400, "messages", None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id", None),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools", None),
    ({"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True}, 400,
     "continue_final_message", None),
    ({"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message", None),  # as in chat
    ({"messages": MESSAGES, "chat_template": "{{ messages }}"}, 400, "chat_template", "unsupported_parameter"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}}, 400, "chat_template_kwargs", "invalid_value"),
    ({"messages": MESSAGES, "chat_template_kwargs": ["x"]}, 400, "chat_template_kwargs", "invalid_value"),
    ({"prompt": "hi", "tokens": [1, 2]}, 400, "tokens", "unknown_parameter"),
])
def test_tokenize_errors_are_openai_400s(c, body, status, param, code):
    assert_openai_error(c.post("/tokenize", json=body), status, code, param=param)


def test_tokenize_and_detokenize_bad_input(app, c):
    vocab = len(_tok(app))
    err = assert_openai_error(c.post("/detokenize", json={"tokens": [1, vocab]}), 400, "invalid_value", param="tokens")
    assert str(vocab) in err["message"]
    assert_openai_error(c.post("/detokenize", json={"tokens": [1, -1]}), 400, "invalid_value", param="tokens[1]")
    assert_openai_error(c.post("/detokenize", json={"tokens": [1, True]}), 400, "invalid_value", param="tokens[1]")
    assert_openai_error(c.post("/detokenize", json={"tokens": [2 ** 70]}), 400, "invalid_value", param="tokens")
    assert_openai_error(c.post("/detokenize", json={"tokens": "1 2"}), 400, "invalid_value", param="tokens")
    assert_openai_error(c.post("/detokenize", json={}), 400, "missing_required_parameter", param="tokens")
    assert_openai_error(c.post("/detokenize", json={"model": "gpt-4", "tokens": [1]}), 404, "model_not_found")
    assert_openai_error(c.post("/detokenize", data="[1, 2]", content_type="application/json"), 400)
    assert_openai_error(c.post("/tokenize", data="{bad", content_type="application/json"), 400, "invalid_json")
    assert_openai_error(c.post("/tokenize", data="prompt=hi"), 415)
    assert_openai_error(c.get("/tokenize"), 405)
    # a prompt too long to fit by its characters alone is refused before it is tokenized
    cfg = app.extensions["farm"].cfg
    limit = prompt_char_limit(_tok(app), cfg.model(cfg.default_model).max_model_len, cfg.api.max_chars_per_token)
    assert_openai_error(c.post("/tokenize", json={"prompt": "a" * (limit + 1)}), 400, "context_length_exceeded",
                        param="prompt")
    # and one whose tools make it so (the messages' own count leaves them out), with or without special tokens
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "word " * (limit // 500)}}
             for i in range(128)]
    for special in (False, True):
        assert_openai_error(c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                      "add_special_tokens": special}),
                            400, "context_length_exceeded", param="messages")


def test_version(c):
    resp = c.get("/version", environ_base=REMOTE)
    assert resp.status_code == 200 and resp.get_json() == {"version": __version__}


# -- /v1/embeddings ---------------------------------------------------------------------------------
def _embed(c, inputs, headers=None, **kw):
    resp = c.post("/v1/embeddings", json={"model": MODEL_NAME, "input": inputs, **kw}, headers=headers or {})
    assert resp.status_code == 200, resp.data
    return resp.get_json()


def test_embeddings_rank_paraphrases_above_unrelated_text(app, c):
    texts = ["A man is playing a guitar.", "Someone is strumming a guitar.", "The central bank raised interest rates."]
    body = _embed(c, texts)
    assert body["object"] == "list" and body["model"] == MODEL_NAME
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"embedding"}
    vecs = np.array([d["embedding"] for d in body["data"]], dtype=np.float64)
    assert vecs.shape == (3, DIM) and np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2] + 0.3
    # the semantic layer's own embedder (one copy per process): the same vector as its per-request path
    farm = app.extensions["farm"]
    embedder = farm.embedder()
    assert embedder is farm.semantic().embedder
    assert np.allclose(vecs[0], embedder.encode_one(texts[0])[0], atol=1e-6)
    counts = [len(ids) for ids in embedder.token_ids(texts)]
    assert body["usage"] == {"prompt_tokens": sum(counts), "total_tokens": sum(counts)}
    # one string, the Hugging Face id, no model at all
    one = _embed(c, texts[1], model="sentence-transformers/all-MiniLM-L6-v2")
    assert len(one["data"]) == 1 and one["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert np.allclose(one["data"][0]["embedding"], vecs[1], atol=1e-6)
    resp = c.post("/v1/embeddings", json={"input": texts[1], "dimensions": DIM})
    assert resp.status_code == 200 and resp.get_json()["model"] == MODEL_NAME


def test_base64_is_the_same_floats_little_endian(c):
    texts = ["base64 or floats", "the same vector either way"]
    floats = _embed(c, texts)
    packed = _embed(c, texts, encoding_format="base64")
    assert packed["usage"] == floats["usage"]
    for f, b in zip(floats["data"], packed["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.shape == (DIM,)
        assert np.array_equal(decoded, np.array(f["embedding"], dtype=np.float32))


def test_long_inputs_are_refused_or_truncated(app, c):
    long = "word " * 400  # more than the 256-token window
    err = assert_openai_error(c.post("/v1/embeddings", json={"model": MODEL_NAME, "input": ["short", long]}), 400,
                              "context_length_exceeded", param="input[1]")
    assert str(MAX_TOKENS) in err["message"]
    whole = _embed(c, ["short", long], truncate_prompt_tokens=-1)
    cut = _embed(c, [long], truncate_prompt_tokens=16)
    assert cut["usage"]["prompt_tokens"] == 16
    assert whole["usage"]["prompt_tokens"] == MAX_TOKENS + len(app.extensions["farm"].embedder().token_ids(["short"])[0])
    # more characters than the window can hold by the vocabulary's longest entry: refused before tokenizing (as vLLM
    # does), or cut to that many characters first when truncating
    huge = "a " * (MAX_TOKENS * max_token_chars(app.extensions["farm"].embedder().tokenizer))
    err = assert_openai_error(c.post("/v1/embeddings", json={"input": huge}), 400, "context_length_exceeded",
                              param="input")
    assert "characters" in err["message"]
    assert _embed(c, huge, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == MAX_TOKENS


@pytest.mark.parametrize("body,status,param,code", [
    ({"model": MODEL_NAME, "input": [1, 2, 3]}, 400, "input", "unsupported_value"),
    ({"model": MODEL_NAME, "input": [[1, 2], [3]]}, 400, "input", "unsupported_value"),
    ({"model": MODEL_NAME, "input": []}, 400, "input", None),
    ({"model": MODEL_NAME, "input": ""}, 400, "input", "invalid_value"),
    ({"model": MODEL_NAME, "input": ["a", ""]}, 400, "input[1]", "invalid_value"),
    ({"model": MODEL_NAME, "input": ["a", None]}, 400, "input", None),
    ({"model": MODEL_NAME, "input": ["a"] * 257}, 400, "input", "invalid_value"),
    ({"model": MODEL_NAME}, 400, "input", "missing_required_parameter"),
    ({"model": MODEL_NAME, "input": "a", "dimensions": 128}, 400, "dimensions", "unsupported_value"),
    ({"model": MODEL_NAME, "input": "a", "dimensions": "384"}, 400, "dimensions", "invalid_value"),
    ({"model": MODEL_NAME, "input": "a", "encoding_format": "bytes"}, 400, "encoding_format", "invalid_value"),
    ({"model": MODEL_NAME, "input": "a", "truncate_prompt_tokens": 1}, 400, "truncate_prompt_tokens", "invalid_value"),
    ({"model": MODEL_NAME, "input": "a", "truncate_prompt_tokens": MAX_TOKENS + 1}, 400, "truncate_prompt_tokens",
     "invalid_value"),
    ({"model": MODEL_NAME, "input": "a", "temperature": 0}, 400, "temperature", "unknown_parameter"),
    ({"model": "text-embedding-3-small", "input": "a"}, 404, "model", "model_not_found"),
    ({"model": "SmolLM2-135M-Instruct", "input": "a"}, 400, "model", "model_not_supported"),
])
def test_embedding_errors_are_openai_errors(c, body, status, param, code):
    assert_openai_error(c.post("/v1/embeddings", json=body), status, code, param=param)


def test_the_openai_sdk_gets_the_same_vectors(app):
    """The official SDK asks for base64 unless told otherwise and decodes it itself (in-process over WSGI)."""
    import httpx
    import openai

    http = httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://127.0.0.1")
    client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", http_client=http, max_retries=0)
    texts = ["The SDK decodes base64 itself.", "A second input."]
    got = client.embeddings.create(model=MODEL_NAME, input=texts)
    plain = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens == plain.usage.prompt_tokens > 0
    for a, b in zip(got.data, plain.data, strict=True):
        assert len(a.embedding) == DIM and np.array_equal(np.float32(a.embedding), np.float32(b.embedding))
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL_NAME, input=[[1, 2, 3]])


def test_lone_surrogates_are_400_not_500(c):
    """JSON may spell a lone surrogate ("\\ud800"), which no tokenizer takes."""
    def post(path: str, body: str):
        return c.post(path, data=body, content_type="application/json")

    assert_openai_error(post("/tokenize", '{"prompt": "a\\ud800b"}'), 400, "invalid_value", param="prompt")
    assert_openai_error(post("/tokenize", '{"messages": [{"role": "user", "content": "a\\ud800"}]}'), 400,
                        "invalid_value", param="messages[0].content")
    assert_openai_error(post("/v1/embeddings", '{"input": ["ok", "a\\udc00"]}'), 400, "invalid_value",
                        param="input[1]")
    # every JSON route: refused as the body is read (api/bodies.py), before any tokenizer sees it
    assert_openai_error(post("/v1/completions", '{"model": "m", "prompt": "a\\ud800"}'), 400, "invalid_value",
                        param="prompt")
    assert_openai_error(post("/v1/chat/completions",
                             '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "\\udfff"}]}]}'), 400, "invalid_value", param="messages[0].content[0].text")
    ok = post("/tokenize", '{"prompt": "\\ud83d\\ude00"}')  # an escaped pair is one character: fine
    assert ok.status_code == 200 and ok.get_json()["count"] >= 1


# -- keys, limits, quota ----------------------------------------------------------------------------
def test_keys_rate_limit_and_quota_apply(keyed_app, redis_client):
    c = keyed_app.test_client()
    calls = {"/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]},
             "/v1/embeddings": {"model": MODEL_NAME, "input": "hi"}}
    for path, body in calls.items():
        for headers in ({}, bearer("sk-wrong")):
            assert_openai_error(c.post(path, json=body, headers=headers), 401, "invalid_api_key")
    assert c.get("/version", environ_base=REMOTE).get_json() == {"version": __version__}  # public, like /health
    # with a key: served, and /v1/embeddings (semantic layer off: its own load of the same model) spends tokens
    limiter = keyed_app.extensions["farm_auth"].limiter
    owner = owner_of(hashlib.sha256(KEY_A.encode()).hexdigest())
    assert c.post("/tokenize", json=calls["/tokenize"], headers=bearer(KEY_A)).status_code == 200
    assert c.post("/detokenize", json=calls["/detokenize"], headers=bearer(KEY_A)).status_code == 200
    assert limiter.used_tokens(owner) == 0  # tokenizing spends no tokens
    emb = _embed(c, ["hi", "there"], headers=bearer(KEY_A))
    assert len(emb["data"]) == 2 and limiter.used_tokens(owner) == emb["usage"]["prompt_tokens"] > 0
    # quota spent: embeddings are refused, tokenizing is not
    limiter.charge(owner, 1000)
    assert_openai_error(c.post("/v1/embeddings", json=calls["/v1/embeddings"], headers=bearer(KEY_A)), 429,
                        "insufficient_quota")
    assert c.post("/tokenize", json=calls["/tokenize"], headers=bearer(KEY_A)).status_code == 200
    # /tokenize and /detokenize count against the request rate like /v1 routes (4 a minute; 4 counted so far: refusals
    # are not counted)
    assert_openai_error(c.post("/detokenize", json=calls["/detokenize"], headers=bearer(KEY_A)), 429,
                        "rate_limit_exceeded")
    assert c.post("/detokenize", json=calls["/detokenize"], headers=bearer(KEY_B)).status_code == 200


# -- against a real worker (last: it starts its worker on a flushed database) ------------------------
@pytest.fixture
def real_worker(app, redis_url, tmp_path) -> Iterator[WorkerProc]:
    """One aggregated worker serving the default model, in the app's Redis database."""
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    worker = WorkerProc(make_farm_env(redis_url, tmp_path), "both", "utility-real", tmp_path)
    try:
        wait_registered(r, [worker])
        yield worker
    finally:
        worker.stop()
        r.close()


def test_a_real_chat_completions_prompt_tokens_is_the_tokenize_count(app, real_worker):
    c = app.test_client()
    model = _model(app)
    for messages in (MESSAGES, [{"role": "user", "content": "Name a colour. " * 20}]):
        tok = c.post("/tokenize", json={"model": model, "messages": messages}).get_json()
        resp = c.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2},
                      headers={"Cache-Control": "no-cache"})
        assert resp.status_code == 200, resp.data
        assert resp.headers["x-farm-decode-worker"] == real_worker.name
        assert resp.get_json()["usage"]["prompt_tokens"] == tok["count"]


def test_many_embeddings_leave_the_encoder_a_slice_at_a_time(app):
    """/v1/embeddings took the encoder input after input, so the semantic layer's request that arrived meanwhile
    waited for all of them (5 s behind 256 inputs of 256 tokens). Its inputs now join the encoder's queue a slice
    at a time, oldest first: the layer's short call is answered between two slices."""
    import threading
    import time

    embedder = app.extensions["farm"].embedder()
    long_ids = embedder.token_ids(["word " * 250] * 160)
    ended: dict[str, float] = {}

    def many() -> None:
        embedder.embed_many_ids(long_ids)
        ended["many"] = time.perf_counter()

    th = threading.Thread(target=many)
    th.start()
    time.sleep(0.3)
    embedder.encode_texts(["Is it going to rain tomorrow?"])
    ended["short"] = time.perf_counter()
    th.join()
    assert ended["short"] < ended["many"] - 0.5, ended
