"""Validation of OpenAI request bodies into token ids and sampling parameters (400s name the param)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from api.errors import APIError, bad_request
from api.openapi_models import ChatCompletionRequest, CompletionRequest, reject_unknown_fields
from farm.config import SamplingDefaults
from farm.protocol import SamplingParams
from farm.tokenization import chat_prompt_ids, text_prompt_ids

CHAT_ROLES = {"system", "user", "assistant", "developer"}  # developer is sent to the template as system
UNSUPPORTED = {"logprobs": "logprobs", "top_logprobs": "logprobs", "tools": "tool calling",
               "tool_choice": "tool calling", "functions": "function calling", "function_call": "function calling",
               "response_format": "structured output", "logit_bias": "logit_bias"}


@dataclass
class ParsedRequest:
    """A validated request: what the gateway needs (token ids, sampling) plus the response flags."""

    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _type_check(body: dict, name: str, types: tuple, desc: str) -> Any:
    """body[name] if present and of `types` (booleans only where asked for), else a 400 naming it."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in types:
        raise bad_request(f"'{name}' must be {desc}, got a boolean", name)
    if not isinstance(v, types):
        raise bad_request(f"'{name}' must be {desc}, got {type(v).__name__}", name)
    return v


def _number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = _type_check(body, name, (int, float), "a number")
    if v is None:
        return default
    if not math.isfinite(v):
        raise bad_request(f"'{name}' must be a finite number", name, "invalid_value")
    if v > hi or v < lo or (lo_open and v == lo):
        lo_s = f"> {lo}" if lo_open else f">= {lo}"
        raise bad_request(f"'{name}' must be {lo_s} and <= {hi}, got {v}", name, "invalid_value")
    return float(v)


def _common(body: dict, prompt_len: int, max_model_len: int, prompt_param: str,
            defaults: SamplingDefaults | None = None) -> tuple[SamplingParams, bool, bool]:
    """Sampling parameters and stream flags shared by chat and completions, checked like OpenAI's;
    parameters the body leaves out come from the model entry's `defaults`."""
    defaults = defaults or SamplingDefaults()
    for key, what in UNSUPPORTED.items():
        if body.get(key) not in (None, False, [], {}) and not (key == "response_format"
                                                          and body[key] == {"type": "text"}):
            raise bad_request(f"'{key}' is not supported by this server ({what})", key, "unsupported_parameter")
    n = _type_check(body, "n", (int,), "an integer")
    if n is not None and n != 1:
        raise bad_request("only n=1 is supported", "n", "unsupported_value")
    temperature = _number(body, "temperature", 0.0, 2.0, defaults.temperature)
    top_p = _number(body, "top_p", 0.0, 1.0, defaults.top_p, lo_open=True)
    for pen in ("presence_penalty", "frequency_penalty"):
        _number(body, pen, -2.0, 2.0, 0.0)  # accepted for compatibility, not applied
    seed = _type_check(body, "seed", (int,), "an integer")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > 4:
            raise bad_request("'stop' may hold at most 4 sequences", "stop", "invalid_value")
        stops = list(stop)
    else:
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    stops = [s for s in stops if s]
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name wins when both are given
        v = _type_check(body, name, (int,), "an integer")
        if v is not None:
            if v < 1:
                raise bad_request(f"'{name}' must be >= 1, got {v}", name, "invalid_value")
            max_tokens = v
    if prompt_len >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; your prompt has "
                          f"{prompt_len} tokens.", prompt_param, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
        if defaults.max_tokens is not None:
            max_tokens = min(max_tokens, defaults.max_tokens)
    elif prompt_len + max_tokens > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                          "completion). Reduce the prompt or max_tokens.", "max_tokens", "context_length_exceeded")
    ignore_eos = _type_check(body, "ignore_eos", (bool,), "a boolean") or False  # vLLM extension
    stream = _type_check(body, "stream", (bool,), "a boolean") or False
    opts = _type_check(body, "stream_options", (dict,), "an object") or {}
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    if opts and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            stop=stops, ignore_eos=ignore_eos)
    return params, stream, include_usage


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported",
                                  f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def normalize_messages(body: dict) -> list[dict[str, str]]:
    """`messages` as [{"role", "content": str}] for the chat template; developer becomes system."""
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                              f"messages[{i}].role")
        out.append({"role": "system" if role == "developer" else role, "content": _content_text(m.get("content"), i)})
    return out


def validate_chat(body: dict) -> list[dict[str, str]]:
    """The checks of a chat body that need no model: declared fields, then the messages (normalized)."""
    reject_unknown_fields(body, ChatCompletionRequest)
    return normalize_messages(body)


def local_params(body: dict) -> tuple[SamplingParams, bool, bool]:
    """(sampling, stream, include_usage) of a request answered without a model (semantic block or cache
    hit), after the same checks of every parameter as a generated answer gets. `max_tokens` is only
    bounded when the body sets it (there is no prompt length to bound it by)."""
    return _common(body, 0, 1 << 30, "messages")


def stream_flags(body: dict) -> tuple[bool, bool]:
    _, stream, include_usage = local_params(body)
    return stream, include_usage


def parse_chat(body: dict, tokenizer, max_model_len: int, messages: list[dict[str, str]] | None = None,
               defaults: SamplingDefaults | None = None) -> ParsedRequest:
    """Validate a /v1/chat/completions body (model already checked) and apply the chat template to
    `messages` (the body's, normalized, unless the semantic layer rewrote them)."""
    if messages is None:
        messages = validate_chat(body)
    try:
        ids = chat_prompt_ids(tokenizer, messages)
    except Exception as e:  # a template that rejects the conversation (e.g. role order)
        raise bad_request(f"the model's chat template rejected these messages: {e}", "messages") from None
    params, stream, include_usage = _common(body, len(ids), max_model_len, "messages", defaults)
    return ParsedRequest(body["model"], ids, params, stream, include_usage, {"messages": messages})


def parse_completion(body: dict, tokenizer, max_model_len: int,
                     defaults: SamplingDefaults | None = None) -> ParsedRequest:
    """Validate a /v1/completions body (model already checked): one prompt, as text or token ids."""
    reject_unknown_fields(body, CompletionRequest)
    for key in ("echo", "suffix"):
        if body.get(key):
            raise bad_request(f"'{key}' is not supported by this server", key, "unsupported_parameter")
    if body.get("logprobs") is not None and body["logprobs"] is not False:  # an integer here; even 0 asks
        raise bad_request("'logprobs' is not supported by this server", "logprobs", "unsupported_parameter")
    best_of = _type_check(body, "best_of", (int,), "an integer")
    if best_of not in (None, 1):
        raise bad_request("only best_of=1 is supported", "best_of", "unsupported_value")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        ids = text_prompt_ids(tokenizer, prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer)
        if any(t < 0 or t >= vocab for t in prompt):
            raise bad_request(f"token ids in 'prompt' must be in [0, {vocab})", "prompt", "invalid_value")
        ids = list(prompt)
    elif prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    else:
        raise bad_request("'prompt' must be a string, a list of token ids, or a list with one of those "
                          "(batched prompts are not supported)", "prompt")
    params, stream, include_usage = _common(body, len(ids), max_model_len, "prompt", defaults)
    return ParsedRequest(body["model"], ids, params, stream, include_usage)


def require_model(body: Any, known: list[str]) -> str:
    """The body must be an object naming a configured model (unknown: 404 model_not_found)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise bad_request("'model' is required", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model not in known:
        raise APIError(404, f"The model '{model}' does not exist. Available: {', '.join(known)}", param="model",
                       code="model_not_found")
    return model
