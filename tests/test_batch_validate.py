"""Batch input validation (line-numbered errors, same rules as the live endpoints) and prefix-grouped
scheduling, with the real default model's tokenizer; no farm needed."""

from __future__ import annotations

import json

import pytest

from farm.batch.schedule import Plan, prefix_order
from farm.batch.validate import PreparedLine, validate_input
from farm.config import load_config
from farm.models.tokenization import get_tokenizer
from farm.protocol.hashing import block_hashes
from farm.semantic.layer import H_INJECTED, SemanticLayer

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def env():
    cfg = load_config(environ={})
    tok = get_tokenizer(cfg, cfg.default_model)
    models = [m.name for m in cfg.models]

    def run(text: str, endpoint: str = CHAT, **kw):
        return validate_input(text.encode(), endpoint, models, lambda m: tok,
                              lambda m: cfg.model(m).max_model_len, **kw)

    return cfg, run


def line(cfg, cid, content="Hi", url=CHAT, method="POST", **body):
    b = {"model": cfg.default_model, "messages": [{"role": "user", "content": content}], **body}
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": b})


def test_valid_file_prepares_every_line_in_order(env):
    cfg, run = env
    text = "\n".join(line(cfg, f"r{i}", f"Question {i}?", max_tokens=5, temperature=0) for i in range(3)) + "\n\n"
    lines, errors = run(text)
    assert errors == []
    assert [ln.custom_id for ln in lines] == ["r0", "r1", "r2"] and [ln.line for ln in lines] == [1, 2, 3]
    assert lines[0].sampling["max_tokens"] == 5 and lines[0].sampling["temperature"] == 0.0
    assert lines[0].prompt_ids and lines[0].kind == "chat"
    assert PreparedLine.from_json(lines[1].to_json()) == lines[1]


def test_every_bad_line_is_reported_with_its_line_number(env):
    cfg, run = env
    rows = [
        line(cfg, "ok-1"),                                          # 1 fine
        "{not json",                                                # 2
        line(cfg, "ok-1"),                                          # 3 duplicate custom_id
        line(cfg, "m", method="GET"),                               # 4 wrong method
        line(cfg, "u", url="/v1/completions"),                      # 5 URL is not the batch endpoint
        line(cfg, "t", temperature=5),                              # 6 fails the live validation
        json.dumps({"method": "POST", "url": CHAT, "body": {}}),    # 7 no custom_id
        "",                                                         # 8 blank: skipped
        json.dumps({"custom_id": "x", "method": "POST", "url": CHAT, "body": {"model": "nope", "messages": []}}),
        line(cfg, "big", max_tokens=10**6),                         # 10 context length
        "[1, 2]",                                                   # 11 not an object
        line(cfg, "s", stream=True),                                # 12 streaming in a batch
        line(cfg, "e").replace(cfg.default_model, "all-MiniLM-L6-v2"),  # 13 the embedding model, as live
    ]
    lines, errors = run("\n".join(rows))
    by_line = {e["line"]: e for e in errors}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13]
    assert by_line[2]["code"] == "invalid_json_line"
    assert by_line[3]["code"] == "duplicate_custom_id" and "line 1" in by_line[3]["message"]
    assert by_line[4]["code"] == "invalid_method" and by_line[4]["param"] == "method"
    assert by_line[5]["code"] == "mismatched_url"
    assert by_line[6]["code"] == "invalid_value" and by_line[6]["param"] == "body.temperature"
    assert by_line[7]["param"] == "custom_id"
    assert by_line[9]["code"] == "model_not_found"
    assert by_line[10]["code"] == "context_length_exceeded"
    assert by_line[12]["param"] == "body.stream"
    assert by_line[13]["code"] == "model_not_supported" and "/v1/embeddings" in by_line[13]["message"]
    assert all(set(e) == {"code", "message", "param", "line"} for e in errors)


