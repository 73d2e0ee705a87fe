"""Validation and answers of `/tokenize`, `/detokenize` (vLLM's shapes) and `/v1/embeddings` (OpenAI's), without a
web framework: bodies are checked against farm/openai/utility_schemas.py, failures are 400s naming the param
(404 `model_not_found` for an unknown model), and the API's routes (api/routes/utility.py, api/routes/embeddings.py)
hand in the tokenizer or the embedder.

`/tokenize` goes through the same templating as a chat completion (farm.models.tokenization.chat_prompt_ids, after
the same message normalisation), so its ids are the prompt a chat completion of those messages would send.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from farm.models.tokenization import PromptTooLong, chat_prompt_ids, text_prompt_ids
from farm.openai.api_error import APIError, bad_request
from farm.openai.parsing import (
    chat_options,
    check_prompt_chars,
    messages_chars,
    normalize_messages,
    prompt_char_limit,
)
from farm.openai.tools import ToolRequest, check_tools, template_inputs
from farm.openai.utility_schemas import (
    MAX_EMBEDDING_INPUTS,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from farm.openai.validation import validated


def resolve_model(asked: str | None, models: Sequence[str], default: str, aliases: Sequence[str] = ()) -> str:
    """The configured model a /tokenize or /detokenize request names (the farm's default when it names none)."""
    if asked is None:
        return default
    if asked in models:
        return asked
    if asked in aliases:
        raise bad_request(f"'{asked}' lets the semantic layer choose a model per request, and each model has its own "
                          f"tokenizer: name one of {', '.join(models)}", "model", "model_not_supported")
    raise APIError(404, f"The model '{asked}' does not exist. Available: {', '.join(models)}", param="model",
                   code="model_not_found")


# -- /tokenize -------------------------------------------------------------------------------------
@dataclass
class TokenizeJob:
    """A validated /tokenize body: `messages` (normalized as a chat completion's) or `prompt`."""

    model: str | None
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None  # rendered as a chat completion with these tools renders them


def parse_tokenize(body: Any) -> TokenizeJob:
    """vLLM's two forms: {prompt, add_special_tokens} or {messages, add_generation_prompt, continue_final_message,
    chat_template_kwargs, add_special_tokens}; either with return_token_strs. The chat form's template options are
    checked by the chat route's own `chat_options`, so both read them alike."""
    if isinstance(body, dict) and "messages" in body:
        if "prompt" in body:
            raise bad_request("give either 'prompt' or 'messages', not both", "prompt")
        messages = normalize_messages(body)  # first: the chat route's own checks and messages
        req: TokenizeChatRequest = validated(TokenizeChatRequest, body)
        if req.chat_template is not None:
            raise bad_request("'chat_template' is not supported by this server: the model's own chat template applies,"
                              " as in a chat completion", "chat_template", "unsupported_parameter")
        opts = chat_options(body)
        tools = check_tools(body["tools"]) if body.get("tools") else None
        return TokenizeJob(req.model, messages=messages, add_special_tokens=opts.add_special_tokens,
                           add_generation_prompt=opts.add_generation_prompt,
                           continue_final_message=opts.continue_final_message, template_kwargs=opts.template_kwargs,
                           return_token_strs=bool(req.return_token_strs), tools=tools)
    if isinstance(body, dict) and "prompt" not in body:
        raise bad_request("'prompt' or 'messages' is required", "prompt", "missing_required_parameter")
    plain: TokenizeCompletionRequest = validated(TokenizeCompletionRequest, body)
    return TokenizeJob(plain.model, prompt=plain.prompt, add_special_tokens=plain.add_special_tokens,
                       return_token_strs=bool(plain.return_token_strs))


def _chat_ids(job: TokenizeJob, tokenizer, tool_parser: str | None, max_chars: int) -> list[int]:
    """The chat completion's prompt ids (chat_prompt_ids after template_inputs, as parse_chat calls them; with tools,
    as a request whose model may call them; `add_special_tokens` as a chat completion's). A rendered prompt over
    `max_chars` (tools and template variables are not in the messages' own count) raises PromptTooLong before it is
    tokenized, as in parse_chat."""
    assert job.messages is not None
    tools = ToolRequest(job.tools, "auto", parser=tool_parser) if job.tools else None
    messages, tool_list = template_inputs(job.messages, tools, tokenizer, tool_parser)
    return chat_prompt_ids(tokenizer, messages, job.template_kwargs, tools=tool_list,
                           add_generation_prompt=job.add_generation_prompt,
                           continue_final_message=job.continue_final_message, max_chars=max_chars,
                           add_special_tokens=job.add_special_tokens)


def tokenize(job: TokenizeJob, tokenizer, max_model_len: int, chars_per_token: int = 0,
             tool_parser: str | None = None) -> dict[str, Any]:
    """vLLM's TokenizeResponse. A prompt too long to fit the model by its characters alone is refused before it
    is tokenized, as the generation routes refuse it (farm.openai.parsing.prompt_char_limit); a longer one that
    may fit is counted, also when it has more than max_model_len tokens."""
    limit = prompt_char_limit(tokenizer, max_model_len, chars_per_token)
    if job.messages is not None:
        check_prompt_chars(messages_chars(job.messages), limit, max_model_len, "messages")
        try:
            ids = _chat_ids(job, tokenizer, tool_parser, limit)
        except PromptTooLong as e:
            check_prompt_chars(e.chars, limit, max_model_len, "messages")
            raise
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation or a variable
            raise bad_request(f"the model's chat template rejected these messages: {e}", "messages") from None
    else:
        assert job.prompt is not None
        check_prompt_chars(len(job.prompt), limit, max_model_len, "prompt")
        ids = text_prompt_ids(tokenizer, job.prompt, job.add_special_tokens)
    strs = [str(s) for s in tokenizer.convert_ids_to_tokens(ids)] if job.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


# -- /detokenize -----------------------------------------------------------------------------------
def parse_detokenize(body: Any) -> DetokenizeRequest:
    return validated(DetokenizeRequest, body)


def detokenize(tokens: list[int], tokenizer) -> dict[str, str]:
    """vLLM's DetokenizeResponse: the ids decoded as vLLM decodes them (special tokens kept); an id outside the
    vocabulary is a 400."""
    vocab = len(tokenizer)
    for i, t in enumerate(tokens):
        if t >= vocab:
            raise bad_request(f"token ids in 'tokens' must be in [0, {vocab}), got {t} at tokens[{i}]", "tokens",
                              "invalid_value")
    return {"prompt": tokenizer.decode(tokens)}


# -- /v1/embeddings --------------------------------------------------------------------------------
@dataclass
class EmbeddingJob:
    """A validated /v1/embeddings body."""

    model: str
    texts: list[str]
    encoding_format: str = "float"
    truncate: int | None = None  # cut each input to this many tokens (-1: the window)


def _texts(body: dict[str, Any]) -> list[str]:
    """`input` as a list of non-empty strings; token ids are refused (they would be another tokenizer's)."""
    if "input" not in body:
        raise bad_request("'input' is required", "input", "missing_required_parameter")
    raw = body["input"]
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts:
        raise bad_request("'input' must be a string or a non-empty list of strings", "input")
    if any(type(t) is int or isinstance(t, list) for t in texts):
        raise bad_request("token ids as 'input' are not supported: send the text. (Ids from another model's "
                          "tokenizer, e.g. tiktoken's, would mean nothing to this embedding model; with LangChain's "
                          "OpenAIEmbeddings set check_embedding_ctx_length=False.)", "input", "unsupported_value")
    if not all(isinstance(t, str) for t in texts):
        raise bad_request("'input' must be a string or a non-empty list of strings", "input")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"'input' may hold at most {MAX_EMBEDDING_INPUTS} strings, got {len(texts)}", "input",
                          "invalid_value")
    for i, t in enumerate(texts):
        param = _input_param(i, texts)
        if not t:
            raise bad_request(f"'{param}' must not be an empty string", param, "invalid_value")
    return texts


