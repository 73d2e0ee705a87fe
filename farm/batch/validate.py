"""Up-front validation of a batch input file: every line is checked before any line runs.

A line must be a JSON object `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>,
"body": {...}}` with a custom_id unique in the file, and its body must pass exactly the validation of
the live endpoint (farm.openai.parsing: `require_model`, then `parse_chat` or `parse_completion`, which also
tokenizes the prompt). Any failure fails the whole batch with line-numbered errors
`{code, message, param, line}` (1-based line numbers, blank lines count but are skipped), so a batch
never runs half-way into a bad line. Each line is judged on its own: a hostile one (nested 100k deep, say)
is its own line's error, and the other lines' errors are still reported. What passes becomes a `PreparedLine`: the token ids and sampling
parameters the driver sends through the Gateway.

With the semantic layer on (`decide` given), every line goes through it as an API request would, but
without the semantic cache: the jailbreak and PII guards (a blocked line is prepared with its refusal as
the answer, recorded without any worker seeing it), and for `MoM`/`auto` the model selection and the
category's system prompt. A line's `model` is the model that answers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from farm.openai.api_error import APIError
from farm.openai.parsing import (
    completion_messages,
    local_params,
    parse_chat,
    parse_completion,
    pretrimmed,
    prompt_char_limit,
    raw_prompts,
    refuse_cutting_added_prompt,
    refuse_oversized,
    refuse_showing_added_prompt,
    require_model,
    truncation,
    validate_chat,
)
from farm.protocol.jsonsafe import JSONTooDeep, loads_bounded
from farm.semantic.embeddings import MODEL_NAMES as EMBEDDING_MODELS
from farm.semantic.layer import H_INJECTED

ENDPOINT_KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# A line is {custom_id, method, url, body}: one level above a request body (farm.protocol.jsonsafe.MAX_JSON_DEPTH, 32).
# Deeper lines are refused on their own line, before anything walks them recursively.
MAX_LINE_DEPTH = 33


@dataclass
class PreparedLine:
    index: int  # position among the file's requests (0-based, input order)
    line: int  # line number in the file (1-based)
    custom_id: str
    kind: str  # chat | completion
    model: str
    prompt_ids: list[int]
    sampling: dict[str, Any]
    answer: str | None = None  # set when the semantic layer answered (a guard's refusal): nothing to generate
    finish_reason: str | None = None
    cache_salt: str | None = None  # the line's own `cache_salt` (vLLM's field), combined with its owner's
    role: str = "assistant"  # chat: the answer's role and the text it starts with (vLLM's echo; ParsedRequest)
    echo: str = ""
    prompt_only: bool = False  # vLLM's echo with max_tokens 0 (ParsedRequest.prompt_only)
    return_token_ids: bool = False  # vLLM's: the answer carries its prompt's and its own token ids
    echo_logprobs: bool = False  # a completion's echo with logprobs (ParsedRequest.echo_logprobs)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs asked for (ParsedRequest.prompt_logprobs)
    tools: dict[str, Any] | None = None  # chat: the line's tools (farm.openai.tools.ToolRequest.to_dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> PreparedLine:
        return cls(**json.loads(raw))


def _err(code: str, message: str, line: int | None, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def validate_input(data: bytes, endpoint: str, models: list[str], tokenizer_for: Callable[[str], Any],
                   max_model_len: Callable[[str], int], max_lines: int = 50_000,
                   max_errors: int = 100, defaults_for: Callable[[str], Any] | None = None,
                   decide: Callable[[str, list[dict]], Any] | None = None, aliases: list[str] | None = None,
                   tool_parser_for: Callable[[str], str | None] | None = None,
                   reveal_injected_prompt: bool = False,
                   ) -> tuple[list[PreparedLine], list[dict[str, Any]]]:
    """(prepared lines, errors); the batch may run only when `errors` is empty. `decide(model, messages)`
    is the semantic layer's verdict (farm.semantic.layer.Verdict) without the cache; `aliases` are the
    model names it resolves (MoM, auto); `tool_parser_for(model)` is the model's tool-call parser (what
    `tool_choice: auto` needs); `reveal_injected_prompt` (semantic.reveal_injected_prompt) lets a line show
    its prompt's tokens after the layer added a category's system prompt."""
    kind = ENDPOINT_KINDS.get(endpoint)
    if kind is None:
        return [], [_err("invalid_endpoint", f"unsupported endpoint {endpoint!r}", None, "endpoint")]
    lines: list[PreparedLine] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    n_requests = 0
    for no, raw in enumerate(data.split(b"\n"), start=1):
        if len(errors) >= max_errors:
            break
        if not raw.strip():
            continue
        n_requests += 1
        if n_requests > max_lines:
            errors.append(_err("too_many_requests", f"a batch may hold at most {max_lines} requests", no))
            break
        try:
            obj = loads_bounded(raw.decode("utf-8"), MAX_LINE_DEPTH)
        except UnicodeDecodeError:
            errors.append(_err("invalid_json_line", "This line is not valid UTF-8.", no))
            continue
        except JSONTooDeep:
            errors.append(_err("json_too_deep", f"This line nests deeper than {MAX_LINE_DEPTH} levels.", no))
            continue
        except ValueError:
            errors.append(_err("invalid_json_line", "This line is not parseable as valid JSON.", no))
            continue
        if not isinstance(obj, dict):
            errors.append(_err("invalid_json_line", "Each line must be a JSON object.", no))
            continue
        cid = obj.get("custom_id")
        if cid is None:
            errors.append(_err("missing_required_parameter", "'custom_id' is required", no, "custom_id"))
            continue
        if not isinstance(cid, str) or not cid:
            errors.append(_err("invalid_custom_id", "'custom_id' must be a non-empty string", no, "custom_id"))
            continue
        if cid in seen:
            errors.append(_err("duplicate_custom_id", f"The custom_id {cid!r} is already used on line "
                                                      f"{seen[cid]}; each custom_id must be unique.", no,
                               "custom_id"))
            continue
        seen[cid] = no
        method = obj.get("method")
        if method != "POST":
            errors.append(_err("invalid_method", f"'method' must be POST, got {method!r}", no, "method"))
            continue
        url = obj.get("url")
        if url != endpoint:
            errors.append(_err("mismatched_url", f"'url' must be the batch's endpoint {endpoint!r}, got {url!r}",
                               no, "url"))
            continue
        body = obj.get("body")
        if not isinstance(body, dict):
            errors.append(_err("invalid_body", "'body' must be a JSON object", no, "body"))
            continue
        if body.get("stream"):
            errors.append(_err("unsupported_value", "'stream' is not supported in a batch", no, "body.stream"))
            continue
        try:
            model = require_model(body, models + (list(aliases or []) if decide else []), EMBEDDING_MODELS)
            messages, injected = None, False
            if kind == "completion" and len(raw_prompts(body)) != 1:  # before the layer pays for each of them
                errors.append(_err("unsupported_value", "a batch line holds one prompt; give each prompt a line of "
                                   "its own", no, "body.prompt"))
                continue
            if decide is not None:
                if kind == "chat":
                    asked = validate_chat(body)
                else:
                    asked = completion_messages(body, tokenizer_for(model))  # an alias: the default model's
                names = models if model in (aliases or []) else [model]  # before the layer pays for a huge line
                bounds = [(tokenizer_for(m), max_model_len(m)) for m in names]
                cut = pretrimmed(body, kind, [(t, n, prompt_char_limit(t, n)) for t, n in bounds]) \
                    if truncation(body)[0] is not None else None
                if cut is not None:  # vLLM's truncation: cut to what a model could keep
                    body = cut
                    asked = validate_chat(body) if kind == "chat" else completion_messages(body, tokenizer_for(model))
                else:
                    refuse_oversized(bounds, asked, "messages" if kind == "chat" else "prompt")
                v = decide(model, asked)
                if v.action == "block":
                    local_params(body, kind)  # its parameters are still checked like the API's
                    lines.append(PreparedLine(len(lines), no, cid, kind, v.model, [], {}, v.answer or "",
                                              v.finish_reason or "content_filter"))
                    continue
                injected = bool(v.headers.get(H_INJECTED))
                if injected and not reveal_injected_prompt:
                    refuse_showing_added_prompt(body)
                model = v.model
                messages = v.messages if kind == "chat" else None
            defaults = defaults_for(model) if defaults_for else None
            if kind == "chat":
                parsed = parse_chat(body, tokenizer_for(model), max_model_len(model), messages, defaults,
                                    tool_parser=tool_parser_for(model) if tool_parser_for else None)
            else:
                parsed = parse_completion(body, tokenizer_for(model), max_model_len(model), defaults)
            if injected:
                refuse_cutting_added_prompt(parsed)
        except APIError as e:
            errors.append(_err(e.code or "invalid_request", e.message, no, f"body.{e.param}" if e.param else "body"))
            continue
        if parsed.n != 1:  # one line, one response body: the Batch API runs each line as one request
            errors.append(_err("unsupported_value", "'n' greater than 1 is not supported in a batch line; give each "
                               "sample a line of its own", no, "body.n"))
            continue
        lines.append(PreparedLine(len(lines), no, cid, kind, model, parsed.prompt_ids, parsed.sampling.to_dict(),
                                  cache_salt=parsed.cache_salt, role=parsed.role, echo=parsed.prompt_of(0).echo,
                                  prompt_only=parsed.prompt_only, return_token_ids=parsed.return_token_ids,
                                  echo_logprobs=parsed.echo_logprobs, prompt_logprobs=parsed.prompt_logprobs,
                                  tools=parsed.tools.to_dict() if parsed.tools is not None else None))
    if not errors and not lines:
        errors.append(_err("empty_file", "The input file holds no requests.", None, "input_file_id"))
    return lines, errors