def test_completions_endpoint_and_limits(env):
    cfg, run = env
    comp = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                       "body": {"model": cfg.default_model, "prompt": "Once upon", "max_tokens": 3}})
    lines, errors = run(comp, "/v1/completions")
    assert not errors and lines[0].kind == "completion" and lines[0].echo == ""
    echo = json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/completions",
                       "body": {"model": cfg.default_model, "prompt": "Once upon", "echo": True}})
    lines, errors = run(echo, "/v1/completions")
    assert not errors and lines[0].echo == "Once upon"  # each line's answer starts with its prompt
    assert not lines[0].prompt_only
    lines, errors = run(echo.replace('"echo": true', '"echo": true, "max_tokens": 0'), "/v1/completions")
    assert not errors and lines[0].prompt_only and lines[0].sampling["max_tokens"] == 1  # the prompt alone, as vLLM
    _, errors = run(comp.replace('"max_tokens": 3', '"max_tokens": 0'), "/v1/completions")
    assert [(e["code"], e["param"]) for e in errors] == [("invalid_value", "body.max_tokens")]  # 0 needs echo
    two = json.dumps({"custom_id": "p", "method": "POST", "url": "/v1/completions",
                      "body": {"model": cfg.default_model, "prompt": ["Once upon", "a time"]}})
    def decide(model, messages):  # the review: the layer paid for every prompt of such a line, then refused it
        raise AssertionError("a line with several prompts reached the semantic layer")

    _, errors = run(two, "/v1/completions", decide=decide)  # one line, one prompt: refused before the layer
    assert [(e["code"], e["param"], e["line"]) for e in errors] == [("unsupported_value", "body.prompt", 1)]
    _, errors = run("\n".join([comp.replace('"c"', f'"c{i}"') for i in range(3)]), "/v1/completions", max_lines=2)
    assert errors[-1]["code"] == "too_many_requests" and errors[-1]["line"] == 3
    _, errors = run("\n\n")
    assert errors[0]["code"] == "empty_file"
    bad = "\n".join("{" for _ in range(20))
    _, errors = run(bad, max_errors=5)
    assert len(errors) == 5


def test_a_line_past_the_context_is_refused_before_the_semantic_layer(env):
    """A line within the character limit but far past the context by its tokens (one long message, or thousands
    of empty turns) is a line error found before `decide` (the semantic layer) pays for it."""
    cfg, run = env
    max_len = cfg.model(cfg.default_model).max_model_len
    asked = []

    def decide(model, messages):
        asked.append(model)
        raise AssertionError("the semantic layer saw a line that cannot fit")

    turns = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * 1000  # within MAX_MESSAGES
    rows = [line(cfg, "long", "word " * (max_len * 3)),
            json.dumps({"custom_id": "turns", "method": "POST", "url": CHAT,
                        "body": {"model": cfg.default_model, "messages": [*turns, {"role": "user", "content": "hi"}]}})]
    _, errors = run("\n".join(rows), decide=decide, aliases=["MoM"])
    assert [(e["line"], e["code"], e["param"]) for e in errors] == [
        (1, "context_length_exceeded", "body.messages"), (2, "context_length_exceeded", "body.messages")]
    assert not asked


def test_a_truncated_line_is_cut_before_the_semantic_layer_reads_it(env):
    """vLLM's truncate_prompt_tokens in a batch line: the line past the context is kept, cut to its last tokens,
    and the semantic layer reads only the part of the text a model may read."""
    cfg, run = env
    max_len = cfg.model(cfg.default_model).max_model_len
    seen = []

    def decide(model, messages):
        seen.append(sum(len(m["content"]) for m in messages))
        return SemanticLayer.passthrough(model, messages)

    text = "".join(f"w{i} " for i in range(max_len * 25))
    lines, errors = run(line(cfg, "long", text, truncate_prompt_tokens=32, max_tokens=4), decide=decide)
    assert errors == [] and len(lines[0].prompt_ids) == 32 and seen and seen[0] < 2000
    lines, errors = run(line(cfg, "long", text, max_tokens=4), decide=decide)
    assert [e["code"] for e in errors] == ["context_length_exceeded"] and len(seen) == 1
    # no room for any prompt token beside max_tokens: refused by its size, the layer never reads it
    lines, errors = run(line(cfg, "long", text, max_tokens=max_len, truncate_prompt_tokens=-1), decide=decide)
    assert [e["code"] for e in errors] == ["context_length_exceeded"] and len(seen) == 1


def test_a_line_showing_the_prompt_the_layer_added_is_refused(env):
    """semantic.reveal_injected_prompt: a batch line asking for its prompt's tokens after the layer added a
    category's system prompt is a line error unless the operator allows it."""
    cfg, run = env

    def decide(model, messages):  # the layer's verdict when it adds a category's system prompt
        v = SemanticLayer.passthrough(model, [{"role": "system", "content": "Be a math tutor."}, *messages])
        v.headers[H_INJECTED] = "true"
        return v

    text = line(cfg, "ids", "What is 2+2?", return_token_ids=True)
    _, errors = run(text, decide=decide, aliases=["MoM"])
    assert [(e["code"], e["param"]) for e in errors] == [("invalid_value", "body.return_token_ids")]
    lines, errors = run(text, decide=decide, aliases=["MoM"], reveal_injected_prompt=True)
    assert errors == [] and lines[0].return_token_ids