def parse_embeddings(body: Any, names: Sequence[str], dim: int, generative: Sequence[str] = ()) -> EmbeddingJob:
    """The body of /v1/embeddings for the embedding model called one of `names` (the first is its name) with
    `dim` dimensions; a generative model's name (`generative`) is a 400, any other a 404."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    texts = _texts(body)
    req: EmbeddingRequest = validated(EmbeddingRequest, body)
    model = names[0] if req.model is None else req.model
    if model in generative:
        raise bad_request(f"The model '{model}' generates text and has no embeddings here; /v1/embeddings serves "
                          f"'{names[0]}'", "model", "model_not_supported")
    if model not in names:
        raise APIError(404, f"The model '{model}' does not exist. Available for embeddings: {names[0]}",
                       param="model", code="model_not_found")
    if req.dimensions is not None and req.dimensions != dim:
        raise bad_request(f"'dimensions' must be {dim}: {names[0]} has {dim} dimensions and cannot shorten its "
                          "embeddings", "dimensions", "unsupported_value")
    return EmbeddingJob(model, texts, req.encoding_format, req.truncate_prompt_tokens)


def embedding_inputs(job: EmbeddingJob, tokenize: Callable[[list[str]], list[list[int]]], window: int,
                     char_limit: int) -> tuple[list[list[int]], int]:
    """The inputs' ids (`tokenize`: [CLS] + tokens + [SEP]) and how many of them each may keep: the model's
    `window`, or vLLM's `truncate_prompt_tokens` (2..window, -1 = the window), to which the caller cuts longer ones
    keeping [CLS] + their start + [SEP]. Without truncate_prompt_tokens an input longer than the window is a 400, as
    vLLM answers. As vLLM does, an input of more than `char_limit` characters (window x the vocabulary's longest
    entry) is refused before it is tokenized, or, when truncating, cut to that many characters first."""
    truncating = job.truncate is not None
    keep = window
    if truncating and job.truncate != -1:
        if not 2 <= job.truncate <= window:
            raise bad_request(f"'truncate_prompt_tokens' must be -1 or in [2, {window}], got {job.truncate}",
                              "truncate_prompt_tokens", "invalid_value")
        keep = job.truncate
    texts = []
    for i, text in enumerate(job.texts):
        if len(text) > char_limit:
            if not truncating:
                raise bad_request(f"This model's maximum context length is {window} tokens. However, "
                                  f"{_input_param(i, job.texts)} has {len(text)} characters, more than {window} "
                                  "tokens can hold. Please reduce its length, or send truncate_prompt_tokens.",
                                  _input_param(i, job.texts), "context_length_exceeded")
            text = text[:char_limit]
        texts.append(text)
    ids = tokenize(texts)
    if not truncating:
        for i, one in enumerate(ids):
            if len(one) > window:
                raise bad_request(f"This model's maximum context length is {window} tokens. However, "
                                  f"{_input_param(i, ids)} has {len(one)} tokens. Please reduce its length, or send "
                                  "truncate_prompt_tokens.", _input_param(i, ids), "context_length_exceeded")
    return ids, keep


def _input_param(i: int, inputs: Sequence[Any]) -> str:
    return f"input[{i}]" if len(inputs) > 1 else "input"


def embedding_response(model: str, vectors: Sequence[np.ndarray], prompt_tokens: int,
                       encoding_format: str = "float") -> dict[str, Any]:
    """OpenAI's embeddings list (with vLLM's id and created); base64 is each vector's little-endian float32 bytes,
    as OpenAI sends it (the openai SDK asks for it and decodes it with numpy)."""
    data = []
    for i, vec in enumerate(vectors):
        v = np.asarray(vec, dtype="<f4")
        emb: list[float] | str = base64.b64encode(v.tobytes()).decode("ascii") if encoding_format == "base64" \
            else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": int(prompt_tokens), "total_tokens": int(prompt_tokens)}}