def test_an_alias_truncates_for_the_models_that_have_room(env):
    """Under an alias, the models whose context cannot keep `truncate_prompt_tokens` are left out of the cut, not
    a 400 for all (the review: the smallest model's context refused what a larger one could serve); when none can,
    the first refusal is the answer."""
    from farm.openai.api_error import APIError
    from farm.openai.parsing import pretrimmed

    cfg, _ = env
    tok = get_tokenizer(cfg, cfg.default_model)
    body = {"model": "MoM", "prompt": "".join(f"w{i} " for i in range(20_000)), "truncate_prompt_tokens": 8000,
            "max_tokens": 16}
    cut = pretrimmed(body, "completion", [(tok, 4096, 4096 * 81), (tok, 32768, 32768 * 81)])
    assert cut is not None and len(tok.encode(cut["prompt"])) >= 8000 and body["prompt"].endswith(cut["prompt"])
    with pytest.raises(APIError) as e:
        pretrimmed(body, "completion", [(tok, 4096, 4096 * 81)])
    assert e.value.param == "truncate_prompt_tokens"


def _pl(i, ids, model="m"):
    return PreparedLine(i, i + 1, f"c{i}", "chat", model, ids, {})


def test_prefix_order_groups_shared_prefixes():
    bs = 4
    a, b = list(range(100, 116)), list(range(200, 216))  # two 4-block prefixes
    lines = [_pl(i, (a if i % 2 == 0 else b) + [i, i, i, i, i]) for i in range(8)]
    ordered, hashes = prefix_order(lines, bs)
    groups = [ln.prompt_ids[0] for ln in ordered]
    assert groups in ([100] * 4 + [200] * 4, [200] * 4 + [100] * 4)
    assert hashes[0] == block_hashes(lines[0].prompt_ids, bs)
    assert Plan(lines, "input", bs).order() == list(range(8))


def test_plan_waits_for_a_shared_prefix_to_be_computed_once():
    bs = 4
    a, b = list(range(100, 116)), list(range(200, 216))
    lines = [_pl(i, (a if i < 3 else b) + [i] * 4) for i in range(6)]
    plan = Plan(lines, "prefix", bs, warm_min_blocks=2)
    first = plan.next(0)
    second = plan.next(0)  # the other prefix's leader; the followers wait for their leaders' prefill
    assert {first.prompt_ids[0], second.prompt_ids[0]} == {100, 200}
    assert plan.next(0) is None
    plan.prefilled(first)
    followers = [plan.next(0), plan.next(0)]
    assert all(f.prompt_ids[0] == first.prompt_ids[0] for f in followers)
    assert plan.next(0) is None
    plan.finished(second)  # a leader that failed: the next line of its prefix leads instead
    lead2 = plan.next(0)
    assert lead2.prompt_ids[0] == second.prompt_ids[0] and plan.next(0) is None
    plan.prefilled(lead2)
    assert plan.next(0).prompt_ids[0] == second.prompt_ids[0] and len(plan) == 0
    plan.again(first, at=5.0)
    assert len(plan) == 1 and plan.next(1.0) is None and plan.next(6.0) is first


def test_a_line_with_tools_carries_them_to_its_answer(env):
    """A batch line's tools are checked as the live endpoint checks them (auto needs the model's parser) and kept with
    the line, so its answer's calls are read as a live answer's are."""
    from farm.openai.responses import Choice
    from farm.openai.tools import ToolRequest

    cfg, run = env
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    lines, errors = run(line(cfg, "t", tools=[tool], tool_choice="required"))
    assert errors == []
    back = PreparedLine.from_json(lines[0].to_json())
    assert back.tools is not None and back.sampling["response_format"]["type"] == "json_schema"
    choice = Choice.of('[{"name": "get_time", "parameters": {}}]', "stop", tools=ToolRequest.from_dict(back.tools))
    assert choice.finish_reason == "tool_calls" and choice.tool_calls[0].name == "get_time"
    _, errors = run(line(cfg, "t", tools=[tool]))  # auto, and this run names no model's parser
    assert errors and errors[0]["param"] == "body.tool_choice"
    _, errors = run(line(cfg, "t", tools=[tool]), tool_parser_for=lambda m: cfg.model(m).tool_call_parser)
    assert errors == []
